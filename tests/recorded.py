"""Recorded fingerprints of trained weights, compared with a tolerance.

Float32 training rounds differently with a CPU's vector width and its BLAS kernels, and a training
trajectory amplifies the difference: the final weights of one seed agree across CPUs to a few
ulps times the run's amplification, never bit for bit. A test of a recorded run therefore
compares a fingerprint of the final weights, not their bytes: the weights flattened in float64
(in the order given), their L2 norm, their sum and their projections onto ``DIRECTIONS`` fixed
pseudo-random unit directions (``numpy.random.default_rng(SEED)``, the same on every machine).

``distance(got, recorded)`` is the largest difference of a component relative to the recorded
norm; each test sets its tolerance from the spread measured between torch's vectorised kernels
and ``ATEN_CPU_CAPABILITY=default`` (its scalar ones), and shows with a perturbed run (another
seed, another σ) that the tolerance still tells such a run apart. Bit identity is compared only
between two runs in the same process (``torch.equal``).
"""

import numpy as np

SEED = 20_240_611
DIRECTIONS = 4


def flatten(weights) -> np.ndarray:
    """Every tensor or array of a mapping (a ``state_dict``, a dict of arrays), in its order,
    as one float64 vector."""
    parts = []
    for v in weights.values():
        if hasattr(v, "detach"):  # a torch tensor
            v = v.detach().cpu().double().numpy()
        parts.append(np.asarray(v, dtype=np.float64).ravel())
    return np.concatenate(parts)


def fingerprint(weights) -> list[float]:
    """[‖w‖₂, Σw, ⟨u_1, w⟩, …, ⟨u_4, w⟩] of the flattened weights w (u_i fixed unit vectors)."""
    w = flatten(weights)
    u = np.random.default_rng(SEED).standard_normal((DIRECTIONS, w.size))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    return [float(np.linalg.norm(w)), float(w.sum()), *(float(x) for x in u @ w)]


def distance(got, recorded) -> float:
    """max_i |got_i − recorded_i| / ‖recorded weights‖₂ (the fingerprint's first component)."""
    got, recorded = np.asarray(got, dtype=np.float64), np.asarray(recorded, dtype=np.float64)
    if got.shape != recorded.shape:
        raise ValueError(f"fingerprints of {got.shape} and {recorded.shape} components")
    return float(np.max(np.abs(got - recorded)) / abs(recorded[0]))


def assert_recorded(got, recorded, tolerance: float) -> None:
    """The fingerprint ``got`` is within ``tolerance`` (relative to the norm) of ``recorded``."""
    d = distance(got, recorded)
    assert d <= tolerance, (
        f"fingerprint {got} is {d:.3g} (relative to the norm) from the recorded {recorded}; "
        f"tolerance {tolerance:g}"
    )
