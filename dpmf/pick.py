"""``dpmf.pick``: choosing a strategy for a privacy budget (implemented in ``dpmf.plan.pick``)."""

from dpmf.plan.pick import PICK_SCHEMES, PickEntry, PickResult, candidate_specs, default_jobs, pick

__all__ = ["PICK_SCHEMES", "PickEntry", "PickResult", "candidate_specs", "default_jobs", "pick"]
