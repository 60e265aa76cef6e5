#!/usr/bin/env bash
# The checks that need a GPU, in under 8 minutes:
#   1. the CUDA tests of the suite (pytest -k cuda: they are skipped on machines without CUDA),
#      the coordinate-keyed noise of sharded ranks against the full stream on the GPU included;
#   2. one short training run on the GPU (dpmf train --device cuda, digits, 1 epoch);
#   3. one NCCL rank of the distributed step (torchrun, 1 process) against the one-process run;
#   4. the time of one private step with DP-Muon against one with DP-SGD at batch 1024
#      (per-example gradients, clipping, noise and the optimizer; medians of interleaved
#      repetitions, and the ratio);
#   5. raw noise made on the GPU against torch.randn there (benchmarks/bench_raw_noise.py);
#   6. the fully_shard (FSDP2) step on every GPU found (W = 1 is fine): dpmf train --distributed
#      --fsdp against the one-process run of stage 3, then benchmarks/bench_fsdp.py on them.
# Results go to $OUT/gpu_check.txt when OUT is set, else out/gpu_check.txt.
#
#   ./scripts/gpu_check.sh [VENV]        (VENV default .venv; created by scripts/setup.sh if absent)
#   DPMF_PYTHON=/path/to/python ./scripts/gpu_check.sh    (an existing interpreter; no setup)
#
# Exit status: 0 every check passed; 1 a check failed (see the report); 3 no CUDA device is
# usable by torch here, so nothing was checked (the report says why).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
OUTDIR=${OUT:-out}
mkdir -p "$OUTDIR"
REPORT="$OUTDIR/gpu_check.txt"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/dpmf-gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

if [ -n "${DPMF_PYTHON:-}" ]; then
  PY=$DPMF_PYTHON
else
  if [ ! -f "$VENV/.installed" ]; then
    ./scripts/setup.sh "$VENV" || { echo "gpu_check: setup failed" | tee "$REPORT"; exit 1; }
  fi
  PY="$VENV/bin/python"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's dpmf, whichever venv

{
  echo "dpmf GPU check, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
} >"$REPORT"

if ! "$PY" - >>"$REPORT" 2>&1 <<'EOF'
import sys

import torch

print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}")
if not torch.cuda.is_available():
    print("no CUDA device is usable by torch here (no GPU, no driver, or a CPU-only torch build)")
    sys.exit(3)
print(f"device: {torch.cuda.get_device_name(0)}")
EOF
then
  echo "status: skipped (no CUDA device); nothing was checked" >>"$REPORT"
  cat "$REPORT"
  exit 3
fi

failed=0
stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, log its tail, record pass/fail
  local name=$1 limit=$2
  shift 2
  local began=$SECONDS
  timeout "$limit" "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  {
    echo
    echo "== $name: $([ $rc = 0 ] && echo passed || echo "FAILED (exit $rc$([ $rc = 124 ] && echo ", over ${limit} s"))") in $((SECONDS - began)) s"
    tail -n 25 "$WORK/$name.log"
  } >>"$REPORT"
  [ $rc = 0 ] || failed=1
}

stage cuda-tests 150 "$PY" -m pytest -q -rs -k cuda -p no:cacheprovider \
  tests/test_train_cli.py tests/test_optimizers.py tests/test_filters.py tests/test_distributed.py \
  tests/test_raw_noise.py
if grep -q "skipped" "$WORK/cuda-tests.log"; then  # on this machine they must run, not skip
  echo "== cuda-tests: FAILED: some CUDA tests were skipped on a CUDA machine" >>"$REPORT"
  failed=1
fi

stage train-cuda 90 "$PY" -m dpmf train --dataset digits --epochs 1 --batch-size 256 \
  --noise-multiplier 1.0 --device cuda --no-progress --out "$WORK/train"

# one NCCL rank of the distributed step: the same run as one process with chunked noise keys
DIST_FLAGS=(--dataset digits --model mlp --optimizer dp-muon --factorization bsr:4 --scheme fixed_order
  --batch-size 128 --epochs 1 --epsilon 3 --seed 5 --device cuda --no-progress)
stage nccl-one-rank 150 bash -c "'$PY' -m torch.distributed.run --standalone --nproc-per-node 1 -m dpmf train \
  ${DIST_FLAGS[*]} --distributed --out '$WORK/nccl' && '$PY' -m dpmf train ${DIST_FLAGS[*]} --noise-keys chunked \
  --out '$WORK/one' && '$PY' -c \"
