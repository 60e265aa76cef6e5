"""The one place where federated learning meets dpmf's private-step machinery.

Every use of the accounting entry points (``account``), the strategy builder
(``dpmf.plan.build_strategy``), the plans and their private steps (``PrivatePlan.private_step``:
sampler, noise stream and privatizer built together) and the DP optimizers (the registry's,
``local_optimizer``) by ``dpmf.federated`` is in this module. Each privacy mode builds its
step from one plan: a client's run (``record``), the server's run with noise that varies by
segment of steps (``aggregator``: ``noise_segments``), the plan of a client-level "dataset"
(``client``).

Three pieces:

* ``record_privacy`` / ``PrivateLocalRun`` (``record`` mode): a client's local training over the
  whole federation is one private run of R·L steps on its own records (per-example clipping,
  any batch-sampling scheme and strategy, DP-SGD or DP-Muon). Its (ε_k, δ) is the event and
  accountant of ``dpmf epsilon`` (the plan with the strategy built by ``build_strategy`` for the
  prefix-sum workload; PLD on a 1e-3 grid, pessimistic). Between rounds the weights are
  replaced by the global model, which depends on the client's records only through its earlier
  private releases (post-processing) and on other clients' independent data: the adaptive
  composition of the run's steps holds.
* ``AggregatorDPSGD`` (``aggregator`` mode): DP-SGD steps on the server's aggregator dataset,
  Poisson-sampled, with a per-step noise multiplier (set from the clients' compliance).
* ``ClientLevelNoise`` (``client`` mode): the Gaussian noise on the mean of K clipped client
  updates, independent across rounds or correlated by a matrix-factorization strategy, with
  every client participating in every round (the DP-FTRL / BLT setting of Kairouz et al.,
  "Practical and Private (Deep) Learning without Sampling or Shuffling", ICML 2021, and
  Dvijotham et al., "Efficient and Near-Optimal Noise Generation for Streaming Differential
  Privacy", FOCS 2024). Accounted as ``fixed_order`` with N = B = K: one batch per round holding
  every client, k = R participations, sensitivity sens(C) for that pattern.
"""

from __future__ import annotations

import functools

import numpy as np

from dpmf import seeds
from dpmf._lazy import lazy_module
from dpmf._validation import check_real
from dpmf.accountants import ComposedEvent, PLDAccountant, PoissonGaussianEvent, PrivacyResult
from dpmf.accountants.calibration import check_delta
from dpmf.mechanisms import parse_factorization
from dpmf.plan.accounting import privacy_result
from dpmf.plan.api import account, account_segments
from dpmf.plan.plan import PrivatePlan, build_strategy
from dpmf.plan.schemes import FixedOrder, Poisson, check_sigma, get_scheme
from dpmf.workloads import prefix_sum

# torch and the training pieces are imported when a run is built: the accountings of a record
# run (``record_privacy``, ``prefetch``) start before torch is imported (``run.start_ahead``)
torch = lazy_module("torch")
F = lazy_module("torch.nn.functional")

__all__ = [
    "aggregator_privacy",
    "record_privacy",
    "PrivateLocalRun",
    "AggregatorDPSGD",
    "ClientLevelNoise",
]


def __getattr__(name):
    # the local optimizers are the optimizer registry's (``dpmf.optim.registry``)
    if name == "LOCAL_OPTIMIZERS":
        from dpmf.optim.registry import optimizer_names

        return optimizer_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _strategy(spec: str, steps: int, scheme: str, steps_per_epoch: int):
    """The factorization of the prefix-sum workload (None for identity), as ``dpmf epsilon``."""
    name, _ = parse_factorization(spec)
    if name == "identity":
        return None
    return build_strategy(prefix_sum(steps), spec, get_scheme(scheme), steps_per_epoch)


