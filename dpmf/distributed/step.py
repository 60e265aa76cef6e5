"""The private step of one run spread over W processes, with exactly the noise of one process.

Every process draws the same global batch from the plan's sampler and handles its slice
(``sharding.RankSlices``, the one way a rank takes its examples); per-example clipping is local.
Then, by ``mode``:

``sharded`` (default)
    each trainable parameter has one owner (``sharding.assign_owners``); one reduce per
    owner brings the parameter's clipped sum Σ_r s_r to it (together one gradient's worth, a
    reduce-scatter by whole parameters); the owner adds σζ·sens·(C⁻¹Z)_t on its coordinates
    only — its noise state is its parameters' share of the total, ≈ 1/W — divides by B̄ and
    runs the optimizer update (Newton–Schulz on whole matrices, filter and DiSK state on the
    owner); ``after_step`` broadcasts each owner's parameters (an all-gather).
``replicated``
    an all-reduce of the clipped sums; every process adds the full, identical noise and runs
    the full update (a cross-check: W copies of the noise state and of the optimizer).
``rank0``
    rank 0 adds the full noise to its local sum before the all-reduce (how DP-SGD libraries
    without correlated noise do it); every process runs the full update.
``fsdp`` (a model sharded by ``fully_shard``, FSDP2; chosen for DTensor parameters)
    each rank holds a Shard(0) of every parameter. Its layers' activations and output
    gradients are those of its own examples with the whole (gathered) weights, so the
    per-example norms and the book-keeping clipped sums are computed locally, with no
    collective; as each layer's sums are computed they go into buckets of parameters, and each
    complete bucket is reduce-scattered, in order, bringing each rank the summed rows of its
    shards (``ShardSink``: no rank holds the whole model's clipped sum); each rank
    adds the noise of its shard's coordinates (``ChunkedKeys`` ranges), divides by B̄ and sets
    ``p.grad`` to a DTensor; the optimizer steps the shards (DP-Muon all-gathers each matrix,
    orthogonalises it and keeps its rows). A rank without an example of a non-empty batch runs
    its forward on padding (``RankSlices(pad=True)``), counted as nothing, since the forward and
    backward are collectives. Parameters, gradients, optimizer and noise state are ≈ 1/W per
    rank; of the clipped sums a rank holds one layer's and the buckets not yet sent.

A check of the step that fails on one rank (``STEP_CHECK_ERRORS``: a batch other than the drawn
one, a NaN gradient, a forward that writes the model, a coupled model) is raised on every rank,
the failing rank's class and message, before anything is released: each rank's failure flag
travels in the step's one all-reduce of the batch figures, which precedes the release. A
``fully_shard`` step, whose forward is a collective, agrees once more before it — on the flags and
every rank's example count — so that the batch-independence probe runs on the same step on every
rank and the book-keeping passes (micro-batches) are as many everywhere.

In every mode the released gradient is the one of a single process,
g̃_t = (Σ_{i∈batch_t} clip_ζ(g_i) + σζ·sens·(C⁻¹Z)_t)/B̄, with one copy of the noise: the raw
noise is keyed by coordinate (``dpmf.optim.noise.ChunkedKeys``), so the noise is the same
function of the seed whatever W and the split. The accounting is that of the plan, untouched.
Sums are taken in another order than in one process, so parameters agree with a one-process
run up to rounding (≈ 1e-15 relative in float64, 1e-7 in float32 per step). One exception:
DP-MuonBC's random probes (public randomness of its bias correction) are drawn by each owner
for its own parameters in sharded mode, so its trajectory differs from one process's in
distribution-preserving ways; use ``replicated`` for the one-process trajectory.

Sources: McKenna, "Scaling up the Banded Matrix Factorization Mechanism for Differentially
Private ML" (2024), for distributing the correlated-noise state over devices; whole-matrix
ownership for Newton–Schulz as in distributed Muon implementations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from dpmf import seeds
from dpmf._validation import check_choice, check_int
from dpmf.distributed.collectives import Collectives
from dpmf.distributed.modes import MODES
from dpmf.distributed.sharding import assign_owners, owned_by, parameter_cost
from dpmf.optim.batch_probe import batch_size_of
from dpmf.optim.clipping import trainable_parameters
from dpmf.optim.fsdp import (
    check_fully_sharded,
    local_part,
    reshard,
    shard_span,
    sharded_gradient,
    sharded_names,
    unsharded_aliases,
)
from dpmf.optim.noise import CHUNK_ENTRIES, ChunkedKeys, noise_for_factorization
from dpmf.optim.privatize import STEP_CHECK_ERRORS, Privatizer
from dpmf.optim.registry import matrix_rule_names

__all__ = [
    "MODES",
    "DISTRIBUTED_MODES",
    "DistributedMode",
    "Sharded",
    "Replicated",
    "Rank0",
    "FullyShard",
    "ShardSink",
    "BUCKET_ENTRIES",
    "DistributedPrivatizer",
    "DivergenceError",
    "newton_schulz_parameters",
    "seed_digest",
]


class DivergenceError(RuntimeError):
    """The processes of one run disagree (seed, step, plan or parameters)."""


def seed_digest(seed: int, salt: str) -> str:
    """``"salt:digest"``: the salted digest of the run's key that processes compare and a
    manifest records (never the key): ``dpmf.seeds.key_digest`` with the run's random ``salt``
    (drawn by rank 0)."""
    return f"{salt}:{seeds.key_digest(seed, salt)}"


def newton_schulz_parameters(optimizer) -> set[int]:
    """``id``s of the parameters a dpmf DP optimizer updates by a Newton–Schulz (Muon) rule
    (empty for any other optimizer or None)."""
    out: set[int] = set()
    for group in getattr(optimizer, "param_groups", ()):
        if group.get("rule") in matrix_rule_names() and group.get("transform") is None:
            for p in group["params"]:
                out.add(id(p[1] if isinstance(p, tuple) else p))
    return out


# --- the modes: one object per mode, owning what differs between them -------------------------


class DistributedMode:
    """What a distribution mode decides: which parameters' noise this rank draws, how the
    clipped sums become private gradients, what follows the optimizer step, and which
    parameters this rank writes. ``DISTRIBUTED_MODES`` maps each name of ``MODES`` to its class.
    """

    name = ""
    replicas = True  # every rank holds the whole parameters (False: each its shards)

    def noised(self, owned_by: tuple, rank: int, count: int) -> tuple[int, ...]:
        """Indices of the parameters whose noise this rank draws (of ``count``)."""
        raise NotImplementedError

    def release(self, step: DistributedPrivatizer, params: list, sums: list) -> list:
        """Set ``p.grad`` to the private gradient on the parameters this rank updates (from
        the local clipped sums ``sums``) and return them."""
        raise NotImplementedError

    def after_step(self, step: DistributedPrivatizer) -> None:
        """Bring every rank's parameters into agreement after the optimizer step."""

    def written(self, step: DistributedPrivatizer, params: list) -> list:
        """The parameters whose private gradient and update this rank computes."""
        return params