import torch, json
a = torch.load('$WORK/nccl/model.pt', weights_only=True); b = torch.load('$WORK/one/model.pt', weights_only=True)
d = max(float((a[k] - b[k]).abs().max()) for k in b)
r = json.load(open('$WORK/nccl/results.json'))['processes']
print('backend', r['backend'], 'largest weight difference NCCL rank vs one process', d)
assert r['backend'] == 'nccl' and d < 1e-5
\""

# the fully_shard (FSDP2) step on every GPU here: the same weights as the one-process run above
GPUS=$("$PY" -c "import torch; print(max(1, torch.cuda.device_count()))")
stage fsdp-gpus 150 bash -c "'$PY' -m torch.distributed.run --standalone --nproc-per-node $GPUS -m dpmf train \
  ${DIST_FLAGS[*]} --distributed --fsdp --out '$WORK/fsdp' && '$PY' -c \"
import torch, json
a = torch.load('$WORK/fsdp/model.pt', weights_only=True); b = torch.load('$WORK/one/model.pt', weights_only=True)
d = max(float((a[k] - b[k]).abs().max()) for k in b)
r = json.load(open('$WORK/fsdp/results.json'))['processes']
print('W', r['world_size'], 'backend', r['backend'], 'largest weight difference FSDP vs one process', d)
assert r['backend'] == 'nccl' and d < 1e-5
\" && '$PY' benchmarks/bench_fsdp.py --device cuda --worlds $GPUS --steps 5"

cat >"$WORK/step_timing.py" <<'EOF'
"""One private step (clip, sum, noise, optimizer) with DP-Muon against DP-SGD at batch 1024."""

import statistics
import time

import torch
import torch.nn.functional as F

from dpmf.optim import DPSGD, DPMuon
from dpmf.plan import PrivatePlan
from dpmf.step import build
from dpmf.train.models import build_model

device, batch, rounds = torch.device("cuda"), 1024, 15
torch.manual_seed(0)
x = torch.randn(batch, 1, 28, 28, device=device)
y = torch.randint(0, 10, (batch,), device=device)


def private_step(optimizer_class, **kw):
    model = build_model("cnn", (1, 28, 28), 10, seed=0).to(device)
    d = sum(p.numel() for p in model.parameters())
    # the plan's step (dpmf.step.build): noise drawn on the GPU, a fixed-size batch each step
    plan = PrivatePlan(batch, batch, steps=rounds + 5, scheme="fixed_order", noise_multiplier=1.0, clip_norm=1.0)
    dp = build(plan, model, F.cross_entropy)
    opt = optimizer_class(model.parameters(), **kw)
    dp.bind(opt)
    assert dp.noise.generator.name.startswith("torch-philox-cuda"), dp.noise.generator

    def step():
        dp.take(opt, lambda idx: (x, y, idx))

    return step, d


steps = {"dp-sgd": private_step(DPSGD, lr=0.5, momentum=0.9), "dp-muon": private_step(DPMuon, lr=0.05)}
times = {name: [] for name in steps}
for name, (step, _) in steps.items():  # warm-up (kernels, caches)
    step()
torch.cuda.synchronize()
for _ in range(rounds):  # interleaved, so load hits both alike
    for name, (step, _) in steps.items():
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times[name].append(time.perf_counter() - t0)
med = {name: 1e3 * statistics.median(t) for name, t in times.items()}
print(f"cnn, {steps['dp-sgd'][1]} parameters, batch {batch}, {rounds} interleaved rounds, medians:")
for name, ms in med.items():
    print(f"  {name:8s} {ms:8.2f} ms per private step")
print(f"  ratio dp-muon / dp-sgd: {med['dp-muon'] / med['dp-sgd']:.3f}")
print(f"  peak GPU memory: {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
EOF
stage step-timing 60 "$PY" "$WORK/step_timing.py"

# raw noise on the device against torch.randn on the device (target ≤ 1.5×)
stage raw-noise 60 "$PY" benchmarks/bench_raw_noise.py --device cuda --dim 10000000 --reps 15 \
  --json "$WORK/raw_noise.json"

echo >>"$REPORT"
if [ $failed = 0 ]; then echo "status: all checks passed" >>"$REPORT"; else echo "status: FAILED" >>"$REPORT"; fi
cat "$REPORT"
exit $failed
