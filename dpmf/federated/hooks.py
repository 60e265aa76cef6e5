"""Where a white-box audit enters a federated run: ``run_federated(config, audit=hooks)``.

Each method is called at one documented point of the run; every default leaves the run as it
is. An audit (``dpmf.audit.federated``) appends canary records to a private run's data before
that run is built (its plan, sampler and accounting then cover them), gives the run's
privatizer a ``StepStage`` once it is built, adds canary client updates to the client-level
noise's sum, and reads each round's privatized replies. Nothing here removes noise: a hook can
only add to what is released, or read it.
"""

from __future__ import annotations

__all__ = ["AuditHooks"]


class AuditHooks:
    """The audit's entry points into one federated run (subclass and override what it needs)."""

    def private_records(self, role: str, j: int, x, y):
        """(x, y) of the private run about to be built: participant j's records
        (``role="record"``) or the server's aggregator dataset (``role="aggregator"``, j = 0);
        default: as given."""
        return x, y

    def private_run(self, role: str, j: int, run) -> None:
        """The private run just built on ``private_records``' data (``PrivateLocalRun`` for
        ``record``, ``AggregatorDPSGD`` for ``aggregator``)."""

    def client_noise(self, noise) -> None:
        """The client-level noise just built (``ClientLevelNoise``; ``client`` mode)."""

    def client_updates(self, server_round: int):
        """Updates added to round r's sum of clipped client updates before the strategy's mean
        (canary clients), shape (dim,), float64; default None (none)."""
        return None

    def client_round(self, server_round: int, arrays, replies) -> None:
        """Round r of ``client`` mode: the global ``arrays`` sent and the privatized ``replies``
        (weight 1 each) the strategy is about to aggregate."""