class Sharded(DistributedMode):
    """Each parameter's noise and update on its owner: a reduce per owner, the owner's noise on
    its coordinates, then a broadcast per owner after the step (an all-gather)."""

    name = "sharded"

    def noised(self, owned_by, rank, count):
        return owned_by[rank]

    def release(self, step, params, sums):
        comm = step.collectives
        scale, bbar = step.noise_std, step.expected_batch_size
        mine = None
        for r, idx in enumerate(step.owned_by):
            if not idx:
                continue
            flat = torch.cat([sums[j].reshape(-1) for j in idx])
            comm.reduce(flat, dst=r)
            if r == comm.rank:
                mine = flat
        z = step.noise.next()
        written = [params[j] for j in step._noised]
        for p in params:
            p.grad = None
        if mine is not None:
            mine.add_(z, alpha=scale).div_(bbar)
            for p, g in zip(written, mine.split([p.numel() for p in written]), strict=True):
                p.grad = g.view_as(p)
        return written

    def after_step(self, step):
        params = [p for _, p in trainable_parameters(step.model)]
        comm = step.collectives
        with torch.no_grad():
            for r, idx in enumerate(step.owned_by):
                if not idx:
                    continue
                if r == comm.rank:
                    flat = torch.cat([params[j].detach().reshape(-1) for j in idx])
                else:
                    total = sum(params[j].numel() for j in idx)
                    flat = torch.empty(total, device=params[idx[0]].device, dtype=params[idx[0]].dtype)
                comm.broadcast(flat, src=r)
                if r != comm.rank:
                    for j, v in zip(idx, flat.split([params[j].numel() for j in idx]), strict=True):
                        params[j].copy_(v.view_as(params[j]))

    def written(self, step, params):
        return [params[j] for j in step.owned_by[step.collectives.rank]]


