"""Run by ``torchrun`` from tests/test_fsdp.py (not a test module itself).

``python -m torch.distributed.run --standalone --nproc-per-node W tests/fsdp_worker.py steps OUT``:
the private step of dpmf on a fully_shard (FSDP2) model over W gloo processes, every case of
``fsdp_helpers.cases()`` and one make_private run; rank 0 writes the whole final weights to OUT.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _steps(out):
    import fsdp_helpers as h
    import torch.distributed as dist

    import dpmf.optim.optimizers as optimizers
    from dpmf.distributed import DistributedPrivatizer, TorchCollectives, rank_slice

    owned = []  # the matrices each step orthogonalised by owners (a record of the calls)
    by_owners = optimizers.orthogonalized_by_owners

    def recorded(updates, fn):
        owned.append(len(updates))
        return by_owners(updates, fn)

    optimizers.orthogonalized_by_owners = recorded
    dist.init_process_group("gloo")
    comm = TorchCollectives()
    x, y = h.data()
    for name, kind, plan in h.cases():
        owned.clear()
        model = h.shard(h.build())
        opt = h.optimizer(kind, model)
        priv = DistributedPrivatizer(
            model,
            torch.nn.functional.cross_entropy,
            collectives=comm,
            plan=plan,
            clip_norm=1.0,
            seed=h.SEED,
            optimizer=opt,
            check_every=1,
        )
        opt.bind(priv)
        for idx in h.batches(plan):
            mine = rank_slice(idx, comm.rank, comm.world_size)
            priv.privatize(x[mine], y[mine])
            opt.step()
            priv.after_step()
            opt.zero_grad(set_to_none=True)
        whole = [p.full_tensor().detach() for p in model.parameters()]
        local = sum(p.to_local().numel() for p in model.parameters())
        state = priv.noise_state_numel()
        if comm.rank == 0:
            torch.save({"weights": whole}, os.path.join(out, f"{name}.pt"))
        with open(os.path.join(out, f"{name}.rank{comm.rank}.txt"), "w") as f:
            f.write(f"{local} {state} {sum(owned)}")
    run = h.make_private_run(h.shard(h.build(torch.float64)), process_group=dist.group.WORLD)
    h.take_steps(run, 5)
    whole = [p.full_tensor().detach() for p in run.model.parameters()]
    if comm.rank == 0:
        torch.save({"weights": whole, "epsilon": run.get_epsilon()}, os.path.join(out, "make_private.pt"))
    tiny = h.tiny_batches_run(h.shard(h.build(torch.float64)), process_group=dist.group.WORLD)
    sizes = h.all_steps(tiny)
    whole = [p.full_tensor().detach() for p in tiny.model.parameters()]
    if comm.rank == 0:
        torch.save({"weights": whole, "sizes": sizes}, os.path.join(out, "tiny.pt"))
    dist.barrier()  # neither rank tears gloo down while another is still in a collective
    dist.destroy_process_group()


def _agree(out):
    """Ranks of unequal batches (3 and 1 examples; with and without micro-batches of 2) in
    lock-step; a NaN on rank 1 only at step 1, a batch other than the drawn one on rank 1 only,
    and an empty slice on rank 1 only: every rank's error message, one file per rank and case."""
    import fsdp_helpers as h
    import torch.distributed as dist

    from dpmf.distributed import DistributedPrivatizer, TorchCollectives
    from dpmf.distributed.step import BUCKET_ENTRIES

    dist.init_process_group("gloo")
    comm = TorchCollectives()
    x, y = h.data(torch.float64)
    refused = {}

    def sharded_run(**kw):
        model = h.shard(h.build(torch.float64))
        opt = h.optimizer("dp-sgd", model)
        priv = DistributedPrivatizer(
            model, torch.nn.functional.cross_entropy, collectives=comm, plan=h.UNEVEN, clip_norm=1.0,
            seed=h.SEED, optimizer=opt, **kw,
        )  # fmt: skip
        opt.bind(priv)
        return model, opt, priv

    def with_nan_on_rank_1(priv, case, mine):
        bad = x[mine].clone()
        bad[0, 0] = float("nan") if comm.rank == 1 else bad[0, 0]
        try:
            priv.privatize(bad, y[mine])
        except FloatingPointError as err:
            refused[case] = f"{type(err).__name__} {priv.noise.step} {err}"

    for micro in (None, 2):
        # micro-batches of 2: many buckets, several per pass
        model, opt, priv = sharded_run(micro_batch_size=micro, bucket_entries=16 if micro else BUCKET_ENTRIES)
        for t in range(h.UNEVEN.steps):
            mine = h.uneven_slice(t, comm.rank)
            if t == 1 and micro is None:
                with_nan_on_rank_1(priv, "nan", mine)
            priv.privatize(x[mine], y[mine])
            opt.step()
            opt.zero_grad(set_to_none=True)
        whole = [p.full_tensor().detach() for p in model.parameters()]
        if comm.rank == 0:
            torch.save(whole, os.path.join(out, f"uneven-{micro}.pt"))
        refused[f"peak-{micro}"] = str(priv.release_peak_entries)
        if micro is None:  # an empty slice on one rank, without padding
            try:
                priv.privatize(x[:0] if comm.rank == 1 else x[:2], y[:0] if comm.rank == 1 else y[:2])
            except ValueError as err:
                refused["empty"] = f"{type(err).__name__} {err}"
    # a NaN on rank 1 at the first step, inside the batch-independence probe's passes
    model, opt, priv = sharded_run()
    mine = slice(2 * comm.rank, 2 * comm.rank + 2)
    with_nan_on_rank_1(priv, "nan-probe", mine)
    priv.privatize(x[mine], y[mine])  # every rank probes again, together, and goes on
    opt.step()
    refused["nan-probe"] += f" | probed {priv._probed} step {priv.noise.step}"
    run = h.make_private_run(h.shard(h.build(torch.float64)), process_group=dist.group.WORLD)
    xb, yb = next(iter(run.data_loader))
    try:
        run.backward(xb.flip(0) if comm.rank == 1 else xb, target=yb, return_loss=False)
    except RuntimeError as err:
        refused["batch"] = f"{type(err).__name__} {err}"
    run.backward(xb, target=yb, return_loss=False)  # the drawn batch still goes through
    run.optimizer.step()
    for case, text in refused.items():
        with open(os.path.join(out, f"{case}.rank{comm.rank}.txt"), "w") as f:
            f.write(text)
    dist.barrier()
    dist.destroy_process_group()


