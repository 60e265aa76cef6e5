"""Schedules and workload matrices against their defining formulas, evaluated independently."""

import math

import numpy as np
import pytest

from dpmf.workloads import (
    SCHEDULES,
    Schedule,
    from_schedule,
    lr_scheduled,
    momentum,
    momentum_coefficients,
    prefix_sum,
    schedule,
    toeplitz_surrogate,
)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("n", [2, 3, 17, 1000])
def test_endpoints(name, n):
    chi = schedule(name, n, beta=0.1)
    assert chi.shape == (n,)
    assert chi[0] == 1.0
    assert chi[-1] == (1.0 if name == "constant" else 0.1)
    assert np.all(chi > 0) and np.all(np.diff(chi) <= 1e-15)  # all decays are non-increasing


def test_values_at_hand_computed_points():
    # n = 5, β = 0.2: τ = 0, 1/4, 1/2, 3/4, 1
    tau = np.array([0, 0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(schedule("exponential", 5, 0.2), 0.2**tau, rtol=1e-14)
    np.testing.assert_allclose(schedule("linear", 5, 0.2), [1, 0.8, 0.6, 0.4, 0.2], rtol=1e-14)
    cos = [1.0, 0.2 + 0.8 * (1 + math.sqrt(0.5)) / 2, 0.6, 0.2 + 0.8 * (1 - math.sqrt(0.5)) / 2, 0.2]
    np.testing.assert_allclose(schedule("cosine", 5, 0.2), cos, rtol=1e-14)
    np.testing.assert_allclose(
        schedule("polynomial", 5, 0.2), [1, 0.2 + 0.8 * 0.5625, 0.4, 0.2 + 0.8 * 0.0625, 0.2], rtol=1e-14
    )
    np.testing.assert_allclose(
        schedule("polynomial", 5, 0.2, gamma=1.0), schedule("linear", 5, 0.2), rtol=1e-14
    )
    # inverse power, γ = 1, n = 3: (1/t − 1/3)/(1 − 1/3) = 1, 1/4, 0
    np.testing.assert_allclose(schedule("inverse_power", 3, 0.2, gamma=1.0), [1, 0.2 + 0.8 * 0.25, 0.2])


def test_exponential_is_geometric():
    n, beta = 64, 0.1
    alpha = beta ** (1 / (n - 1))
    np.testing.assert_allclose(schedule("exponential", n, beta), alpha ** np.arange(n), rtol=1e-12)


def test_edge_cases():
    for name in SCHEDULES:
        assert schedule(name, 1, 0.5).tolist() == [1.0]
        np.testing.assert_array_equal(schedule(name, 10, 1.0), np.ones(10))
        chi = schedule(name, 50, 1e-6)
        assert chi[-1] == (1.0 if name == "constant" else 1e-6)
        assert np.all(np.isfinite(chi)) and np.all(chi > 0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="expo"), "schedule"),
        (dict(name="linear", beta=0.0), "beta"),
        (dict(name="linear", beta=1.5), "beta"),
        (dict(name="linear", beta=float("nan")), "beta"),
        (dict(name="polynomial", beta=0.5, gamma=0.0), "gamma"),
        (dict(name="inverse_power", beta=0.5, gamma=float("inf")), "gamma"),
    ],
)
def test_bad_schedule(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Schedule(**kwargs)


@pytest.mark.parametrize("n", [0, -3, 2.5])
def test_bad_n(n):
    with pytest.raises((ValueError, TypeError), match="n="):
        schedule("linear", n, 0.5)


def test_workload_matrices():
    n = 7
    chi = schedule("cosine", n, 0.3)
    ones = np.tril(np.ones((n, n)))
    np.testing.assert_array_equal(prefix_sum(n).dense(), ones)
    np.testing.assert_allclose(lr_scheduled(chi).dense(), ones @ np.diag(chi))
    T = np.array([[chi[i - j] if i >= j else 0.0 for j in range(n)] for i in range(n)])
    np.testing.assert_allclose(toeplitz_surrogate(chi).dense(), T)
    assert prefix_sum(n).is_toeplitz and toeplitz_surrogate(chi).is_toeplitz
    assert not lr_scheduled(chi).is_toeplitz
    assert from_schedule(Schedule("constant"), n).name == "prefix_sum"
    np.testing.assert_allclose(
        from_schedule(Schedule("linear", 0.5), n).dense(), ones @ np.diag(schedule("linear", n, 0.5))
    )


@pytest.mark.parametrize("mu, alpha", [(0.0, 1.0), (0.9, 1.0), (0.9, 0.99), (0.5, 0.5), (0.3, 0.7)])
def test_momentum_workload_matches_simulated_sgd(mu, alpha):
    """Heavy-ball SGD with decay: m_t = μ m_{t−1} + g_t, θ_t = α θ_{t−1} + m_t (θ_0 = 0, unit lr).
    θ is linear in g: column s of A is θ after a unit gradient at step s."""
    n = 12
    A = np.zeros((n, n))
    for s in range(n):
        m = th = 0.0
        for t in range(n):
            g = 1.0 if t == s else 0.0
            m = mu * m + g
            th = alpha * th + m
            A[t, s] = th
    np.testing.assert_allclose(momentum(n, mu, alpha).dense(), A, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(momentum_coefficients(n, mu, alpha), A[:, 0], rtol=1e-13)


def test_momentum_bad_input():
    with pytest.raises(ValueError, match="momentum"):
        momentum_coefficients(5, momentum=1.0)
    with pytest.raises(ValueError, match="weight_decay"):
        momentum_coefficients(5, weight_decay=0.0)
    with pytest.raises(ValueError, match="chi"):
        lr_scheduled([1.0, -0.5])
    with pytest.raises(ValueError, match="chi"):
        lr_scheduled([1.0, float("nan")])