def record_privacy(
    noise_multiplier: float,
    *,
    dataset_size: int,
    batch_size: int,
    steps: int,
    delta: float,
    scheme: str = Poisson.name,
    factorization: str = "identity",
    accountant: str | None = None,
):
    """(ε_k, δ) of one client's local private run: the ``dpmf epsilon`` computation.

    The event and accountant of ``dpmf epsilon --scheme S --noise-multiplier σ --dataset-size N
    --batch-size B --steps n --delta δ [--factorization F] [--accountant A]``; with the PLD
    accountant (the default) on dp-accounting's value grid ``RECORD_PLD_GRID`` = 1e-3 instead
    of 1e-4: a pessimistic discretization (ε can only grow with the grid step), larger than
    ``dpmf epsilon``'s ε by less than 10⁻⁴ at the settings of ``dpmf fl`` (e.g. 64.04777
    against 64.04774 at σ = 1.3, q = 16/26, 250 steps) and 8–13× faster: the accounting was
    half of a record-mode run's time. RDP, PRV and Monte Carlo are ``dpmf epsilon``'s computation.

    Returns:
        ``dpmf.accountants.PrivacyResult``.

    The result is cached (a pure function of the arguments): several seeds of a federated run
    account each client once. Under the PLD accountant the measurement is a function of the
    privacy event and δ alone (``PLD_CACHE``): clients with the same σ, sampling rate q = B/N_k
    and steps share one accounting even when their N_k and B differ.

    Raises:
        ValueError/TypeError: any invalid argument (from the plan and ``account``).
    """
    args = (noise_multiplier, dataset_size, batch_size, steps, delta, scheme, factorization, accountant)
    try:
        hash(args)
    except TypeError:  # not cacheable: let ``account`` name the bad argument
        return _record_privacy(*args)
    if args not in RECORD_CACHE:  # ``dpmf.federated.prefetch`` fills it in parallel
        pending = RECORD_PENDING.pop(args, None)  # started in the background: wait for it
        RECORD_CACHE[args] = _record_privacy(*args) if pending is None else pending()
    return RECORD_CACHE[args]


RECORD_CACHE: dict = {}  # record_privacy's arguments → PrivacyResult (a pure function of them)
RECORD_PENDING: dict = {}  # record_privacy's arguments → a call waiting for the background result
PLD_CACHE: dict = {}  # (privacy event, δ) → PLD Measurement on RECORD_PLD_GRID


RECORD_PLD_GRID = 1e-3  # record mode's PLD value discretization (coarser = pessimistic)


def record_pld_event(
    noise_multiplier, dataset_size, batch_size, steps, delta, scheme, factorization, accountant
):
    """(plan, σ, (event, δ)) of a ``record_privacy`` setting that the PLD accountant measures
    from its privacy event alone (no strategy to build: ``factorization="identity"``), else None.
    The same (event, δ) is the same measurement: ``PLD_CACHE``'s key.

    Raises:
        ValueError/TypeError: an invalid setting (the plan's and ``account``'s checks).
    """
    name, _ = parse_factorization(factorization)
    if name != "identity":
        return None
    plan = PrivatePlan(dataset_size, batch_size, steps=steps, scheme=scheme, strategy="identity")
    if plan.scheme.check_accountant(accountant) != "pld":
        return None
    sigma = check_sigma(noise_multiplier)
    key = (plan.event(sigma), check_delta(delta, plan.dataset_size))
    try:
        hash(key)
    except TypeError:
        return None
    return plan, sigma, key


def pld_measurement(event, delta):
    """The PLD accountant's measurement of ``event`` at δ on the grid ``RECORD_PLD_GRID``."""
    return PLDAccountant(value_discretization_interval=RECORD_PLD_GRID).epsilon(event, delta)


