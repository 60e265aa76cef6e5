"""DP optimizers: post-processing of the privatized gradient, as torch.optim.Optimizer classes.

The training loop leaves in ``p.grad`` the privatized gradient G̃_t: per-example gradients
clipped to ζ, summed, plus this step's (correlated) Gaussian noise, divided by the expected
batch size. Everything here is post-processing of G̃_t and costs no privacy (the post-processing
theorem of differential privacy). Each parameter group has an update **rule**, a short chain of stages from
``dpmf.optim.transforms``:

=========  ======================================================================  ============
rule       chain (``filter`` first when given)                                     parameters
=========  ======================================================================  ============
sgd        L2 weight decay → heavy-ball momentum (optionally Nesterov)             any
adam       L2 weight decay → Adam (or Adam → decoupled decay)                      any
muon       EMA momentum + Nesterov look-ahead → Newton–Schulz → √min(4, max(1,    matrices
           m/n)) → decoupled decay
muon_s     as muon, times σ₁(M_t) by power iteration, aspect √max(1, m/n)         matrices
muon_bc    as muon with the bias-corrected Newton–Schulz of DP-MuonBC              matrices
=========  ======================================================================  ============

The rules are the entries of the optimizer registry (``dpmf.optim.registry``: one
``OptimizerSpec`` per optimizer, with its factory below); ``RULES`` and ``MATRIX_RULES`` are
read from it. The step is p ← p − lr·u for the chain's output u. A group may also carry its own
``transform`` (any ``Transform``), which replaces the rule. "Matrices" are parameters with a
proper matrix view out × (in·kh·kw) (``dpmf.optim.matrix``); nothing else ever reaches
Newton–Schulz. ``route_parameters`` builds the groups from a model.

The optimizers check, before touching any parameter, that every gradient is finite (one device
synchronization per step; ``check_finite=False`` skips it).
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import required

from dpmf._validation import check_choice, check_int, check_real
from dpmf.optim.fsdp import is_sharded, orthogonalized_by_owners
from dpmf.optim.matrix import check_matrix_parameter
from dpmf.optim.model_guard import OptimizerGroups
from dpmf.optim.orthogonalization import QUINTIC_COEFFICIENTS
from dpmf.optim.registry import get_optimizer, matrix_rule_names, rule_names, spec_of_rule
from dpmf.optim.transforms import (
    AddDecayedWeights,
    Chain,
    EmaMomentum,
    HeavyBall,
    Orthogonalize,
    OrthogonalizeBiasCorrected,
    ScaleByAdam,
    ScaleByShape,
    ScaleBySpectralNorm,
    StepContext,
    Transform,
    chain,
)

__all__ = [
    "PLACEHOLDER_RULES",
    "DPOptimizer",
    "DPSGD",
    "DPAdam",
    "DPMuon",
    "DPMuonS",
    "DPMuonBC",
    "dp_sgd",
    "dp_adam",
    "dp_muon",
    "dp_muon_s",
    "dp_muon_bc",
    "build_transform",
    "make_optimizer",
]


def __getattr__(name):
    # RULES and MATRIX_RULES follow the optimizer registry (an optimizer registered later
    # appears in them)
    if name == "RULES":
        return rule_names()
    if name == "MATRIX_RULES":
        return matrix_rule_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Placeholders a group may use as its rule, resolved by the optimizer: "matrix" and "vector"
#: become its ``matrix_rule`` and ``vector_rule``; "auto" splits the group into the
#: parameters with two or more dimensions ("matrix") and the others ("vector").
PLACEHOLDER_RULES = ("auto", "matrix", "vector")

# Group keys holding stage objects; saved in state dicts as {_STAGE_RECORD: repr(stage)}.
_STAGE_KEYS = ("filter", "transform")
_STAGE_RECORD = "dpmf_stage"


# torch.optim.Optimizer.add_param_group without its torch._dynamo.disable wrapper, whose first
# call imports torch._dynamo (≈1.5 s on CPU): adding a group runs when an optimizer is built,
# never inside a compiled region, so the wrapper changes nothing here. The same function when
# this torch exposes no unwrapped one.
_TORCH_ADD_GROUP = getattr(
    torch.optim.Optimizer.add_param_group, "__wrapped__", torch.optim.Optimizer.add_param_group
)


def _add_group(optimizer, group: dict) -> None:
    """torch's ``Optimizer.add_param_group`` (its checks and defaults) on ``optimizer``."""
    _TORCH_ADD_GROUP(optimizer, group)


