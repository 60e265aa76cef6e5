"""Settings of a federated run that contradict each other or the data: refusals and warnings.

Two kinds of checks, both before any training:

* ``flag_conflicts`` — options given for a setting that ignores them (``alpha`` without the
  Dirichlet partition, ``shards`` without the shard partition, ``fedopt_eta`` without
  FedAdam/FedYogi, ``proximal_mu`` without FedProx): a ValueError naming the option, the
  setting that ignores it and the fix. It looks only at the options the user gave (the CLI
  passes the flags it received), since a default cannot be told from a given value.
* ``check_data`` — the loaded partition against the run: the privacy mode's own check
  (``PrivacyMode.check_data``; ``record`` mode with a local batch larger than a client's records
  is refused (Poisson sampling at rate B/N_k > 1 does not
  exist; silently clamping it to 1 would change the accounted run)); clients with fewer than
  ``TINY_CLIENT`` records and a one-client federation are warned about (returned as notices).
"""

from __future__ import annotations

__all__ = ["TINY_CLIENT", "check_data", "flag_conflicts"]

TINY_CLIENT = 2  # fewer records than this per client: warned


def flag_conflicts(given, *, partition: str, strategy: str) -> None:
    """Refuse options that the chosen partition or strategy ignores.

    Args:
        given: names of the ``FLConfig`` fields the user set explicitly (e.g. the CLI's flags).
        partition: the partition scheme; strategy: the strategy's name.

    Raises:
        ValueError: one line naming the option, the setting that ignores it and the fix.
    """
    given = set(given)
    if "alpha" in given and partition != "dirichlet":
        raise ValueError(
            f"alpha is invalid with partition={partition!r}: only the Dirichlet partition uses it; "
            "add --partition dirichlet or drop --alpha"
        )
    if "shards" in given and partition != "shards":
        raise ValueError(
            f"shards is invalid with partition={partition!r}: only the shard partition uses it; "
            "add --partition shards or drop --shards"
        )
    if "fedopt_eta" in given and strategy not in ("fedadam", "fedyogi"):
        raise ValueError(
            f"fedopt_eta is invalid with strategy={strategy!r}: only fedadam and fedyogi have a server "
            "learning rate; choose one of them or drop --fedopt-eta"
        )
    if "proximal_mu" in given and strategy != "fedprox":
        raise ValueError(
            f"proximal_mu is invalid with strategy={strategy!r}: only fedprox has a proximal term; "
            "choose --strategy fedprox or drop --proximal-mu"
        )


def check_data(config, sizes, participants) -> list[str]:
    """Check the partition against the run; return the warnings (notices) to log.

    Args:
        config: the ``FLConfig``.
        sizes: N_k of every client (all K clients, in client order).
        participants: the indices of the clients that train.

    Raises:
        ValueError: the mode's refusal (``record`` mode with ``local_batch_size`` larger than a
            participant's N_k).
    """
    part = [int(sizes[i]) for i in participants]
    smallest = min(part)
    mode = config.mode  # ``dpmf.federated.modes``: its own refusals (record: B ≤ N_k)
    mode.check_data(config, smallest)
    notes = []
    if smallest < TINY_CLIENT:
        notes.append(
            f"{sum(n < TINY_CLIENT for n in part)} of {len(part)} clients hold a single record "
            f"({sum(sizes)} records over {len(sizes)} clients): use fewer clients"
        )
    if len(participants) == 1:
        notes.append(
            "only one client trains (compliant-only leaves one): the federation is a single client, "
            "its update is the global model" + mode.one_client_note
        )
    return notes