def _record_privacy(
    noise_multiplier, dataset_size, batch_size, steps, delta, scheme, factorization, accountant
):
    fact = _strategy(factorization, steps, scheme, -(-int(dataset_size) // int(batch_size)))
    plan = PrivatePlan(
        dataset_size, batch_size, steps=steps, scheme=scheme, strategy="identity" if fact is None else fact
    )
    if plan.scheme.check_accountant(accountant) == "pld":
        # ``account``'s checks, then its PLD measurement on the grid ``RECORD_PLD_GRID``, shared
        # by every setting with the same event and δ
        sigma = check_sigma(noise_multiplier)
        key = (plan.event(sigma), check_delta(delta, plan.dataset_size))
        try:
            cached = key in PLD_CACHE
        except TypeError:  # an event that cannot be a key: measured each time
            return privacy_result(plan, sigma, pld_measurement(*key))
        if not cached:
            PLD_CACHE[key] = pld_measurement(*key)
        return privacy_result(plan, sigma, PLD_CACHE[key])
    return account(
        scheme,
        noise_multiplier=noise_multiplier,
        dataset_size=dataset_size,
        batch_size=batch_size,
        steps=steps,
        delta=delta,
        factorization=fact,
        accountant=accountant,
        progress=False,
    )


AGGREGATOR_PLD_GRID = 1e-3  # dp-accounting PLD value discretization (coarser = pessimistic)


def aggregator_privacy(sigmas, *, sampling_rate: float, delta: float, accountant: str = "pld"):
    """(ε, δ) of server-side DP-SGD with per-step noise multipliers ``sigmas`` (Poisson rate q).

    Heterogeneous composition of the T steps. Composition is commutative (the PLD of a
    composition is the convolution of the steps' PLDs), so the steps are grouped by σ into at
    most as many segments as distinct noise levels, (σ_i, q, count_i), and composed by
    dp-accounting — PLD on a value grid of ``AGGREGATOR_PLD_GRID`` (a pessimistic
    discretization: ε can only grow with the grid step; at 1e-3 it is within 1e-5 relative of
    the 1e-4 grid for the runs of this module, and 15× faster), or RDP / PRV.

    Args:
        sigmas: σ_t > 0 for t = 1..T.
        sampling_rate: q in (0, 1].
        delta: δ in (0, 1).
        accountant: ``pld``, ``rdp`` or ``prv``.

    Returns:
        ``PrivacyResult`` (scheme ``poisson``, steps T, ``details["segments"]``).

    Raises:
        ValueError: an empty list or a σ that is not > 0.
    """
    s = np.asarray(sigmas, dtype=np.float64).ravel()
    if s.size == 0:
        raise ValueError("sigmas is invalid: the run has no server step")
    levels, counts = np.unique(s, return_counts=True)
    segs = tuple((float(v), float(sampling_rate), int(c)) for v, c in zip(levels, counts, strict=True))
    return _grouped_privacy(segs, float(delta), accountant)


@functools.lru_cache(maxsize=256)
def _grouped_privacy(segs: tuple, delta: float, accountant: str):
    """``aggregator_privacy`` of the grouped segments (cached: a pure function of them)."""
    levels = np.array([seg[0] for seg in segs])
    steps = sum(seg[2] for seg in segs)
    sampling_rate = segs[0][1]
    if accountant != "pld":
        return account_segments(segs, delta=delta, accountant=accountant)
    events = tuple(PoissonGaussianEvent(*seg) for seg in segs)
    meas = PLDAccountant(value_discretization_interval=AGGREGATOR_PLD_GRID).epsilon(
        ComposedEvent(events), delta
    )
    return PrivacyResult(
        epsilon=meas.epsilon,
        delta=meas.delta,
        noise_multiplier=float(levels.min()),
        scheme=Poisson.name,
        accountant=meas.accountant,
        guarantee=meas.guarantee,
        steps=int(steps),
        sensitivity=1.0,
        sampling_rate=float(sampling_rate),
        method=meas.method,
        details={"segments": [list(seg) for seg in segs]},
    )


class PrivateLocalRun:
    """One client's private local training across all rounds (``record`` mode).

    Args:
        x, y: the client's records, shapes (N_k, C, H, W) float32 and (N_k,) int64.
        model: the client's own torch model (its weights are set from the global model each
            round).
        noise_multiplier: σ_k > 0 (from the client's compliance score).
        clip_norm: per-example clip norm ζ > 0.
        batch_size: expected batch size B in [1, N_k].
        steps: total private steps n = rounds × local steps.
        delta: δ in (0, 1).
        scheme, factorization, accountant: as ``dpmf epsilon``.
        optimizer: a name of the optimizer registry (``dpmf.optim.registry``); ``lr`` its
            learning rate.
        seed: this client's key (``dpmf.seeds.child_key`` of the run's key): the sampler and
            the noise derive their subkeys from it (secret; never shown).

    Raises:
        ValueError/TypeError: invalid settings (before any training).
    """

    def __init__(
        self,
        x,
        y,
        model,
        *,
        noise_multiplier: float,
        clip_norm: float,
        batch_size: int,
        steps: int,
        delta: float,
        scheme: str = Poisson.name,
        factorization: str = "identity",
        accountant: str | None = None,
        optimizer: str = "dp-sgd",
        lr: float = 0.5,
        seed: int = 0,
    ):
        self.x, self.y = x, y
        n = int(y.shape[0])
        # the accounting's own checks before any work (the plan below checks N, B, n, the scheme
        # and the strategy): σ, δ, and an accountant that can account the scheme
        check_sigma(noise_multiplier)
        check_delta(delta, n)
        get_scheme(scheme).check_accountant(accountant)
        # ``record_privacy``'s arguments; its result is asked for when ``privacy`` is first read
        # (``dpmf.federated.prefetch.start_record_privacy`` may compute it while the run trains)
        self._accounting = dict(
            dataset_size=n,
            batch_size=batch_size,
            steps=steps,
            delta=delta,
            scheme=scheme,
            factorization=factorization,
            accountant=accountant,
        )
        self._noise_multiplier = noise_multiplier
        self._privacy = None
        from dpmf.optim.registry import get_optimizer

        self.optimizer = get_optimizer(optimizer)  # the registry's entry (dpmf.optim.registry)
        self.lr = check_real("lr", lr, low=0.0, low_inclusive=False)
        self._key = seed  # secret: never printed
        self.model = model
        # one plan, one constructor: the sampler, the noise and the privatizer of the plan that
        # ``record_privacy`` accounts (the single-stream noise keys of earlier federated runs)
        plan = PrivatePlan(
            n,
            batch_size,
            steps=steps,
            scheme=scheme,
            strategy=factorization,
            noise_multiplier=noise_multiplier,
            clip_norm=clip_norm,
        )
        self.step = _stream_step(plan, model, seed)
        self.sampler, self.privatizer = self.step.sampler, self.step.privatizer
        self._opt = None  # the client's DP optimizer: built at the first round, reset every round

    @property
    def privacy(self) -> PrivacyResult:
        """(ε_k, δ) of the whole run (``record_privacy``; computed or awaited on first use)."""
        if self._privacy is None:
            self._privacy = record_privacy(self._noise_multiplier, **self._accounting)
        return self._privacy

    @property
    def steps_taken(self) -> int:
        return int(self.sampler.step)

    def train_round(self, weights, steps: int, proximal_mu: float = 0.0):
        """``steps`` private steps from the global ``weights``.

        Returns:
            (weights, mean per-example gradient norm). The norm is a non-private diagnostic
            of the client's records: keep it local, never send it.

        The optimizer's state starts afresh each round (the global model replaced the weights):
        the client's optimizer is built once, bound to its privatizer once, and reset at the start
        of every round (``DPOptimizer.reset_state``), so each round steps as a freshly built one.
        FedProx's proximal gradient is added after the private gradient (post-processing).

        Raises:
            RuntimeError: more steps than the accounted run has.
        """
        if self.sampler.step + steps > self.sampler.steps:
            raise RuntimeError(
                f"the private run has {self.sampler.steps} steps and {self.sampler.step} were taken: "
                f"{steps} more would exceed what was accounted"
            )
        from dpmf.federated.models import add_proximal_gradient, get_weights, set_weights

        set_weights(self.model, weights)
        anchor = get_weights(self.model)
        if self._opt is None:
            self._opt = local_optimizer(self.optimizer, self.model, lr=self.lr, key=self._key)
            self.step.bind(self._opt)
        opt = self._opt
        opt.reset_state()
        x, y = torch.from_numpy(self.x), torch.from_numpy(self.y)

        def rows(batch):
            idx = torch.from_numpy(batch)
            return x[idx], y[idx], batch

        # (μ = 0 adds nothing: the private gradient is stepped as written)
        proximal = None
        if proximal_mu != 0.0:
            proximal = lambda: add_proximal_gradient(self.model, anchor, proximal_mu)  # noqa: E731
        norms = [self.step.take(opt, rows, post_process=proximal).mean_norm for _ in range(steps)]
        return get_weights(self.model), float(np.mean(norms)) if norms else 0.0


def _segments(sigmas) -> tuple:
    """Runs of equal σ_t in order: ((steps, σ), …), the plan's ``noise_segments``."""
    out: list = []
    for v in np.asarray(sigmas, dtype=np.float64).ravel():
        if out and out[-1][1] == float(v):
            out[-1][0] += 1
        else:
            out.append([1, float(v)])
    return tuple((c, v) for c, v in out)


def local_optimizer(spec, model, *, lr: float, key: int):
    """A client's DP optimizer of the registry entry ``spec`` (``dpmf.optim.registry``), in the
    state of a fresh one each round (``PrivateLocalRun`` resets it): learning rate ``lr``, no
    momentum, no weight decay, no filter; a Newton–Schulz optimizer orthogonalizes the matrix
    parameters (EMA β = 0.95) and updates the vectors and the degenerate matrices (a single row
    or column) by DP-SGD; an optimizer that draws probes gets the seed
    ``derive_int(key, "probes")`` (public probes, independent of the noise)."""
    from dpmf.optim import matrix_shape, route_parameters
    from dpmf.optim.clipping import trainable_parameters
    from dpmf.optim.optimizers import make_optimizer

    kwargs = dict(lr=lr, weight_decay=0.0, momentum=0.0, filter=None)
    if spec.probes:
        kwargs["probe_seed"] = seeds.derive_int(int(key), "probes", bits=63)
    if not spec.newton_schulz:
        return make_optimizer(spec.name, model.parameters(), **kwargs)
    rules = {
        name: "sgd"
        for name, p in trainable_parameters(model)
        if p.ndim >= 2 and 1 in matrix_shape(tuple(p.shape))
    }
    groups = route_parameters(model, rules=rules or None)
    return make_optimizer(spec.name, groups, beta=0.95, vector_lr=None, **kwargs)


class AggregatorDPSGD:
    """Server-side DP-SGD on the aggregator dataset with a noise multiplier per step.

    Step t samples each aggregator record with probability q = B/N (Poisson), clips each
    per-example gradient to ζ, adds N(0, σ_t²ζ²) per coordinate to the sum, divides by B and
    takes an SGD step of size ``lr``. σ_t = 0 is allowed for a non-private control (its ε is ∞).

    Args:
        x, y: the aggregator dataset.
        model: the server's torch model.
        sigmas: σ_t for every server step of the whole run, shape (T,), ≥ 0.
        clip_norm, batch_size, lr: as above.
        seed: the server's key (``dpmf.seeds.child_key`` of the run's key; secret).
    """

    def __init__(self, x, y, model, *, sigmas, clip_norm: float, batch_size: int, lr: float, seed: int):
        self.x, self.y, self.model = x, y, model
        self.sigmas = np.asarray(sigmas, dtype=np.float64)
        n = int(y.shape[0])
        # one plan whose noise varies by segment of steps (the σ_t set by the clients' compliance)
        plan = PrivatePlan(
            n,
            batch_size,
            steps=int(self.sigmas.size),
            noise_segments=_segments(self.sigmas),
            clip_norm=clip_norm,
        )
        self.step = _stream_step(plan, model, seed)
        self.sampler = self.step.sampler
        self.clip_norm, self.lr = float(clip_norm), float(lr)
        # the privatized gradient's post-processing: plain SGD (torch's, no momentum)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=self.lr)

    @property
    def sampling_rate(self) -> float:
        return float(self.sampler.sampling_rate)

    def run(self, weights, steps: int):
        """The next ``steps`` server steps from ``weights``; returns the new weights."""
        from dpmf.federated.models import get_weights, set_weights

        set_weights(self.model, weights)
        x, y = torch.from_numpy(self.x), torch.from_numpy(self.y)

        def rows(batch):
            idx = torch.from_numpy(batch)
            return x[idx], y[idx], batch

        for _ in range(steps):
            self.step.take(self.optimizer, rows)
        return get_weights(self.model)


def _stream_step(plan, model, seed: int):
    """The ``dpmf.step.build`` step of a federated private run, keyed by ``seed`` (a child key of
    the run's), with the single-stream noise keys of earlier federated runs."""
    from dpmf.step import ExecutionFlags, build

    flags = ExecutionFlags(noise_keys="stream")
    return build(plan, model, F.cross_entropy, flags, seed=seeds.SeedPolicy.adopt(seed, given=False))


def client_level_plan(clients, per_round, rounds, scheme, factorization, noise_multiplier, clip_norm, *,
                      accountant=None) -> PrivatePlan:  # fmt: skip
    """The plan of a client-level run: ``clients`` P records, ``per_round`` K per round (expected
    for Poisson), ``rounds`` R steps of ``scheme``, the ``factorization`` strategy.

    ``noise_multiplier`` σ_c keeps Flower's meaning, the noise N(0, σ_c²ζ²) on a round's sum
    under identity noise; the plan's σ is σ_c / s_I, with s_I the identity strategy's
    sensitivity under the same scheme and participation, read off the plan (√R when every
    client is in every round, 1 under Poisson sampling, √k with k participations in fixed
    order), so a correlated strategy has the identity's privacy at σ_c.
    """
    identity = PrivatePlan(clients, per_round, steps=rounds, scheme=scheme, strategy="identity")
    return PrivatePlan(
        clients,
        per_round,
        steps=rounds,
        scheme=scheme,
        strategy=factorization,
        noise_multiplier=float(noise_multiplier) / identity.sensitivity,
        clip_norm=clip_norm,
        accountant=accountant,
    )


def _client_noise(plan, dim: int, seed: int):
    """The plan's unit-scale noise stream on ``dim`` model coordinates, float64 on the CPU."""
    from dpmf.step import noise_stream

    return noise_stream(plan, dim, seed, dtype=torch.float64)


class ClientLevelNoise:
    """The Gaussian noise on the sum of K clipped client updates, round by round (``client``).

    With ``factorization="identity"`` round r adds N(0, σ_c²ζ²) per coordinate to the sum
    (σ_c = ``noise_multiplier``, Flower's convention for DP-FedAvg with fixed clipping), i.e.
    σ_c·ζ/K on the mean; R rounds compose to a Gaussian mechanism with μ = √R/σ_c. A
    correlated strategy C uses the same privacy: the accountant's σ = σ_c/√R on C·G, i.e. the
    round's noise σ_c/√R·ζ·sens(C)·(C⁻¹Z)_r (identity: sens = √R, the same noise as above).

    Args:
        num_clients: K, every client in every round.
        rounds: R.
        noise_multiplier: σ_c > 0.
        clip_norm: ζ > 0, the bound on each client's update norm.
        delta: δ.
        factorization: ``identity`` or a strategy (``bisr:4``, ``blt:2``, ``sqrt_prefix``…).
        accountant: ``pld`` (default) or ``rdp``/``prv``.
        dim: number of model coordinates.
        seed: the key of the noise (``dpmf.seeds.child_key`` of the run's key; secret).
    """

    def __init__(
        self,
        num_clients: int,
        rounds: int,
        *,
        noise_multiplier: float,
        clip_norm: float,
        delta: float,
        factorization: str = "identity",
        accountant: str | None = None,
        dim: int,
        seed: int,
    ):
        # the plan of a client-level "dataset": K clients, all in each of the R rounds
        self.plan = client_level_plan(
            num_clients, num_clients, rounds, FixedOrder.name, factorization, noise_multiplier, clip_norm,
            accountant=accountant,
        )  # fmt: skip
        self.privacy = self.plan.account(delta=delta, progress=False)
        self.noise = _client_noise(self.plan, dim, seed)
        self.clip_norm = self.plan.clip_norm
        self.rounds = int(rounds)
        self.factorization = factorization

    @property
    def std_on_sum(self) -> float:
        """σ·ζ·sens: the scale of the unit-variance stream on the sum of the clipped updates."""
        return self.plan.noise_std()

    def next(self) -> np.ndarray:
        """The noise on the round's sum of clipped updates, shape (dim,), float64."""
        return self.noise.next().numpy() * self.std_on_sum