def _stage_id(stage) -> str:
    """What identifies a stage in a state dict: its repr (a frozen dataclass's lists its
    hyperparameters), or its class name when the repr is the default one with an address."""
    if stage is not None and type(stage).__repr__ is object.__repr__:
        return f"{type(stage).__module__}.{type(stage).__qualname__}"
    return repr(stage)


# Hyperparameters every group carries (a class overrides some of them).
_BASE_DEFAULTS = dict(
    rule="sgd",
    weight_decay=0.0,
    # sgd
    momentum=0.0,
    nesterov=False,
    # adam
    betas=(0.9, 0.999),
    eps=1e-8,
    decoupled_weight_decay=False,
    # muon family
    beta=0.95,
    lookahead=True,
    ns_steps=5,
    ns_coefficients=QUINTIC_COEFFICIENTS,
    power_iterations=2,
    order=1,
    probes=1,
    antithetic=True,
    # extension points
    filter=None,
    transform=None,
)


# --- the named optimizers as compositions of stages ----------------------------------------


def dp_sgd(momentum=0.0, nesterov=False, weight_decay=0.0, filter=None) -> Transform:
    """DP-SGD: [filter →] g + λ·p → heavy-ball momentum μ (Nesterov optional), as torch SGD."""
    return chain(filter, AddDecayedWeights(weight_decay), HeavyBall(momentum, nesterov))


def dp_adam(
    betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled_weight_decay=False, filter=None
) -> Transform:
    """DP-Adam: [filter →] L2 decay → Adam, or Adam → decoupled decay (AdamW), as torch Adam."""
    if not isinstance(decoupled_weight_decay, bool):
        raise TypeError(f"decoupled_weight_decay={decoupled_weight_decay!r} is invalid: must be a bool")
    b1, b2 = _pair("betas", betas)
    adam = ScaleByAdam(b1, b2, eps)
    if decoupled_weight_decay:
        return chain(filter, adam, AddDecayedWeights(weight_decay))
    return chain(filter, AddDecayedWeights(weight_decay), adam)


def dp_muon(
    beta=0.95,
    lookahead=True,
    ns_steps=5,
    ns_coefficients=QUINTIC_COEFFICIENTS,
    weight_decay=0.0,
    filter=None,
) -> Transform:
    """DP-Muon (the DP-Muon paper, Sec. Method): M_t = βM_{t−1} + (1−β)G̃_t; M̂_t = (1−β)G̃_t + βM_t;
    X₅ = five quintic Newton–Schulz steps from M̂_t/‖M̂_t‖_F; u = √min(4, max(1, m/n))·X₅
    (+ λ·p, decoupled weight decay)."""
    return chain(
        filter,
        EmaMomentum(beta, lookahead),
        Orthogonalize(ns_steps, ns_coefficients),
        ScaleByShape(4.0),
        AddDecayedWeights(weight_decay),
    )


def dp_muon_s(
    beta=0.95,
    lookahead=True,
    ns_steps=5,
    ns_coefficients=QUINTIC_COEFFICIENTS,
    power_iterations=2,
    weight_decay=0.0,
    filter=None,
) -> Transform:
    """DP-Muon-S (the DP-Muon paper, Sec. Method): u = σ₁(M_t)·√max(1, m/n)·X₅, σ₁ of the heavy-ball
    (EMA) momentum M_t by warm-started power iteration."""
    return chain(
        filter,
        EmaMomentum(beta, lookahead),
        Orthogonalize(ns_steps, ns_coefficients),
        ScaleBySpectralNorm(power_iterations, "momentum"),
        ScaleByShape(None),
        AddDecayedWeights(weight_decay),
    )


def dp_muon_bc(
    beta=0.95,
    lookahead=True,
    ns_steps=5,
    ns_coefficients=QUINTIC_COEFFICIENTS,
    order=1,
    probes=1,
    weight_decay=0.0,
    filter=None,
    antithetic=True,
) -> Transform:
    """DP-MuonBC: DP-Muon with X₅ replaced by the order-K heat-extrapolated Newton–Schulz
    (``dpmf.optim.bias_correction``); the fresh-noise std of M̂_t is (1−β)(1+β) times that of
    the privatized gradient (``EmaMomentum.fresh_gain``)."""
    return chain(
        filter,
        EmaMomentum(beta, lookahead),
        OrthogonalizeBiasCorrected(order, probes, antithetic, ns_steps, ns_coefficients),
        ScaleByShape(4.0),
        AddDecayedWeights(weight_decay),
    )


