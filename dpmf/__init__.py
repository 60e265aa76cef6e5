"""dpmf: differentially private training with correlated noise.

``dpmf.PrivatePlan`` (one private run: N, B, steps, scheme, strategy, schedule, σ) and its
accounting are numpy-only; ``dpmf.make_private`` (a private step for any PyTorch loop) imports
torch when first used.
"""

from dpmf.plan import PrivatePlan, account, calibrate

__version__ = "0.1.0"

__all__ = ["PrivatePlan", "account", "calibrate", "make_private", "PrivateTraining"]


def __getattr__(name):
    if name in ("make_private", "PrivateTraining"):
        from dpmf.train import private

        return getattr(private, name)
    raise AttributeError(f"module 'dpmf' has no attribute {name!r}")
