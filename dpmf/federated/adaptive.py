"""Adaptive clipping of client updates: the clip norm follows a quantile of the update norms.

Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with Adaptive Clipping"
(NeurIPS 2021). Round r clips every client update Δ_k to the current norm C_r and counts the
updates that were *not* clipped, b_k = 1[‖Δ_k‖ ≤ C_r]; the count is released with Gaussian noise
of standard deviation σ_b (``clipped_count_stddev``), centred so that one client moves it by ½,

    b̄_r = (Σ_k (b_k − ½) + N(0, σ_b²)) / P + ½,             (P clients per round, public)

and the clip norm takes one geometric step towards the γ-quantile of the norms
(γ = ``target_clipped_quantile``, η = ``clip_norm_lr``; their Algorithm 1):

    C_{r+1} = C_r · exp(−η · (b̄_r − γ)).

With more than γ of the updates unclipped the norm shrinks, with fewer it grows; at the fixed
point a share γ of the updates lies within C. The count query Σ_k (b_k − ½) has sensitivity ½
for one client, so its noise multiplier is 2σ_b; the updates' Gaussian noise multiplier z_Δ is
raised so that the two releases of a round together are a Gaussian mechanism of the requested
noise multiplier z (Gaussian mechanisms compose as 1/z² = 1/z_Δ² + 1/(2σ_b)²; their
Section 3.1):

    z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2),   defined for z < 2σ_b.

ε of a run with adaptive clipping is therefore ε of the same run with fixed clipping at z.
Defaults as the paper recommends: C_0 = 0.1 (the wrapper's ``clip_norm``), γ = 0.5, η = 0.2,
σ_b = P/20.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dpmf._validation import check_real

__all__ = ["AdaptiveClipping", "adjusted_noise_multiplier", "geometric_update"]


@dataclass(frozen=True)
class AdaptiveClipping:
    """The settings of adaptive clipping (names as Flower's adaptive-clipping wrappers).

    Attributes:
        target_clipped_quantile: γ in [0, 1]: the clip norm tracks the γ-quantile of the
            update norms (a share γ of the updates unclipped). Default 0.5.
        clip_norm_lr: η > 0, the step of the geometric update. Default 0.2.
        clipped_count_stddev: σ_b > 0, the noise on the count of unclipped updates; None: P/20
            (P clients per round), set by the wrapper.

    Raises:
        ValueError: a setting out of range.
    """

    target_clipped_quantile: float = 0.5
    clip_norm_lr: float = 0.2
    clipped_count_stddev: float | None = None

    def __post_init__(self):
        check_real("target_clipped_quantile", self.target_clipped_quantile, low=0.0, high=1.0)
        check_real("clip_norm_lr", self.clip_norm_lr, low=0.0, low_inclusive=False)
        if self.clipped_count_stddev is not None:
            check_real("clipped_count_stddev", self.clipped_count_stddev, low=0.0, low_inclusive=False)

    def count_stddev(self, num_clients: int) -> float:
        """σ_b: the setting, or P/20 when it is None."""
        if self.clipped_count_stddev is None:
            return num_clients / 20.0
        return float(self.clipped_count_stddev)


def adjusted_noise_multiplier(noise_multiplier: float, clipped_count_stddev: float) -> float:
    """z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2): the updates' noise multiplier that, with the count's
    noise σ_b, gives the privacy of noise multiplier z (Andrew et al. 2021, Section 3.1).

    Raises:
        ValueError: z ≤ 0, σ_b ≤ 0, or z ≥ 2σ_b (the count alone would spend the whole budget).
    """
    z = check_real("noise_multiplier", noise_multiplier, low=0.0, low_inclusive=False)
    sb = check_real("clipped_count_stddev", clipped_count_stddev, low=0.0, low_inclusive=False)
    if z >= 2.0 * sb:
        raise ValueError(
            f"clipped_count_stddev={sb:g} is invalid for noise_multiplier={z:g}: adaptive clipping needs "
            f"noise_multiplier < 2·clipped_count_stddev (the count's noise multiplier is 2σ_b); raise "
            f"clipped_count_stddev above {z / 2:g} (or the clients per round, its default being P/20)"
        )
    return 1.0 / math.sqrt(z**-2 - (2.0 * sb) ** -2)


def geometric_update(clip_norm: float, unclipped_fraction: float, target: float, lr: float) -> float:
    """C · exp(−η (b̄ − γ)): the next clip norm from the noisy share b̄ of unclipped updates."""
    return float(clip_norm) * math.exp(-float(lr) * (float(unclipped_fraction) - float(target)))