def build_transform(group: dict) -> Transform:
    """The stage chain of a parameter group: its ``transform`` if given, else its rule's.

    Raises:
        ValueError / TypeError: unknown rule or invalid hyperparameters (naming them).
    """
    custom = group.get("transform")
    if custom is not None:
        if not isinstance(custom, Transform):
            raise TypeError(f"transform={custom!r} is invalid: must be a dpmf Transform")
        return custom
    filt = group.get("filter")
    if filt is not None and not isinstance(filt, Transform):
        raise TypeError(f"filter={filt!r} is invalid: must be a dpmf Transform or None")
    return spec_of_rule(group["rule"]).make_transform(group, filt)


def _pair(name, value):
    try:
        a, b = value
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is invalid: must be a pair of reals in [0, 1)") from None
    return a, b


# --- the optimizer ---------------------------------------------------------------------------


class DPOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose parameter groups each follow one rule of ``RULES`` (module
    docstring), reading the privatized gradient from ``p.grad``.

    Args:
        params: tensors, (name, tensor) pairs, or parameter groups (dicts; e.g. from
            ``route_parameters``) with any of the hyperparameters below as keys.
        defaults: the hyperparameters of groups that do not set them.
        matrix_rule: the rule of the placeholder "matrix" (parameters with two or more
            dimensions, when a group's rule is "auto" or "matrix").
        vector_rule: the rule of the placeholder "vector" (the others: biases, norm scales),
            "sgd" or "adam".
        vector_lr: learning rate of the "vector" parameters (None: the group's lr).
        probe_seed: seed of the optimizer's own torch.Generator(s) (one per device) for the
            random probes of DP-MuonBC.
        check_finite: refuse a step whose gradients contain NaN or inf.
        noise_std: the fresh-noise std per entry of p.grad when no privatizer is bound (only
            DP-MuonBC needs it).
        allow_unprivatized: False (default): ``step()`` refuses gradients that did not come from
            the bound privatizer's private step for this step (``DPOptimizer.bind``; through
            ``dpmf.make_private`` or ``dpmf train`` this is automatic). True opts out, for
            gradients privatized by other means.

    Hyperparameters (group keys): lr; rule (one of ``RULES`` or ``PLACEHOLDER_RULES``);
    weight_decay (L2 for sgd/adam, decoupled for the muon rules and for adam with
    decoupled_weight_decay); momentum, nesterov (sgd); betas, eps, decoupled_weight_decay
    (adam); beta, lookahead, ns_steps, ns_coefficients (muon rules); power_iterations
    (muon_s); order, probes, antithetic (muon_bc); filter (a ``Transform`` run first on the
    privatized gradient, e.g. a temporal filter); transform (a ``Transform`` replacing the
    rule).

    Raises:
        ValueError / TypeError: invalid hyperparameters, an unknown rule, or a parameter
            without a proper matrix view in a matrix rule — before any step.
    """

    def __init__(
        self,
        params,
        defaults: dict,
        *,
        matrix_rule: str = "muon",
        vector_rule: str = "sgd",
        vector_lr: float | None = None,
        probe_seed: int = 0,
        check_finite: bool = True,
        noise_std: float | None = None,
        allow_unprivatized: bool = False,
    ):
        self.matrix_rule = check_choice("matrix_rule", matrix_rule, rule_names())
        self.vector_rule = check_choice(
            "vector_rule", vector_rule, [r for r in rule_names() if r not in matrix_rule_names()]
        )
        self.vector_lr = None if vector_lr is None else check_real("vector_lr", vector_lr, low=0.0)
        self.probe_seed = check_int("probe_seed", probe_seed, minimum=0)
        if not isinstance(check_finite, bool):
            raise TypeError(f"check_finite={check_finite!r} is invalid: must be a bool")
        self.check_finite = check_finite
        if not isinstance(allow_unprivatized, bool):
            raise TypeError(f"allow_unprivatized={allow_unprivatized!r} is invalid: must be a bool")
        self.allow_unprivatized = allow_unprivatized
        self._noise_std: float | None = (
            None if noise_std is None else check_real("noise_std", noise_std, low=0.0)
        )
        self._source = None
        self._bound_groups = None
        self._chains: dict[int, tuple] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._pending_generator_states: dict[str, torch.Tensor] = {}
        full = dict(_BASE_DEFAULTS)
        full.update(defaults)
        super().__init__(params, full)

    # -- groups ---------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        """Validate a group (filling defaults), resolve its placeholder rule, and add it.

        An "auto" group becomes up to two groups (matrices, vectors) unless both resolve to
        the same rule and learning rate.

        Raises:
            ValueError / TypeError: as the class.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        named = [p if isinstance(p, tuple) else (None, p) for p in params]
        if "param_names" in group and all(n is None for n, _ in named):
            named = list(zip(group.pop("param_names"), (p for _, p in named), strict=True))
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        if group["lr"] is required:
            raise ValueError("lr is required: give it to the optimizer or to every group")
        group["lr"] = check_real("lr", group["lr"], low=0.0)
        rule = check_choice("rule", group["rule"], rule_names() + PLACEHOLDER_RULES)
        vector_lr = group["lr"] if self.vector_lr is None else self.vector_lr
        if rule == "auto" and (self.matrix_rule, group["lr"]) == (self.vector_rule, vector_lr):
            parts = [dict(group, rule=self.matrix_rule, params=named)]
        elif rule == "auto":
            matrices = [(n, p) for n, p in named if p.ndim >= 2]
            vectors = [(n, p) for n, p in named if p.ndim < 2]
            parts = [dict(group, rule=self.matrix_rule, params=matrices)] if matrices else []
            if vectors:
                parts.append(dict(group, rule=self.vector_rule, lr=vector_lr, params=vectors))
        elif rule == "matrix":
            parts = [dict(group, rule=self.matrix_rule, params=named)]
        elif rule == "vector":
            parts = [dict(group, rule=self.vector_rule, lr=vector_lr, params=named)]
        else:
            parts = [dict(group, params=named)]
        for part in parts:
            self._check_group(part)
            names = [n for n, _ in part["params"]]
            if names and all(n is not None for n in names):
                part["params"] = [(n, p) for n, p in part["params"]]
            else:
                part["params"] = [p for _, p in part["params"]]
            _add_group(self, part)

    def reset_state(self) -> None:
        """Forget every step taken: the per-parameter state, the stage chains and the probe
        generators' positions. The optimizer then steps exactly as a freshly built one over the
        same parameter groups and hyperparameters (and stays bound to its privatizer)."""
        self.state.clear()
        self._chains.clear()
        self._generators.clear()
        self._pending_generator_states.clear()

    def _check_group(self, group: dict) -> None:
        check_choice("rule", group["rule"], rule_names())
        build_transform(group)  # validates every hyperparameter of the rule
        for i, (name, p) in enumerate(group["params"]):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params[{i}] is invalid: must be a torch.Tensor, got {type(p)}")
            if not p.is_floating_point():
                raise TypeError(
                    f"parameter {name or i!r} of dtype {p.dtype} is invalid: must be floating point"
                )
            uses_matrix = group.get("transform") is None and group["rule"] in matrix_rule_names()
            if uses_matrix:
                check_matrix_parameter(name if name is not None else f"params[{i}]", p.shape)

    # -- noise std for the bias correction --------------------------------------------------

    def bind(self, source) -> None:
        """Step only on the private gradients of ``source`` (a ``dpmf.optim.Privatizer``) and
        take each step's fresh-noise std from it. The binding is one way: the privatizer never
        refers to its optimizer. From now on ``step()`` checks, before touching any parameter,
        that this optimizer's parameter groups are those of now (``OptimizerGroups``) and that
        every gradient it would read is the one ``source`` wrote for this step
        (``Privatizer.check_gradients``), and marks that gradient used afterwards.

        The fresh-noise std is the per-entry std of the part of this step's noise in p.grad
        independent of earlier steps, σ·ζ·s·|(C⁻¹)_tt|/B̄. Only DP-MuonBC uses it; the stages
        convert it to the std of the noise in the matrix they correct (×(1−β)(1+β) for Nesterov
        EMA momentum).
        """
        self._source = source
        self._bound_groups = OptimizerGroups(self)

    @property
    def bound_to(self):
        """The privatizer given to ``bind`` (None before)."""
        return self._source

    @property
    def noise_std(self) -> float | None:
        """The fresh-noise std per entry of p.grad: from the bound privatizer's last step, else
        the ``noise_std`` given at construction (None if neither)."""
        if self._source is not None:
            return self._source.fresh_noise_std
        return self._noise_std

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.probe_seed)
            pending = self._pending_generator_states.pop(key, None)
            if pending is not None:
                gen.set_state(pending.cpu())
            self._generators[key] = gen
        return gen

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """torch's state dict plus ``"dpmf"``: the noise std and the probe generators' states.

        A group's ``filter`` and ``transform`` stages are saved as their ``repr`` (plain data,
        so ``torch.load(weights_only=True)`` reads the result); ``load_state_dict`` keeps this
        optimizer's own stages and checks that they are the saved ones.
        """
        sd = super().state_dict()
        sd["param_groups"] = [
            dict(
                g,
                **{
                    k: {_STAGE_RECORD: _stage_id(g[k])}
                    for k in _STAGE_KEYS
                    if isinstance(g.get(k), Transform)
                },
            )
            for g in sd["param_groups"]
        ]
        gens = dict(self._pending_generator_states)
        gens.update({k: g.get_state() for k, g in self._generators.items()})
        sd["dpmf"] = {"probe_seed": self.probe_seed, "generators": gens}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict from ``state_dict()`` (restores the probe generators too).

        Raises:
            ValueError: a group's saved ``filter``/``transform`` differs from this optimizer's.
        """
        state_dict = dict(state_dict)
        extra = state_dict.pop("dpmf", None)
        groups = []
        for i, (saved, own) in enumerate(
            zip(state_dict.get("param_groups", []), self.param_groups, strict=False)
        ):
            saved = dict(saved)
            for key in _STAGE_KEYS:
                if key not in saved:
                    continue
                value, mine = saved[key], own.get(key)
                theirs = (
                    value[_STAGE_RECORD]
                    if isinstance(value, dict) and _STAGE_RECORD in value
                    else _stage_id(value)
                )
                if theirs != _stage_id(mine):
                    raise ValueError(
                        f"state_dict is invalid for this optimizer: param_groups[{i}] was saved "
                        f"with {key}={theirs}, this optimizer has {key}={mine!r}"
                    )
                saved[key] = mine
            groups.append(saved)
        state_dict["param_groups"] = groups + list(state_dict.get("param_groups", []))[len(groups) :]
        super().load_state_dict(state_dict)
        if extra is not None:
            self.probe_seed = extra.get("probe_seed", self.probe_seed)
            self._generators = {}
            self._pending_generator_states = dict(extra.get("generators", {}))

    # -- the step ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """Apply one update p ← p − lr·u to every parameter with a gradient.

        Returns:
            The closure's loss, or None.

        Raises:
            ValueError: a gradient with NaN/inf (no parameter is changed), an unknown
                fresh-noise std for DP-MuonBC.
            TypeError: a sparse gradient.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._source is not None:
            self._bound_groups.check("optimizer.step()")
            self._source.check_gradients(self._bound_groups.params())
        elif not self.allow_unprivatized:
            raise RuntimeError(
                f"{type(self).__name__}.step() refused: no privatizer is bound, so nothing shows that "
                "p.grad holds privatized gradients (a plain loss.backward() would train without "
                "clipping or noise). Use dpmf.make_private(...), or optimizer.bind(privatizer) and "
                "privatizer.privatize(...) each step; pass allow_unprivatized=True only for gradients "
                "you privatized yourself"
            )
        work = []
        for gi, group in enumerate(self.param_groups):
            names = group.get("param_names")
            items = []
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                name = names[pi] if names else f"param_groups[{gi}].params[{pi}]"
                if p.grad.is_sparse:
                    raise TypeError(f"parameter {name!r}: sparse gradients are not supported")
                items.append((name, p))
            if items:
                work.append((group, self._chain(gi, group), items))
        if self.check_finite:
            self._check_finite([it for _, _, items in work for it in items])
        noise_std = self.noise_std
        for group, transform, items in work:
            lr = group["lr"]
            k = _owned_stage(transform, items)
            if k is not None:
                self._step_by_owners(transform, k, items, lr, noise_std)
                continue
            for name, p in items:
                state = self.state[p]
                if "transform" not in state:
                    state["transform"] = transform.init(p)
                ctx = StepContext(name=name, noise_std=noise_std, generator=self._generator(p.device))
                update, state["transform"] = transform.update(p.grad, state["transform"], p, ctx)
                p.add_(update.to(p.dtype), alpha=-lr)
        if self._source is not None:
            self._source.consume()
        return loss

    def _step_by_owners(self, transform: Chain, k: int, items: list, lr: float, noise_std) -> None:
        """One group's update of fully_shard matrices whose chain orthogonalises (stage ``k``):
        the stages before it on every matrix, then the orthogonalisation of all of them by
        owners (``orthogonalized_by_owners``: each matrix gathered to one rank, the gathers
        overlapping the owners' Newton–Schulz), then the stages after it — the same update as
        the chain's, matrix by matrix."""
        pending = []
        for name, p in items:
            state = self.state[p]
            if "transform" not in state:
                state["transform"] = transform.init(p)
            check_matrix_parameter(name, p.shape)
            ctx = StepContext(name=name, noise_std=noise_std, generator=self._generator(p.device))
            new: dict = {}
            u = transform.update_stages(p.grad, state["transform"], p, ctx, new, 0, k)
            pending.append((p, ctx, new, u))
        stage = transform.stages[k]
        done = orthogonalized_by_owners([u for *_, u in pending], stage.whole)
        for (p, ctx, new, _), u in zip(pending, done, strict=True):
            old = self.state[p]["transform"]
            new[str(k)] = old[str(k)]  # the orthogonalisation keeps no state
            transform.note_stage(k, new[str(k)], ctx)
            u = transform.update_stages(u, old, p, ctx, new, k + 1, len(transform.stages))
            self.state[p]["transform"] = new
            p.add_(u.to(p.dtype), alpha=-lr)

    def _chain(self, index: int, group: dict) -> Transform:
        """The group's stage chain, built once and rebuilt only when a hyperparameter other
        than ``lr`` changes (the learning-rate schedule changes ``lr`` every step)."""
        key = tuple(
            (k, repr(v)) for k, v in sorted(group.items()) if k not in ("params", "param_names", "lr")
        )
        cached = self._chains.get(index)
        if cached is None or cached[0] != key:
            cached = (key, build_transform(group))
            self._chains[index] = cached
        return cached[1]

    @staticmethod
    def _check_finite(items) -> None:
        # Fast path: one sum per gradient (a NaN or inf entry makes it non-finite) and one
        # synchronization per device; the exact element-wise test runs only if a sum is not
        # finite (which finite entries reach only by overflowing the sum).
        by_device: dict = {}
        for name, p in items:
            g = p.grad
            total = g.sum(dtype=torch.promote_types(g.dtype, torch.float32))
            by_device.setdefault(g.device, []).append((name, p, total))
        for entries in by_device.values():
            if bool(torch.isfinite(torch.stack([t for _, _, t in entries])).all()):
                continue
            for name, p, total in entries:
                if not bool(torch.isfinite(total)) and not bool(torch.isfinite(p.grad).all()):
                    raise ValueError(
                        f"the privatized gradient of parameter {name!r} has NaN or infinite "
                        "entries; no parameter was updated (check the clipping and the noise)"
                    )