class Replicated(DistributedMode):
    """An all-reduce of the clipped sums; every rank adds the full, identical noise and runs the
    full update (a cross-check)."""

    name = "replicated"

    def noised(self, owned_by, rank, count):
        return tuple(range(count))

    def release(self, step, params, sums):
        scale, bbar = step.noise_std, step.expected_batch_size
        flat = torch.cat([s.reshape(-1) for s in sums])
        z = step.noise.next()
        step.collectives.all_reduce(flat)
        flat.add_(z, alpha=scale)
        return _set_gradients(params, flat.div_(bbar))


class Rank0(DistributedMode):
    """Rank 0 adds the full noise to its local sum before the all-reduce; every rank runs the
    full update."""

    name = "rank0"

    def noised(self, owned_by, rank, count):
        return tuple(range(count)) if rank == 0 else ()

    def release(self, step, params, sums):
        scale, bbar = step.noise_std, step.expected_batch_size
        flat = torch.cat([s.reshape(-1) for s in sums])
        z = step.noise.next()
        if step.collectives.rank == 0:
            flat.add_(z, alpha=scale)
        step.collectives.all_reduce(flat)
        return _set_gradients(params, flat.div_(bbar))


def _mode_for(model: nn.Module, mode: str, world_size: int, clipping: str) -> str:
    """The mode the model takes: ``fsdp`` for a ``fully_shard`` model (given, or in place of the
    default ``sharded``), which must then pass ``check_fully_sharded``; any other mode for a model
    whose parameters are whole.

    Raises:
        ValueError: a mode that does not fit the model, naming the fix.
    """
    sharded = bool(sharded_names(model))
    if not sharded:
        if mode == "fsdp":
            raise ValueError(
                "mode='fsdp' is invalid: the model's parameters are not sharded; apply "
                "torch.distributed.fsdp.fully_shard to its blocks and root first, or use mode='sharded'"
            )
        return mode
    if mode not in ("sharded", "fsdp"):
        raise ValueError(
            f"mode={mode!r} is invalid for a fully_shard model: its parameters are shards, each rank "
            "noises and steps its own (mode='fsdp', the default for such a model)"
        )
    if clipping not in ("auto", "bk"):
        raise ValueError(
            f"clipping={clipping!r} is invalid for a fully_shard model: use 'bk' or 'auto' (book-keeping "
            "from each layer's activations and output gradients)"
        )
    check_fully_sharded(model, world_size)
    return "fsdp"


def _set_gradients(params: list, flat: torch.Tensor) -> list:
    for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
        p.grad = g.view_as(p)
    return params


#: the most entries (W × its rows of each parameter) a fully_shard step's reduce-scatter sends at
#: once: the clipped sums are sent in buckets of parameters as the layers' sums are computed
BUCKET_ENTRIES = 1 << 23


