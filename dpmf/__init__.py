"""dpmf: differentially private training with correlated noise.

``dpmf.PrivatePlan`` (one private run: N, B, steps, scheme, strategy, schedule, σ) and its
accounting (``account``, ``calibrate``, ``max_steps``, ``max_batch_size``,
``account_segments``: on a plan, or keywords that build one) are numpy-only;
``dpmf.make_private`` (a private step for any PyTorch loop) imports torch when first used.
Every name is imported on first use.
"""

__version__ = "0.1.0"

_PLAN_NAMES = ("PrivatePlan", "account", "calibrate", "max_steps", "max_batch_size", "account_segments")

#: subpackages reachable as attributes of a plain ``import dpmf`` (imported on first use)
_SUBPACKAGES = ("accountants", "audit", "distributed", "federated", "mechanisms", "optim")
_SUBPACKAGES += ("plan", "step", "train", "workloads")

__all__ = [
    *_PLAN_NAMES,
    "make_private",
    "PrivateTraining",
    "register_clipping_layer",
    "clipping_layer",
    "ClippingHandler",
]


def __getattr__(name):
    # imported on first use, so that ``import dpmf`` (and ``dpmf curves``) stays cheap
    if name in _PLAN_NAMES:
        from dpmf import plan

        return getattr(plan, name)
    if name in ("make_private", "PrivateTraining"):
        from dpmf.train import private

        return getattr(private, name)
    if name in ("register_clipping_layer", "clipping_layer", "ClippingHandler"):
        from dpmf.optim import clipping_layers

        return getattr(clipping_layers, name)
    if name in _SUBPACKAGES:  # ``dpmf.optim.DPMuon`` after a plain ``import dpmf``
        import importlib

        return importlib.import_module(f"dpmf.{name}")
    raise AttributeError(f"module 'dpmf' has no attribute {name!r}")
