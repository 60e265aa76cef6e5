"""Client sampling per round in ``client`` mode: which clients train, the noise, the accounting.

``all`` (default): every participant every round (``local.ClientLevelNoise``; unchanged).
``poisson``: each of the P participants joins round r independently with probability
q = K/P (K = ``clients_per_round``, the expected number); ``fixed``: dpmf's ``fixed_order``
scheme over clients — the participants in a fixed order cut into ⌈P/K⌉ groups of about K,
group r mod ⌈P/K⌉ trains in round r (cyclic participation: each client every ⌈P/K⌉ rounds).

Round r releases w + (1/K̄)·(Σ_{k sampled} clip(w_k − w) + σ_acc·ζ·sens(C)·(C⁻¹Z)_r), with K̄ the
scheme's expected batch size (a public number, never the realised count). The accounting is
the plan's (``PrivatePlan`` with the scheme, N = P clients, B = K, n = R rounds):
with identity noise and Poisson sampling it is dp-accounting's
PoissonSampledDpEvent(q, GaussianDpEvent(σ_c)) self-composed R times (amplification by
sampling; McMahan et al., "Learning Differentially Private Recurrent Language Models", ICLR
2018). σ_c keeps Flower's meaning for identity noise, N(0, σ_c²ζ²) on the sum per round:
σ_acc = σ_c / sens(I) (1 under Poisson, √k under ``fixed`` with k participations). Noise
correlated across rounds is accepted when the scheme can account the strategy
(``Scheme.check_strategy``: e.g. banded strategies under cyclic participation); otherwise the
plan refuses it with its reason.

A Poisson round in which no client is sampled still releases w + noise/K̄ (the strategy's
aggregation, which needs a reply, is skipped for that round).
"""

from __future__ import annotations

import numpy as np

from dpmf.plan.schemes import Poisson

__all__ = ["CLIENT_SAMPLINGS", "SampledClientNoise"]

CLIENT_SAMPLINGS = ("all", Poisson.name, "fixed")  # "poisson" is the scheme's name


class SampledClientNoise:
    """The participants, the noise and the privacy of a client-sampled ``client``-mode run.

    Args:
        sampling: ``poisson`` or ``fixed``.
        num_clients: P; per_round: K in [1, P] (expected for Poisson).
        rounds: R; noise_multiplier: σ_c > 0; clip_norm: ζ > 0; delta: δ.
        factorization: ``identity`` or a dpmf strategy spec.
        accountant: None (the scheme's default), ``pld``, ``rdp``, ``prv``.
        dim: model coordinates; seed: the noise and sampler key (secret; never shown).

    Raises:
        ValueError: a bad K or a strategy the scheme cannot account (with the reason).
    """

    def __init__(self, sampling, num_clients, per_round, rounds, *, noise_multiplier, clip_norm, delta,
                 factorization="identity", accountant=None, dim, seed):  # fmt: skip
        from dpmf import seeds
        from dpmf._validation import check_choice, check_int
        from dpmf.federated.local import _client_noise, client_level_plan
        from dpmf.plan.schemes import FixedOrder

        check_choice("client_sampling", sampling, CLIENT_SAMPLINGS[1:])
        P = check_int("num_clients", num_clients, minimum=1)
        K = check_int("clients_per_round", per_round, minimum=1, maximum=P)
        R = check_int("rounds", rounds, minimum=1)
        scheme = Poisson.name if sampling == Poisson.name else FixedOrder.name
        # the plan of a client-level "dataset": P clients, K per round, R rounds
        self.plan = client_level_plan(P, K, R, scheme, factorization, noise_multiplier, float(clip_norm))
        self.privacy = self.plan.account(delta=delta, accountant=accountant, progress=False)
        self.sampler = self.plan.sampler(seeds.child_key(seed, "fl-client-sampler"))
        self.noise = _client_noise(self.plan, dim, seeds.child_key(seed, "fl-client-noise"))
        self.std_on_sum = self.plan.noise_std()
        self.divisor = float(self.plan.expected_batch_size)
        self.sampling, self.per_round = sampling, K

    def participants(self) -> np.ndarray:
        """The indices (0..P−1) of the clients that train in the next round (never printed)."""
        return np.sort(np.asarray(self.sampler.next(), dtype=np.int64))

    def next(self) -> np.ndarray:
        """The noise on the round's sum of clipped updates, shape (dim,), float64."""
        return self.noise.next().numpy() * self.std_on_sum
