"""A Flower ``Grid`` that delivers each message to a ClientApp in the same process.

Flower's ServerApp talks to its ClientApps only through a ``Grid`` (``flwr.serverapp.Grid``:
``push_messages``, ``pull_messages``, ``send_and_receive``). ``LocalGrid`` implements that
interface by calling the ClientApp object itself (``client_app(message, context)``) for every
message, one after another, in the order of the destination node ids: the real ServerApp,
strategies and ClientApps run unchanged, without Ray, a SuperLink or threads, and a run is
deterministic given its seeds. Each node keeps one ``Context`` for the whole run, with the
``partition-id`` / ``num-partitions`` node config that Flower's simulation engine also sets.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

__all__ = ["LocalGrid", "server_identity"]


@contextlib.contextmanager
def server_identity(run_id: int = 1) -> Iterator[None]:
    """Set Flower's process-wide task identity (run id, the SuperLink's node id, task id) that
    a ``Message`` built by a strategy reads, as Flower's runtimes do for a ServerApp; restore
    the previous identity afterwards."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, SUPERLINK_NODE_ID, 0
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


_FIRST_NODE_ID = 1001


class LocalGrid(Grid):
    """In-process delivery of messages to ``num_nodes`` virtual nodes running ``client_app``.

    Node i (0-based) has node id 1001 + i and node config
    ``{"partition-id": i, "num-partitions": num_nodes}``.

    Args:
        client_app: a ``flwr.clientapp.ClientApp``.
        num_nodes: number of nodes ≥ 1.
        run_config: the run config every Context carries.
        prepare: called with the ``(message, context)`` pairs of each push before any of them is
            delivered (e.g. to start the nodes' work elsewhere); None: nothing.

    Raises:
        TypeError / ValueError: not a ClientApp, or no node.
    """

    def __init__(self, client_app: ClientApp, num_nodes: int, run_config: dict | None = None, prepare=None):
        if not isinstance(client_app, ClientApp):
            raise TypeError(f"client_app={client_app!r} is invalid: must be a flwr.clientapp.ClientApp")
        if int(num_nodes) < 1:
            raise ValueError(f"num_nodes={num_nodes!r} is invalid: must be >= 1")
        self.client_app = client_app
        self._run = Run.create_empty(run_id=1)
        cfg = dict(run_config or {})
        self._contexts = {
            _FIRST_NODE_ID + i: Context(
                run_id=1,
                node_id=_FIRST_NODE_ID + i,
                node_config={"partition-id": i, "num-partitions": int(num_nodes)},
                state=RecordDict(),
                run_config=cfg,
            )
            for i in range(int(num_nodes))
        }
        self._replies: dict[str, Message] = {}
        self._count = 0
        self.prepare = prepare

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Deliver each message now (ascending node id) and keep the reply for ``pull_messages``.

        Raises:
            ValueError: a message for an unknown node.
        """
        ids = []
        messages = sorted(messages, key=lambda m: m.metadata.dst_node_id)
        for msg in messages:
            node = msg.metadata.dst_node_id
            if node not in self._contexts:
                raise ValueError(f"message for node {node} is invalid: the grid has {sorted(self._contexts)}")
        if self.prepare is not None:
            self.prepare([(msg, self._contexts[msg.metadata.dst_node_id]) for msg in messages])
        for msg in messages:
            node = msg.metadata.dst_node_id
            self._count += 1
            msg.metadata.__dict__["_message_id"] = f"local-{self._count}"
            self._replies[msg.metadata.message_id] = self.client_app(msg, self._contexts[node])
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))