def _owned_stage(transform: Transform, items: list) -> int | None:
    """The index of the orthogonalisation stage of a chain stepping fully_shard matrices (then
    orthogonalised by owners, all the group's at once), or None: the step goes matrix by matrix."""
    if not isinstance(transform, Chain) or not items or not all(is_sharded(p) for _, p in items):
        return None
    return next((i for i, s in enumerate(transform.stages) if type(s) is Orthogonalize), None)


class DPSGD(DPOptimizer):
    """DP-SGD with heavy-ball momentum (optionally Nesterov) and L2 weight decay, on the
    privatized gradient; the same update as torch.optim.SGD (dampening 0) given the same
    gradients. Every group uses rule "sgd" (the placeholders "matrix" and "vector" of
    ``route_parameters`` included) unless it names another rule.

    Raises:
        ValueError: lr < 0, momentum outside [0, 1), weight_decay < 0, Nesterov without
            momentum.
    """

    def __init__(
        self,
        params,
        lr=required,
        momentum=0.0,
        nesterov=False,
        weight_decay=0.0,
        *,
        filter=None,
        check_finite=True,
        allow_unprivatized=False,
        noise_std=None,
    ):
        super().__init__(
            params,
            dict(
                lr=lr,
                rule="auto",
                momentum=momentum,
                nesterov=nesterov,
                weight_decay=weight_decay,
                filter=filter,
            ),
            matrix_rule="sgd",
            vector_rule="sgd",
            check_finite=check_finite,
            allow_unprivatized=allow_unprivatized,
            noise_std=noise_std,
        )


