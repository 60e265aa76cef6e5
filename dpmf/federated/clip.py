"""The clipping factor of one client update (client-level DP): one rule for ``dpmf fl
--privacy client`` and ``CorrelatedClientDP``."""

from __future__ import annotations

import math

__all__ = ["update_scale"]


def update_scale(norm: float, clip_norm: float, server_round: int) -> float:
    """min(1, ζ/‖Δ‖): the factor that clips a client update Δ of ℓ2 norm ``norm`` to ζ
    (McMahan et al., "Learning Differentially Private Recurrent Language Models", ICLR 2018).

    Raises:
        RuntimeError: ``norm`` is not finite (NaN or ∞ in the update): such an update cannot be
            clipped, and ``min(1, ζ/nan)`` would let it through unclipped.
    """
    if not math.isfinite(norm):
        raise RuntimeError(
            f"round {server_round}: a client update is not finite (its norm is {norm}); it cannot be "
            "clipped and is refused: find the client whose training diverged (lower its learning rate)"
        )
    return min(1.0, clip_norm / norm) if norm > 0 else 1.0
