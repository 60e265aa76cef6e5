"""Run by ``torchrun`` from tests/test_distributed_processes.py (not a test module itself).

``python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed_worker.py
steps OUT``: the distributed private step of dpmf on real gloo processes, written to OUT for
the test to compare; ``train OUT CONFIG_JSON``: ``dpmf.train.run.train`` stopped after epoch 1.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _steps(out):
    import torch.distributed as dist
    from test_distributed import CASES_ON_PROCESSES, _batches, _data, _model, _optimizer

    from dpmf.distributed import DistributedPrivatizer, DivergenceError, TorchCollectives, rank_slice

    dist.init_process_group("gloo")
    comm = TorchCollectives()
    for name, kind, plan, dtype in CASES_ON_PROCESSES():
        model = _model(dtype)
        opt = _optimizer(kind, model)
        priv = DistributedPrivatizer(
            model,
            torch.nn.functional.cross_entropy,
            collectives=comm,
            plan=plan,
            clip_norm=1.0,
            seed=21,
            optimizer=opt,
            check_every=1,
        )
        opt.bind(priv)
        x, y = _data(dtype)
        for idx in _batches(plan):
            mine = rank_slice(idx, comm.rank, comm.world_size)
            priv.privatize(x[mine], y[mine])
            opt.step()
            priv.after_step()
            opt.zero_grad(set_to_none=True)
        torch.save([p.detach() for p in model.parameters()], os.path.join(out, f"{name}.rank{comm.rank}.pt"))
    from test_distributed import _private
    from test_distributed import _steps as take_steps

    run = _private(_model(torch.float64), process_group=dist.group.WORLD)
    take_steps(run, 5)
    torch.save(
        [p.detach() for p in run.model.parameters()], os.path.join(out, f"make_private.rank{comm.rank}.pt")
    )
    _, _, plan, dtype = CASES_ON_PROCESSES()[0]
    try:  # a different seed on rank 1 must be detected on every rank
        DistributedPrivatizer(
            _model(dtype),
            torch.nn.functional.cross_entropy,
            collectives=comm,
            plan=plan,
            clip_norm=1.0,
            seed=21 + comm.rank,
        )
        verdict = "undetected"
    except DivergenceError as exc:
        verdict = str(exc)
    with open(os.path.join(out, f"seed.rank{comm.rank}.txt"), "w") as f:
        f.write(verdict)
    dist.barrier()  # neither rank tears gloo down while the other is still in a collective
    dist.destroy_process_group()


def _train_then_stop(out, config_json):
    from dpmf.distributed.launch import shutdown
    from dpmf.train.config import TrainConfig
    from dpmf.train.run import train

    class Stop(Exception):
        pass

    def stop(epoch, row):
        raise Stop

    try:
        train(
            TrainConfig(**json.loads(config_json)),
            out,
            progress=False,
            log=lambda *a: None,
            on_epoch_end=[stop],
            distributed=True,
        )
    except Stop:
        pass
    shutdown()


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "steps":
        _steps(sys.argv[2])
    else:
        _train_then_stop(sys.argv[2], sys.argv[3])
    # every result is written and the process group destroyed: leave without the interpreter's
    # teardown, where gloo's background threads can abort the process (std::terminate, exit -6)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
