"""An in-process Flower Grid: runs a ClientApp synchronously in this process (no Ray, no SuperLink).

For tests, benchmarks and debugging a strategy or the ServerApp logic step by step. It copies each
message's content like a real transport would. Not a deployment path.
"""

from __future__ import annotations

import copy
import logging
import time
import uuid

from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

log = logging.getLogger("fedpower")


from fedpower_app.privacy.silo_policy import simulation_engine  # noqa: E402


class InProcessGrid(Grid):
    """Delivers each message to ``client_app`` (a ClientApp or a plain callable) in this process.

    ``handlers`` may override the reply of given node ids (to simulate faulty clients).
    ``node_ids`` (default 100, 101, ...) gives partition i to ``node_ids[i]``; real runtimes draw
    node ids at random, so tests pass other ids to check nothing depends on them. ``node_config``
    adds keys to every node's config (e.g. a silo's own ``dp-max-epsilon``), ``node_configs[i]`` to
    partition i's only (e.g. its own signing key). ``record_sent`` keeps
    every sent message in ``sent`` (for tests); a long run turns it off, since each message holds a
    copy of the global adapter. A batch that takes longer than ``progress_every`` seconds logs its
    progress (a round of 250 clients takes minutes on a CPU).
    """

    def __init__(self, client_app, num_nodes: int, run_config: dict | None = None, handlers: dict | None = None,
                 node_ids: list[int] | None = None, node_config: dict | None = None, record_sent: bool = True,
                 progress_every: float = 60.0, node_configs: list[dict] | None = None):
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
        self._app = client_app
        self._run = Run.create_empty(run_id=1)
        self.node_ids = list(node_ids) if node_ids is not None else [100 + i for i in range(num_nodes)]
        if len(self.node_ids) != num_nodes or len(set(self.node_ids)) != num_nodes:
            raise ValueError(f"need {num_nodes} distinct node ids, got {self.node_ids}")
        self._contexts = {
            nid: Context(run_id=1, node_id=nid,
                         node_config={"partition-id": i, "num-partitions": num_nodes, **(node_config or {}),
                                      **((node_configs or [{}] * num_nodes)[i])},
                         state=RecordDict(), run_config=dict(run_config or {}))
            for i, nid in enumerate(self.node_ids)
        }
        self.handlers = dict(handlers or {})
        self._replies: dict[str, Message] = {}
        self.sent: list[Message] = []
        self.record_sent = record_sent
        self.progress_every = progress_every

    def set_run(self, run_id):  # pragma: no cover - Grid API
        self._run = Run.create_empty(run_id=run_id)

    @property
    def run(self):
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self):
        return list(self.node_ids)

    def push_messages(self, messages):
        ids = []
        messages = list(messages)
        t0 = last = time.monotonic()
        for k, msg in enumerate(messages):
            now = time.monotonic()
            if now - last >= self.progress_every:
                last = now
                log.info("in-process grid: %d/%d %s messages answered (%.0f s)", k, len(messages),
                         msg.metadata.message_type, now - t0)
            mid = uuid.uuid4().hex
            msg.metadata.__dict__["_message_id"] = mid
            if self.record_sent:
                self.sent.append(msg)
            dst = msg.metadata.dst_node_id
            # Real runtimes serialise; copy so a client cannot mutate what others receive.
            delivered = Message(copy.deepcopy(msg.content), dst, msg.metadata.message_type)
            delivered.metadata.__dict__["_message_id"] = mid
            try:
                handler = self.handlers.get(dst, self._app)
                with simulation_engine():  # its partitions are the engine's, not an operator's node config
                    reply = handler(delivered, self._contexts[dst])
            except Exception as exc:  # the runtime turns a raising ClientApp into an error reply
                reply = Message(Error(code=2, reason=repr(exc)), reply_to=delivered)
            if reply is not None:
                reply.metadata.__dict__["_src_node_id"] = dst
            self._replies[mid] = reply
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids):
        return [r for i in message_ids if (r := self._replies.pop(i, None)) is not None]

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(messages))
