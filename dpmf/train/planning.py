"""The calibrated ``PrivatePlan`` of a ``TrainConfig`` (``factorization="auto"`` resolved by
``pick``)."""

from __future__ import annotations

from dpmf.accountants.events import PoissonGaussianEvent
from dpmf.accountants.registry import accountants_for
from dpmf.plan.plan import PrivatePlan
from dpmf.plan.schemes import Poisson
from dpmf.train.config import TrainConfig
from dpmf.train.samplers import steps_per_epoch
from dpmf.workloads import Schedule

__all__ = ["choose_strategy", "mc_seed", "plan_for"]


def plan_for(config: TrainConfig, dataset_size: int, *, progress: bool = False, log=print):
    """The run's calibrated ``PrivatePlan`` (and ``config`` with ``factorization="auto"`` resolved).

    The plan binds N, B, n = epochs·⌈N/B⌉, the scheme, the strategy (built on A_χ for the
    scheme's participation) and the schedule; σ is calibrated for ``config.epsilon`` or taken
    from ``config.noise_multiplier`` (its ε accounted), with the config's accountant and Monte
    Carlo settings. Everything the run samples, adds and reports comes from this plan.

    Returns:
        (config, plan): ``plan.noise_multiplier`` and ``plan.privacy`` set.

    Raises:
        ValueError: a strategy the scheme cannot account, or a target no σ meets.
    """
    n = config.epochs * steps_per_epoch(dataset_size, config.batch_size)
    mc = dict(samples=config.samples, seed=mc_seed(config), progress=progress)
    own = dict(clip_norm=config.clip_norm, seed=config.seed)
    if config.factorization == "auto":  # pick's winner: built and calibrated once, by pick
        config, plan = choose_strategy(config, dataset_size, n, progress=progress, log=log)
        if _same_calibration(plan, config):
            return config, plan.with_settings(**own)
        plan = plan.replace(strategy=plan.strategy, accountant=config.accountant, **own)
        return config, plan.with_accountant(**mc).calibrate(config.epsilon, config.delta)
    plan = PrivatePlan(
        dataset_size,
        config.batch_size,
        steps=n,
        scheme=config.scheme,
        strategy=config.factorization,
        schedule=Schedule(config.schedule, config.beta, config.gamma),
        accountant=config.accountant,
        **own,
    )
    plan = plan.with_accountant(**mc)  # the accountant with the run's Monte Carlo settings
    if config.noise_multiplier is not None:
        privacy = plan.account(config.noise_multiplier, delta=config.delta)
        return config, plan.with_noise(config.noise_multiplier, privacy=privacy)
    return config, plan.calibrate(config.epsilon, config.delta)


def _same_calibration(plan: PrivatePlan, config: TrainConfig) -> bool:
    """True when the σ pick calibrated for ``plan`` is the one ``config``'s calibration gives:
    the same (ε, δ) target and the same deterministic accountant."""
    from dpmf.accountants.registry import get_accountant

    privacy = plan.privacy
    if privacy is None or privacy.delta != config.delta:
        return False
    name = plan.scheme.check_accountant(config.accountant)
    return privacy.accountant == name and not get_accountant(name).randomized


def mc_seed(config: TrainConfig) -> int:
    """The Monte Carlo accountant's seed: the run's seed when given (reproducible), else 0 (it is
    reported with the result, so never the drawn noise seed)."""
    return 0 if config.seed is None else config.seed


def choose_strategy(config: TrainConfig, dataset_size: int, steps: int, *, progress=True, log=print):
    """``config`` with ``factorization="auto"`` resolved by ``dpmf.pick.pick``, and the winner's
    calibrated plan: the recommended factorization and scheme for this run's N, B, n, (ε, δ),
    schedule and ``max_bands`` (ranked by σ·MeanSE). Deterministic: the same config gives the
    same choice (so ``--resume`` finds the same strategy). Logs the five best candidates.

    Returns:
        (config, plan): the plan as pick built and calibrated it (``plan.privacy`` set).

    Raises:
        ValueError: no candidate can be accounted under the requested scheme.
    """
    from dpmf.plan.pick import pick

    res = pick(
        dataset_size=dataset_size,
        batch_size=config.batch_size,
        steps=steps,
        epsilon=config.epsilon,
        delta=config.delta,
        schedule=Schedule(config.schedule, config.beta, config.gamma),
        max_bands=config.max_bands,
        scheme="auto" if config.scheme == Poisson.name else config.scheme,
        accountant=config.accountant if config.accountant in accountants_for(PoissonGaussianEvent) else None,
        samples=config.samples,
        seed=mc_seed(config),
        progress=progress,
    )
    for i, e in enumerate(res.ranking[:5], 1):
        log(
            f"pick {i}: {e.factorization} ({e.scheme}) σ = {e.noise_multiplier:.4g}, "
            f"σ·MeanSE = {e.noise_mean_se:.4g}, σ·MaxSE = {e.noise_max_se:.4g}"
        )
    rec = res.recommendation
    return config.replace(factorization=rec.factorization, scheme=rec.scheme), rec.plan