def _save_or_resume(action, out):
    """``save``: 5 steps of make_private's run, then ``save``; ``resume``: that file resumed
    (at this W), 5 more steps, the whole weights written by rank 0."""
    import fsdp_helpers as h
    import torch.distributed as dist

    dist.init_process_group("gloo")
    run = h.make_private_run(h.shard(h.build(torch.float64)), process_group=dist.group.WORLD)
    path = os.path.join(out, "checkpoint.pt")
    if action == "save":
        h.take_steps(run, 5)
        run.save(path)
    else:
        run.resume(path)
        h.take_steps(run, 5)
        whole = [p.full_tensor().detach() for p in run.model.parameters()]
        if dist.get_rank() == 0:
            torch.save({"weights": whole, "step": run.steps_taken}, os.path.join(out, "resumed.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _gpt2(out):
    """A GPT-2 configuration with LoRA, every block and the root fully_shard-ed, 4 private steps
    of make_private; rank 0 writes the whole LoRA weights and the mean losses."""
    import gpt2_helpers as g
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    model = g.gpt2()
    for block in model.base_model.model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    run = g.private_run(model, process_group=dist.group.WORLD, noise_multiplier=0.5)
    losses = []
    for batch in run.data_loader:
        losses.append(float(run.backward(batch)))
        run.optimizer.step()
        run.optimizer.zero_grad()
    lora = {n: p.full_tensor().detach() for n, p in model.named_parameters() if p.requires_grad}
    if dist.get_rank() == 0:
        torch.save({"lora": lora, "losses": losses, "steps": run.steps_taken}, os.path.join(out, "gpt2.pt"))
    # the checkpoint keeps a digest of the frozen base weights: another base is refused
    from dpmf.distributed import TorchCollectives
    from dpmf.train.dcp import frozen_rows_digest

    run.save(os.path.join(out, "gpt2-checkpoint.pt"))
    digest = frozen_rows_digest(model, TorchCollectives())
    other = g.gpt2()
    with torch.no_grad():
        other.base_model.model.transformer.wte.weight[3, 1] += 1e-3  # another base model
    for block in other.base_model.model.transformer.h:
        fully_shard(block)
    fully_shard(other)
    rerun = g.private_run(other, process_group=dist.group.WORLD, noise_multiplier=0.5)
    try:
        rerun.resume(os.path.join(out, "gpt2-checkpoint.pt"))
        refused = "resumed"
    except ValueError as err:
        refused = str(err)
    with open(os.path.join(out, f"gpt2-frozen.rank{dist.get_rank()}.txt"), "w") as f:
        f.write(f"{digest}\n{refused}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "steps":
        _steps(sys.argv[2])
    elif sys.argv[1] == "gpt2":
        _gpt2(sys.argv[2])
    elif sys.argv[1] == "agree":
        _agree(sys.argv[2])
    else:
        _save_or_resume(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past gloo's teardown (as tests/distributed_worker.py)