class ShardSink:
    """Where a fully_shard step's book-keeping clipped sums go (``clipped_sum(sink=)``): each
    parameter's sum, as its layer's is computed, is copied into its bucket — consecutive
    parameters, at most ``bucket_entries`` entries of W padded row blocks each — and every
    complete bucket, in order, is reduce-scattered to the ranks' rows and added to this rank's
    shards. No whole-model sum is held: the largest buffer is one bucket (plus a layer's sums).

    Every rank sends every bucket of every pass exactly once and in the same order (a pass's
    missing sums — a rank whose norms were not finite, or padding — go as zeros at
    ``end_pass``), so the reduce-scatters match whatever each rank's data.

    Args:
        collectives: the step's ``Collectives``.
        named: the trainable (name, parameter) pairs, DTensor shards (parameter order).
        bucket_entries: the most entries of one bucket (a larger parameter is a bucket alone).
        counting: whether the sums given count (False: padding, the rank sends zeros).
    """

    def __init__(self, collectives, named: list, *, bucket_entries: int = BUCKET_ENTRIES, counting=True):
        W = collectives.world_size
        self.collectives, self.counting, self._W = collectives, counting, W
        self._index = {n: j for j, (n, _) in enumerate(named)}
        params = [p for _, p in named]
        widths = [p.numel() // p.shape[0] if p.dim() else 1 for p in params]
        rows = [p.shape[0] if p.dim() else 1 for p in params]
        self._parts = [-(-r // W) * w for r, w in zip(rows, widths, strict=True)]
        self._local = [local_part(p).numel() for p in params]
        self._buckets: list[list[int]] = []
        self._widths: list[int] = []  # each bucket's columns: Σ of its parameters' parts
        self._bucket_of, self._offset = [], []
        for j, part in enumerate(self._parts):
            if not self._buckets or W * (self._widths[-1] + part) > bucket_entries:
                self._buckets.append([])
                self._widths.append(0)
            self._bucket_of.append(len(self._buckets) - 1)
            self._offset.append(self._widths[-1])
            self._buckets[-1].append(j)
            self._widths[-1] += part
        self._mine = [local_part(p).new_zeros(part) for p, part in zip(params, self._parts, strict=True)]
        self._buffers: dict[int, torch.Tensor] = {}
        self._filled: list[set] = [set() for _ in self._buckets]
        self._next = 0  # the next bucket this pass sends
        #: the most entries the buckets held at once: the step's transient clipped-sum memory
        #: (beside the shards' rows and one layer's sums as its handler returns them)
        self.peak_entries = 0

    def __call__(self, sums: dict) -> None:
        """Take name → Σ_i c_i·g_i (the parameter's global shape) and send what is complete."""
        for name, g in sums.items():
            j = self._index[name]
            k = self._bucket_of[j]
            if self.counting:
                buf = self._buffers.get(k)
                if buf is None:
                    shape = (self._W, self._widths[k])
                    buf = self._buffers[k] = g.new_zeros(shape, dtype=self._mine[j].dtype)
                    held = sum(b.numel() for b in self._buffers.values())
                    self.peak_entries = max(self.peak_entries, held)
                _copy_rows(buf, self._offset[j], self._parts[j], g.reshape(-1).to(buf.dtype))
            self._filled[k].add(j)
        K = len(self._buckets)
        while self._next < K and len(self._filled[self._next]) == len(self._buckets[self._next]):
            self._send(self._next)

    def _send(self, k: int) -> None:
        buf = self._buffers.pop(k, None)
        dtype = self._mine[self._buckets[k][0]].dtype
        if buf is None:  # nothing counted in it (padding, a failed pass): zeros
            buf = self._mine[0].new_zeros((self._W, self._widths[k]), dtype=dtype)
        out = buf.new_empty(self._widths[k])
        self.collectives.reduce_scatter(out, buf.view(-1))
        for j in self._buckets[k]:
            at = self._offset[j]
            self._mine[j].add_(out[at : at + self._parts[j]])
        self._filled[k].clear()
        self._next = k + 1

    def end_pass(self) -> None:
        """Send this pass's remaining buckets (their missing sums as zeros)."""
        while self._next < len(self._buckets):
            self._send(self._next)
        self._next = 0
        self._buffers.clear()

    def shards(self) -> list[torch.Tensor]:
        """This rank's rows of every parameter's clipped sum (flat, the local shard's length)."""
        if self._next:
            self.end_pass()
        return [m[:n] for m, n in zip(self._mine, self._local, strict=True)]


def _copy_rows(buf: torch.Tensor, at: int, part: int, flat: torch.Tensor) -> None:
    """Write a parameter's flat sum into its columns [at, at + part) of a (W, width) bucket: rank
    r's block holds entries [r·part, (r + 1)·part) (torch.chunk's rows; the tail padded)."""
    W = buf.shape[0]
    full = flat.numel() // part if part else 0
    if full:
        buf[:full, at : at + part].copy_(flat[: full * part].view(full, part))
    rest = flat.numel() - full * part
    if rest and full < W:
        buf[full, at : at + rest].copy_(flat[full * part :])


class FullyShard(DistributedMode):
    """A ``fully_shard`` (FSDP2) model: each rank holds a Shard(0) of every parameter. The
    clipped sums — whole-parameter tensors computed from the rank's own examples — are
    reduce-scattered to the shards bucket by bucket as they are computed (``ShardSink``); each
    rank adds the noise of its shard's
    coordinates (``ChunkedKeys`` ranges: the one-process noise there), divides by B̄ and sets
    ``p.grad`` to a DTensor of its rows; the optimizer steps the shards. Nothing follows the
    step: the shards are the model."""

    name = "fsdp"
    replicas = False

    def noised(self, owned_by, rank, count):
        return tuple(range(count))

    def release(self, step, params, sums):
        """``sums``: this rank's rows of each clipped sum (``ShardSink.shards``, already summed
        over the ranks); add the noise of those coordinates, divide by B̄, set ``p.grad``."""
        keys = step.noise.keys
        scale, bbar = step.noise_std, step.expected_batch_size
        z = step.noise.next()
        offsets = keys.offsets()
        for j, (p, local) in enumerate(zip(params, sums, strict=True)):
            start, stop = offsets[j]
            local.add_(z[start:stop], alpha=scale).div_(bbar)
            p.grad = sharded_gradient(local.view(local_part(p).shape), p)
        return params


#: name → mode class, for every name of ``MODES`` (``dpmf.distributed.modes``).
DISTRIBUTED_MODES: dict[str, type[DistributedMode]] = {
    cls.name: cls for cls in (Sharded, Replicated, Rank0, FullyShard)
}
if tuple(DISTRIBUTED_MODES) != MODES:  # the names config validates against are these modes
    raise ImportError(
        f"dpmf.distributed.modes.MODES={MODES} differs from the mode classes {tuple(DISTRIBUTED_MODES)}"
    )


class DistributedPrivatizer(Privatizer):
    """A ``Privatizer`` whose step runs across the ranks of ``collectives`` (see the module).

    Args:
        model: the same network on every rank (its parameters are broadcast from rank 0 here).
        loss_fn: as ``Privatizer``.
        collectives: ``TorchCollectives`` (a process group) or a simulated rank
            (``dpmf.distributed.collectives.simulate``).
        plan: the run's ``PrivatePlan`` with its noise multiplier (the same on every rank).
        clip_norm: ζ > 0; default the plan's (``Privatizer``).
        seed: the run's key, the same on every rank (checked by a salted digest, never sent).
        mode: ``"sharded"`` (default), ``"replicated"`` or ``"rank0"``.
        optimizer: the optimizer to be used (optional): parameters it orthogonalizes by
            Newton–Schulz weigh more when owners are assigned.
        check_every: every this many steps, ``after_step`` compares the seed digest, the step
            and per-parameter checksums across ranks (0: only when ``verify`` is called).
        chunk: entries per raw-noise chunk (``ChunkedKeys``).
        micro_batch_size, clipping: as ``Privatizer``.
        bucket_entries: a fully_shard step's largest reduce-scatter of clipped sums, in entries
            (``ShardSink``); its clipped sums are sent bucket by bucket as the layers' are
            computed, so no rank holds the whole model's.

    Raises:
        ValueError: a bad mode or number; ranks that disagree on the seed, the plan, the mode
            or the parameter shapes (``DivergenceError``).
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable,
        *,
        collectives: Collectives,
        plan,
        seed: int,
        clip_norm: float | None = None,
        mode: str = "sharded",
        optimizer=None,
        check_every: int = 50,
        chunk: int = CHUNK_ENTRIES,
        micro_batch_size: int | None = None,
        clipping: str = "auto",
        bucket_entries: int = BUCKET_ENTRIES,
    ):
        if not isinstance(collectives, Collectives):
            raise TypeError(f"collectives={collectives!r} is invalid: must be a dpmf Collectives")
        self.collectives = collectives
        self.mode = _mode_for(model, check_choice("mode", mode, MODES), collectives.world_size, clipping)
        self._mode = DISTRIBUTED_MODES[self.mode]()
        self.shards_parameters = not self._mode.replicas
        self.check_every = check_int("check_every", check_every, minimum=0)
        seed = seeds.check_seed(seed)
        if seed is None:
            raise TypeError("seed=None is invalid here: give the run's key (the same on every rank)")
        # a fresh salt per run, rank 0's: a digest says nothing reusable about the key
        self._salt = collectives.all_gather_object(seeds.new_salt() if collectives.rank == 0 else None)[0]
        self.seed_digest = seed_digest(seed, self._salt)
        params = [p for _, p in trainable_parameters(model)]
        if not params:
            raise ValueError("model is invalid: it has no trainable parameters")
        W, rank = collectives.world_size, collectives.rank
        ns = newton_schulz_parameters(optimizer)
        costs = [parameter_cost(tuple(p.shape), newton_schulz=id(p) in ns) for p in params]
        self.owners = assign_owners(costs, W)
        self.owned_by = owned_by(self.owners, W)
        sizes = tuple(p.numel() for p in params)
        noised = tuple(self._mode.noised(self.owned_by, rank, len(params)))
        spans = None if self._mode.replicas else tuple(shard_span(params[j]) for j in noised)
        keys = ChunkedKeys(sizes, noised, chunk, ranges=spans)
        self._noised = noised
        self._keys = keys
        self.bucket_entries = check_int("bucket_entries", bucket_entries, minimum=1)
        self._sink: ShardSink | None = None  # fully_shard: where the current step's sums go
        #: fully_shard: the most clipped-sum entries the last step's buckets held at once
        self.release_peak_entries = 0
        self._failure: BaseException | None = None  # this rank's failed check of the current step
        self._probe_ran = False  # lock-step: the batch-independence probe ran in this step
        self._sizes: list[int] | None = None  # every rank's example count (fully_shard), agreed
        p0 = params[0]
        noise = noise_for_factorization(
            plan.strategy, keys.dim, seed=seed, device=p0.device, dtype=p0.dtype, keys=keys
        )
        self._agree(
            "the run",
            {
                "seed": self.seed_digest,
                "mode": self.mode,
                "plan": repr(sorted(plan.to_dict().items())),
                "noise_multiplier": plan.require_noise_multiplier(),
                "shapes": [tuple(p.shape) for p in params],
                "owners": self.owners,
            },
        )
        super().__init__(
            model,
            loss_fn,
            plan=plan,
            clip_norm=clip_norm,
            noise=noise,
            micro_batch_size=micro_batch_size,
            clipping=clipping,
        )
        if not self._mode.replicas:  # the unsharded parameters exist from the first forward on
            unsharded_aliases(model, materialize=True)
            return
        with torch.no_grad():  # the same initial weights everywhere (as DistributedDataParallel)
            for p in params:
                collectives.broadcast(p.data, src=0)

    # -- agreement ----------------------------------------------------------------------------
    def _agree(self, what: str, facts: dict) -> None:
        gathered = self.collectives.all_gather_object(facts)
        for r, theirs in enumerate(gathered):
            if theirs != gathered[0]:
                keys = [k for k in facts if theirs.get(k) != gathered[0].get(k)]
                raise DivergenceError(
                    f"ranks disagree on {what}: rank {r} differs from rank 0 in {', '.join(keys)} "
                    "(every process must get the same seed, plan, mode and model; a secret seed is "
                    "compared by digest only)"
                )

    def use_key(self, key: int) -> None:
        """Adopt the run's ``key`` (a checkpoint's, on resume; every rank the same)."""
        super().use_key(key)
        self.seed_digest = seed_digest(key, self._salt)

    def verify(self) -> None:
        """Check that all ranks hold the same seed digest, step and parameters (per-parameter
        float64 sums and sums of squares).

        Raises:
            DivergenceError: a rank differs, named with what differs.
        """
        sums = []
        with torch.no_grad():
            for _, p in trainable_parameters(self.model) if self._mode.replicas else ():
                q = p.detach().double()
                sums.append(torch.stack([q.sum(), (q * q).sum()]))
        checksum = torch.stack(sums).cpu().tolist() if sums else None  # shards differ by design
        self._agree("the state", {"seed": self.seed_digest, "step": self.noise.step, "parameters": checksum})

    # -- the private step ---------------------------------------------------------------------
    def privatize(self, inputs, targets, **kwargs):
        """As ``Privatizer.privatize``; a ``fully_shard`` model's units are resharded first (an
        evaluation forward may have left the root's parameters gathered)."""
        if not self._mode.replicas:
            reshard(self.model)
        return super().privatize(inputs, targets, **kwargs)

    def _noised_entries(self, params: list) -> int:
        return self._keys.dim

    def _release(self, params: list, sums: list) -> list:
        return self._mode.release(self, params, sums)

    def padding(self) -> bool:
        """Whether this rank's batch of the current step is padding (``RankSlices(pad=True)``:
        a fully_shard rank without an example of its own runs the forward on another's)."""
        slices = getattr(self.drawn, "sampler", None)
        return bool(getattr(slices, "is_padding", None)) and slices.is_padding(self.noise.step)

    # -- a check failed on one rank: every rank raises it, before anything is released --------
    @property
    def _lockstep(self) -> bool:
        return not self._mode.replicas  # fully_shard: the forward and backward are collectives

    def _before_forward(self, t, walk, inputs, targets, example_ids, handed_out) -> None:
        """The checks before the forward, a failure kept for the ranks' agreement. A fully_shard
        step agrees here, before its forward (a collective): on the failures and on every rank's
        example count (one all-reduce of W + 1 numbers)."""
        self._failure = None
        self._probe_ran = False
        try:
            super()._before_forward(t, walk, inputs, targets, example_ids, handed_out)
        except STEP_CHECK_ERRORS as err:
            self._failure = err
        if not self._lockstep:
            return
        W, rank = self.collectives.world_size, self.collectives.rank
        p0 = trainable_parameters(self.model, walk)[0][1]
        v = torch.zeros(W + 1, dtype=torch.float64, device=p0.device)
        v[rank], v[W] = batch_size_of(inputs), float(self._failure is not None)
        self.collectives.all_reduce(v)
        agreed = [int(round(x)) for x in v.cpu().tolist()]  # one read of every rank's figures
        if agreed[W]:
            self._raise_agreed(t)
        self._sizes = agreed[:W]
        empty = [r for r, n in enumerate(self._sizes) if n == 0]
        if empty and len(empty) < W:
            raise ValueError(
                f"step {t}'s batch is invalid for a fully_shard model: rank {empty[0]} has no example "
                "while other ranks have some, and the forward is a collective every rank joins; draw "
                "the ranks' batches with dpmf.distributed.RankSlices(sampler, rank, world_size, pad=True) "
                "(make_private and dpmf train do), which gives such a rank padding counted as nothing"
            )

    def _raise_agreed(self, t: int) -> None:
        """Raise, on every rank, the first failed check of a rank (its class and message)."""
        mine = None if self._failure is None else (type(self._failure), str(self._failure))
        reports = self.collectives.all_gather_object(mine)
        r, (cls, message) = next((r, m) for r, m in enumerate(reports) if m is not None)
        failure, self._failure = self._failure, None
        W = self.collectives.world_size
        text = f"rank {r} of {W} refused step {t}, so every rank stops before the release: {message}"
        raise cls(text) from failure

    def set_stage(self, stage) -> None:
        """As ``Privatizer.set_stage``; refused for a fully_shard model.

        Raises:
            ValueError: a fully_shard model (the audit's canaries and projections are whole-model
                vectors, which no rank of a sharded step holds).
        """
        if self._lockstep:
            raise ValueError(
                "the white-box audit is invalid for a fully_shard model: its canaries and projections "
                "are whole-model vectors, which no rank of the sharded step holds; audit the same "
                "configuration without fully_shard (one process, or torchrun with the whole model)"
            )
        super().set_stage(stage)

    def _probe(self, inputs, targets, t, walk) -> None:
        """As ``Privatizer._probe``; in lock-step the probe counts as done only once every rank
        agrees the step (``_batch_figures``), so that the ranks probe again together after a
        refused step."""
        if not self._lockstep:
            super()._probe(inputs, targets, t, walk)
            return
        self._probe_ran = True
        try:
            super()._probe(inputs, targets, t, walk)
        finally:
            self._probed = False

    def _probe_now(self, inputs) -> bool:
        if not self._lockstep:
            return super()._probe_now(inputs)
        return not self._probed and min(self._sizes) >= 2  # on every rank at once

    def _sum_sink(self):
        return self._sink

    def _micro_batches(self) -> int | None:
        if not (self._lockstep and self._micro_batch_given):
            return None  # book-keeping takes each rank's batch in one pass
        return -(-max(self._sizes) // self.micro_batch_size)

    def _clipped_sum(self, inputs, targets, t, walk, example_ids, points):
        """As ``Privatizer._clipped_sum``, a failed check kept for the agreement (None then);
        on padding (``padding``) the forward and backward run with the other ranks and the
        result is that of an empty batch: zero sums, no example, no loss."""
        if self._failure is not None:
            return None  # a failed check before the forward (not fully_shard: no collective)
        if self._lockstep:  # the sums go to the shards layer by layer; padding sends zeros
            named = trainable_parameters(self.model, walk)
            self._sink = ShardSink(
                self.collectives, named, bucket_entries=self.bucket_entries, counting=not self.padding()
            )
        try:
            summed = super()._clipped_sum(inputs, targets, t, walk, example_ids, points)
        except STEP_CHECK_ERRORS as err:  # a pass's buckets were sent (zeros) at its end
            self._failure = err
            return None
        finally:
            if self._sink is not None:
                self.release_peak_entries = self._sink.peak_entries
            self._sink = None
        if not self.padding():
            return summed
        loss = None if summed.loss_sum is None else torch.zeros_like(summed.loss_sum)
        return dataclasses.replace(summed, norms=summed.norms[:0], batch_size=0, loss_sum=loss)

    def _batch_figures(self, summed) -> tuple[int, object]:
        """The global batch's figures, summed over the ranks with each rank's failed-check flag
        in the same all-reduce: if any rank failed, every rank raises its error here, before
        the release."""
        n, figures = (0, (0.0, 0.0)) if summed is None else super()._batch_figures(summed)
        p0 = trainable_parameters(self.model)[0][1]
        head = torch.tensor([n, float(self._failure is not None)], dtype=torch.float64, device=p0.device)
        if not isinstance(figures, torch.Tensor):
            figures = torch.tensor(figures)
        t = torch.cat([head, figures.to(torch.float64).to(p0.device)])  # not read before the all-reduce
        self.collectives.all_reduce(t)
        n, failed, clipped, norms = t.cpu().tolist()  # the step's one read of the figures
        probed, self._probe_ran = self._probe_ran, False
        if failed:
            self._raise_agreed(self.noise.step)
        self._probed = self._probed or probed
        return int(round(n)), (clipped, norms)

    def after_step(self) -> None:
        """Return every parameter from its owner to all ranks (sharded mode; one broadcast
        per owner) and, every ``check_every`` steps, ``verify``."""
        self._mode.after_step(self)
        if self.check_every and self.noise.step % self.check_every == 0:
            self.verify()

    def written_parameters(self) -> list:
        """The parameters whose private gradient and update this rank computes (its owned
        ones in sharded mode, all otherwise)."""
        return self._mode.written(self, [p for _, p in trainable_parameters(self.model)])

    def noise_state_numel(self) -> int:
        """Entries of correlated-noise state this rank holds between steps."""
        return self.noise.state_numel()
