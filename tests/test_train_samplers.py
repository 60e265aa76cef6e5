"""Batch samplers: participation patterns, batch-size laws, checkpointed state."""

import numpy as np
import pytest
from scipy import stats

from dpmf.plan import PrivatePlan
from dpmf.train.samplers import (
    BallsInBinsSampler,
    CyclicPoissonSampler,
    EpochBallsInBinsSampler,
    PoissonSampler,
    ShuffledFixedSampler,
    steps_per_epoch,
)


def make_sampler(scheme, dataset_size, batch_size, steps, *, seed=0):
    """The sampler of a DP-SGD plan of ``scheme`` (cyclic Poisson: one group)."""
    return PrivatePlan(dataset_size, batch_size, steps=steps, scheme=scheme).sampler(seed)


def run(sampler):
    return [sampler.next() for _ in range(sampler.steps)]


def test_poisson_inclusions_are_independent_bernoulli_q():
    N, B, T = 400, 20, 600
    batches = run(PoissonSampler(N, B, T, seed=1))
    counts = np.zeros(N)
    sizes = np.array([b.size for b in batches])
    for b in batches:
        counts[b] += 1
    q = B / N
    # total inclusions ~ Binomial(N·T, q): within 4 standard deviations
    assert abs(sizes.sum() - N * T * q) < 4 * np.sqrt(N * T * q * (1 - q))
    # batch sizes ~ Binomial(N, q): goodness of fit of the variance
    assert sizes.var() == pytest.approx(N * q * (1 - q), rel=0.2)
    # per-example counts ~ Binomial(T, q): a KS-type check on the mean and spread
    assert counts.std() == pytest.approx(np.sqrt(T * q * (1 - q)), rel=0.15)
    assert all(np.all(np.diff(b) > 0) for b in batches)  # sorted, no duplicates


def test_poisson_has_empty_batches_when_q_is_small():
    batches = run(PoissonSampler(1000, 1, 3000, seed=0))
    empty = sum(b.size == 0 for b in batches)
    p0 = (1 - 1 / 1000) ** 1000
    assert abs(empty - 3000 * p0) < 4 * np.sqrt(3000 * p0 * (1 - p0))


def test_cyclic_poisson_separates_participations_by_b_steps():
    N, B, b, T = 300, 10, 5, 200
    s = CyclicPoissonSampler(N, B, T, groups=b, seed=2)
    batches = run(s)
    for t, batch in enumerate(batches):
        assert np.all(s.assignment[batch] == t % b)
    assert s.sampling_rate == pytest.approx(B * b / N)
    sizes = np.array([x.size for x in batches])
    assert abs(sizes.mean() - B) < 4 * np.sqrt(B / T)
    with pytest.raises(ValueError, match="groups=40"):
        CyclicPoissonSampler(N, B, T, groups=40)


def test_balls_in_bins_fixed_bins_partition_every_epoch_and_keep_their_steps():
    N, B = 103, 10
    s = BallsInBinsSampler(N, B, 3 * steps_per_epoch(N, B), seed=3)
    b = s.bins
    assert b == 11 and s.expected_batch_size == pytest.approx(103 / 11)  # b = ⌈N/B⌉
    batches = run(s)
    for e in range(3):
        epoch = batches[e * b : (e + 1) * b]
        assert np.array_equal(np.sort(np.concatenate(epoch)), np.arange(N))  # a partition
        for k in range(b):
            assert np.array_equal(epoch[k], batches[k])  # the same bin at the same phase
    sizes = [x.size for x in batches[:b]]
    assert len(set(sizes)) > 1  # random (multinomial) sizes
    # bin of each example uniform over b bins: chi-square on a larger instance
    big = BallsInBinsSampler(20000, 200, 100, seed=4)
    counts = np.bincount(big.assignment, minlength=100)
    assert stats.chisquare(counts).pvalue > 1e-4


def test_epoch_balls_in_bins_redraws_each_epoch():
    N, B = 60, 10
    s = EpochBallsInBinsSampler(N, B, 12, seed=5)
    batches = run(s)
    for e in range(2):
        assert np.array_equal(np.sort(np.concatenate(batches[e * 6 : (e + 1) * 6])), np.arange(N))
    assert any(not np.array_equal(batches[k], batches[k + 6]) for k in range(6))


def test_shuffled_fixed_batches_are_shuffled_once_then_cycled():
    N, B = 25, 4
    s = ShuffledFixedSampler(N, B, 3 * steps_per_epoch(N, B), seed=6)
    batches = run(s)
    spe = 7  # ⌈25/4⌉
    assert [x.size for x in batches[:spe]] == [4, 4, 4, 4, 3, 3, 3]
    assert s.expected_batch_size == pytest.approx(25 / 7)
    assert not np.array_equal(s.order, np.arange(N))
    for t in range(spe, 3 * spe):
        assert np.array_equal(batches[t], batches[t - spe])  # the same fixed order each epoch
    assert np.array_equal(np.sort(np.concatenate(batches[:spe])), np.arange(N))  # a partition


@pytest.mark.parametrize(
    "scheme",
    ["poisson", "cyclic_poisson", "balls_in_bins", "epoch_balls_in_bins", "fixed_order", "single_release"],
)
def test_state_dict_resumes_the_same_sequence(scheme):
    n = 10 if scheme == "single_release" else 30  # a single release has one epoch
    ref = make_sampler(scheme, 50, 5, n, seed=7)
    full = run(ref)
    s = make_sampler(scheme, 50, 5, n, seed=7)
    for _ in range(n // 2 - 2):
        s.next()
    state = s.state_dict()
    t = make_sampler(scheme, 50, 5, n, seed=7)
    t.load_state_dict(state)
    assert all(np.array_equal(t.next(), full[k]) for k in range(n // 2 - 2, n))
    with pytest.raises(RuntimeError, match=f"{n} steps"):
        t.next()
    with pytest.raises(ValueError, match="seed"):
        make_sampler(scheme, 50, 5, n, seed=8).load_state_dict(state)


def test_bad_sampler_arguments():
    with pytest.raises(ValueError, match=r"batch_size=11 is invalid: larger than the data set"):
        make_sampler("poisson", 10, 11, 5)
    with pytest.raises(ValueError, match="scheme"):
        make_sampler("shuffle", 10, 2, 5)
    with pytest.raises(ValueError, match="steps"):
        make_sampler("poisson", 10, 2, 0)
