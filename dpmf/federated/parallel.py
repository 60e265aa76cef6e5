"""Record mode's participants stepped in parallel: forked worker processes, one round at a time.

The participants of a ``record`` run are independent within a round: each trains its own
private run (``local.PrivateLocalRun``: sampler, noise stream, privatizer, optimizer) from the
same global weights. ``ForkedRuns`` forks W − 1 worker processes once the runs are built;
worker w owns the participants j whose rank k (in ascending j) has k mod W = w, and this
process the rest (k mod W = 0: the first participant always stays here); ``ServingForkedRuns``,
record mode's, hands one of this process's share to the workers, since this process also serves
the rounds meanwhile. Each round, this process sends every worker the jobs of its participants
(one message), trains its own, then receives each worker's replies (one message): the sends
never wait on a reply, so no pipe can fill up in both directions at once.

Every participant's round is the very same computation in whichever process runs it (one torch
thread, the same state, the same operations), and the server receives the replies in node
order, so a run is bit-for-bit the sequential one. The runs' keys are never pickled: ``fork``
gives each worker its participants' state in memory, and a worker's copy is the only one that
advances (this process never steps a participant a worker owns). Only the round's global
weights, the job's step count and proximal μ go to a worker, only the new weights come back; a
failure comes back as its exception's type and message (which never hold a key).
"""

from __future__ import annotations

import multiprocessing

__all__ = ["ForkedRuns", "ServingForkedRuns", "parallel_workers"]


def parallel_workers(participants: int) -> int:
    """The processes (this one included) that step ``participants`` record runs: the usable CPU
    cores, at most one per participant; 1 (no worker) where ``fork`` is unavailable or torch
    runs more than one intra-op thread (forked processes would share the cores and an OpenMP
    pool started before the fork)."""
    import torch

    from dpmf.federated.prefetch import usable_cores

    if "fork" not in multiprocessing.get_all_start_methods() or torch.get_num_threads() != 1:
        return 1
    return max(1, min(int(participants), usable_cores()))


def _serve(conn, runs: dict) -> None:
    """A worker's loop: each message is a round's jobs of its participants, answered by one
    message with their new weights (or the first failure); ``None``, or the other end closed,
    ends it. Ctrl-C is the main process's to handle (it ends the workers)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            jobs = conn.recv()
        except EOFError:  # the main process is gone
            return
        if jobs is None:
            return
        out = {}
        try:
            for j, weights, steps, mu in jobs:
                out[j], _ = runs[j].train_round(weights, steps, mu)
        except Exception as err:  # noqa: BLE001 - sent back and raised there
            conn.send(("error", j, f"{type(err).__name__}: {err}"))
            continue
        conn.send(("ok", out))


def _owners(order: list, workers: int, fewer_here: int) -> dict:
    """Participant → its process (0: this one), for ``ForkedRuns``."""
    share = -(-len(order) // workers)  # the ranks k with k mod W = 0
    here = max(1, share - fewer_here)
    owner, turn = {}, 0
    for k, j in enumerate(order):
        if k % workers == 0 and k // workers < here:
            owner[j] = 0
        else:
            owner[j] = 1 + turn % (workers - 1)
            turn += 1
    return owner


class ForkedRuns:
    """Worker processes stepping some of the participants' private runs (see the module).

    Args:
        runs: participant index j → its ``PrivateLocalRun``, all built, none stepped by another
            process.
        workers: W ≥ 2, the processes stepping them (this one included).

    Class attribute:
        fewer_here: this process steps that many participants fewer than its share (the first
            one stays here). Its participants are then the first ranks k with k mod W = 0;
            every other rank goes to the workers in turn (0: exactly the k mod W rule).

    Raises:
        ValueError: fewer than 2 processes.
    """

    fewer_here: int = 0

    def __init__(self, runs: dict, workers: int):
        if int(workers) < 2:
            raise ValueError(f"workers={workers!r} is invalid: must be >= 2 (this process and a worker)")
        order = sorted(runs)
        self.owner = _owners(order, int(workers), int(self.fewer_here))
        self._conns: dict[int, object] = {}
        self._procs: dict[int, multiprocessing.Process] = {}
        self._waiting: dict[int, int] = {}  # participant → the worker whose reply holds it
        self._results: dict[int, dict] = {}
        ctx = multiprocessing.get_context("fork")
        for w in range(1, int(workers)):
            mine, theirs = ctx.Pipe()
            own = {j: runs[j] for j in order if self.owner[j] == w}
            proc = ctx.Process(target=_serve, args=(theirs, own), daemon=True, name=f"dpmf-record-{w}")
            proc.start()
            theirs.close()
            self._conns[w], self._procs[w] = mine, proc

    def is_remote(self, j: int) -> bool:
        """Whether a worker steps participant j."""
        return self.owner.get(j, 0) != 0

    def submit(self, jobs) -> None:
        """Send each worker its participants' jobs ``(j, weights, steps, proximal_mu)`` of a round.

        Raises:
            RuntimeError: a participant with a job not yet answered.
        """
        by_worker: dict[int, list] = {}
        for j, weights, steps, mu in jobs:
            w = self.owner.get(j, 0)
            if w == 0:
                continue
            if j in self._waiting or j in self._results:
                raise RuntimeError(f"participant {j} was given a round before its last one was answered")
            by_worker.setdefault(w, []).append((j, weights, int(steps), float(mu)))
        for w, batch in by_worker.items():
            self._conns[w].send(batch)
            for j, *_ in batch:
                self._waiting[j] = w

    def result(self, j: int) -> dict:
        """Participant j's new weights of the round submitted (waits for its worker).

        Raises:
            RuntimeError: no job was submitted for j, its run failed in the worker (the type and
                message of the failure), or the worker is gone.
        """
        if j not in self._results:
            w = self._waiting.get(j)
            if w is None:
                raise RuntimeError(
                    f"participant {j} is stepped by a worker process and has no submitted round"
                )
            try:
                reply = self._conns[w].recv()
            except EOFError:
                raise RuntimeError(
                    f"the worker process stepping participant {j} ended unexpectedly"
                ) from None
            done = [i for i, v in self._waiting.items() if v == w]
            for i in done:
                del self._waiting[i]
            if reply[0] == "error":
                raise RuntimeError(
                    f"participant {reply[1]}'s private round failed in a worker process: {reply[2]}"
                )
            self._results.update(reply[1])
        return self._results.pop(j)

    def close(self) -> None:
        """End the workers (their participants' state is dropped with them)."""
        for conn in self._conns.values():
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for w, proc in self._procs.items():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join()
            self._conns[w].close()
        self._conns.clear()
        self._procs.clear()


class ServingForkedRuns(ForkedRuns):
    """``ForkedRuns`` for a process that also serves the rounds (record mode's local grid):
    one participant fewer here, so that the workers do not wait for the next round while this
    process aggregates and evaluates (the same results: only who steps whom changes)."""

    fewer_here = 1