class DPAdam(DPOptimizer):
    """DP-Adam on the privatized gradient; the same update as torch.optim.Adam (amsgrad off)
    given the same gradients, with ``decoupled_weight_decay`` as torch's AdamW. Every group
    uses rule "adam" (placeholders included) unless it names another rule.

    Raises:
        ValueError: lr < 0, betas outside [0, 1), eps <= 0, weight_decay < 0.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        decoupled_weight_decay=False,
        *,
        filter=None,
        check_finite=True,
        allow_unprivatized=False,
        noise_std=None,
    ):
        super().__init__(
            params,
            dict(
                lr=lr,
                rule="auto",
                betas=tuple(betas),
                eps=eps,
                weight_decay=weight_decay,
                decoupled_weight_decay=decoupled_weight_decay,
                filter=filter,
            ),
            matrix_rule="adam",
            vector_rule="adam",
            check_finite=check_finite,
            allow_unprivatized=allow_unprivatized,
            noise_std=noise_std,
        )


class DPMuon(DPOptimizer):
    """DP-Muon exactly as the DP-Muon paper (Sec. Method), for every parameter with a matrix view
    (conv kernels as out × in·kh·kw):

        M_t = β·M_{t−1} + (1−β)·G̃_t,   M̂_t = (1−β)·G̃_t + β·M_t,   X₀ = M̂_t/‖M̂_t‖_F,
        X ← aX + b(XXᵀ)X + c(XXᵀ)²X five times, (a, b, c) = (3.4445, −4.7750, 2.0315),
        p ← p − lr·(√min(4, max(1, m/n))·X₅ + λ·p);

    Parameters with fewer than two dimensions (biases, norm scales) use DP-SGD with heavy-ball
    momentum ``vector_momentum`` (learning rate ``vector_lr``, default ``lr``). Groups with a rule
    (e.g. from ``route_parameters``) keep it; its placeholders "matrix"/"vector" become
    "muon"/"sgd".

    Args:
        params: tensors, named tensors or groups.
        lr: learning rate of the matrix update (its entries have RMS ≈ 1/√max(m, n)).
        beta: EMA momentum β in [0, 1).
        lookahead: Nesterov look-ahead M̂_t (True in DP-Muon); False uses M_t.
        ns_steps, ns_coefficients: the Newton–Schulz iteration.
        weight_decay: decoupled weight decay λ of the matrices (L2 for the "sgd" vectors).
        vector_momentum, vector_nesterov: heavy-ball momentum μ of the 1-D parameters (group
            keys ``momentum`` and ``nesterov`` of the "sgd" rule). The matrices' momentum is
            ``beta``; passing ``momentum=`` is refused to avoid mixing the two up.
        vector_lr: learning rate of the 1-D parameters (None: lr).
        filter: a ``Transform`` applied first to the privatized gradient (temporal filter).

    Raises:
        ValueError: invalid hyperparameters; a parameter of two or more dimensions whose matrix
            view has a single row or column (e.g. shape (C, 1, 1)) — route it explicitly.
    """

    _matrix_rule = "muon"

    def __init__(
        self,
        params,
        lr=0.02,
        beta=0.95,
        *,
        lookahead=True,
        ns_steps=5,
        ns_coefficients=QUINTIC_COEFFICIENTS,
        weight_decay=0.0,
        vector_momentum=0.9,
        vector_nesterov=False,
        vector_lr=None,
        filter=None,
        check_finite=True,
        allow_unprivatized=False,
        **extra,
    ):
        if "momentum" in extra or "nesterov" in extra:
            raise TypeError(
                f"{type(self).__name__}: the matrices' EMA momentum is beta (and lookahead); the "
                "1-D parameters' heavy-ball momentum is vector_momentum (and vector_nesterov)"
            )
        defaults = dict(
            lr=lr,
            rule="auto",
            beta=beta,
            lookahead=lookahead,
            ns_steps=ns_steps,
            ns_coefficients=tuple(ns_coefficients),
            weight_decay=weight_decay,
            momentum=vector_momentum,
            nesterov=vector_nesterov,
            filter=filter,
        )
        probe_seed = extra.pop("probe_seed", 0)
        noise_std = extra.pop("noise_std", None)
        unknown = sorted(set(extra) - set(_BASE_DEFAULTS))
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected keyword arguments {unknown}")
        defaults.update(extra)
        super().__init__(
            params,
            defaults,
            matrix_rule=self._matrix_rule,
            vector_lr=vector_lr,
            probe_seed=probe_seed,
            check_finite=check_finite,
            noise_std=noise_std,
            allow_unprivatized=allow_unprivatized,
        )


class DPMuonS(DPMuon):
    """DP-Muon-S (the DP-Muon paper, Sec. Method): the matrix update is σ₁(M_t)·√max(1, m/n)·X₅, with
    σ₁ of the heavy-ball (EMA) momentum M_t by ``power_iterations`` warm-started power
    iterations per step (the vector is kept in the state). Otherwise as ``DPMuon``.
    """

    _matrix_rule = "muon_s"

    def __init__(self, params, lr=0.02, beta=0.95, *, power_iterations=2, **kwargs):
        super().__init__(params, lr, beta, power_iterations=power_iterations, **kwargs)


class DPMuonBC(DPMuon):
    """DP-MuonBC: DP-Muon with the order-``order`` bias-corrected Newton–Schulz map
    (``dpmf.optim.bias_correction``): 2·f(M̂_t) − mean_j f(M̂_t ± s·ξ_j) at order 1, with
    fresh probes ξ_j ~ N(0, I) from the optimizer's own generator seeded by ``probe_seed``
    and s = (1−β)(1+β)·std — the std of the fresh noise in M̂_t (β·M_t with look-ahead off
    gives (1−β)·std), with std the optimizer's ``noise_std``: the bound privatizer's fresh-noise
    std of the step (``Privatizer.bind``), or the ``noise_std`` given at construction.

    Args:
        order: extrapolation order K >= 1 (bias O(s^(2K+2))).
        probes: probes per order level, >= 1, each used as ±ξ (cost: 1 + 2·probes·order
            Newton–Schulz evaluations per matrix, in one batch).
        antithetic: False uses each probe once (+ξ only: 1 + probes·order evaluations).
        probe_seed: seed of the probe generator (saved in ``state_dict``).
        Other arguments as ``DPMuon``.
    """

    _matrix_rule = "muon_bc"

    def __init__(
        self, params, lr=0.02, beta=0.95, *, order=1, probes=1, antithetic=True, probe_seed=0, **kwargs
    ):
        super().__init__(
            params,
            lr,
            beta,
            order=order,
            probes=probes,
            antithetic=antithetic,
            probe_seed=probe_seed,
            **kwargs,
        )


def make_optimizer(
    name: str,
    params,
    *,
    lr: float,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    beta: float = 0.95,
    vector_lr: float | None = None,
    filter: Transform | None = None,
    probe_seed: int = 0,
) -> DPOptimizer:
    """The registered optimizer ``name`` (``dpmf.optim.registry``) over ``params``.

    Every group of ``rule="auto"`` (or a placeholder) gets the optimizer's rule; for a
    Newton–Schulz optimizer the matrices get it and the other parameters DP-SGD with
    heavy-ball ``momentum`` (learning rate ``vector_lr``, default ``lr``), as ``DPMuon``.

    Args:
        name: a registered optimizer name, e.g. ``"dp-sgd"`` or ``"dp-muon-bc"``.
        params: tensors, named tensors or parameter groups (``route_parameters``).
        lr: learning rate ≥ 0.
        weight_decay: L2 (sgd, adam) or decoupled (Newton–Schulz rules) weight decay ≥ 0.
        momentum: heavy-ball momentum of the "sgd" rule (DP-SGD, and a Newton–Schulz
            optimizer's 1-D parameters).
        beta: EMA momentum of a Newton–Schulz rule.
        vector_lr: learning rate of a Newton–Schulz optimizer's 1-D parameters.
        filter: a ``Transform`` run first on the privatized gradient.
        probe_seed: the probe generator's seed (optimizers with ``probes``).

    Raises:
        ValueError / TypeError: an unknown name or invalid hyperparameters.
    """
    spec = get_optimizer(name)
    defaults = dict(lr=lr, rule="auto", weight_decay=weight_decay, filter=filter)
    if spec.newton_schulz:
        defaults.update(beta=beta, momentum=momentum, nesterov=False)
        rules = dict(matrix_rule=spec.rule, vector_rule="sgd", vector_lr=vector_lr)
    else:
        if "momentum" in spec.hyperparameters:
            defaults.update(momentum=momentum)
        rules = dict(matrix_rule=spec.rule, vector_rule=spec.rule)
    return DPOptimizer(params, defaults, probe_seed=probe_seed, **rules)
