"""Whether the engine can serve: each node asked on its own (GET /health, GET /v1/cluster).

A pipeline of nodes is asked node by node, in parallel, so a node that does not answer neither hides
the others' state nor holds them up beyond one timeout. A node is ready when it answers, holds its
shard and reports no error; while prompt chunks are in flight, one that answers late is busy in a
step (its loop runs them), not unready. A local engine is ready while its MLX thread runs.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..engine.engine import Engine

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 1.0  # GET /health: a load balancer polls it, so a dead node must not hold it long


def timestamp(t: float) -> str:
    """A wall-clock time as ISO 8601 in UTC, the form error reports carry."""
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")


@dataclass
class NodeState:
    """One node's answer to Health, or why there is none."""

    address: str
    reply: Any = None  # the node's HealthReply, None when it did not answer
    error: str | None = None  # why the node is not ready, None when it is
    error_at: float | None = None  # when that error was first seen (wall clock)
    checked_at: float = field(default_factory=time.time)

    @property
    def ready(self) -> bool:
        return self.error is None

    def as_dict(self) -> dict[str, Any]:
        """The node as /v1/cluster reports it: the reply's fields, healthy, and the error with its time."""
        reply = self.reply
        fields = {f.name: _plain(getattr(reply, f.name)) for f in reply.DESCRIPTOR.fields} if reply else {}
        return {"address": self.address, "healthy": self.ready, "reachable": self.reply is not None, **fields,
                "error": self.error, "error_at": timestamp(self.error_at) if self.error_at else None,
                "checked_at": timestamp(self.checked_at)}


def _plain(value: Any) -> Any:
    """A reply field as JSON takes it (a repeated field is a list)."""
    return value if isinstance(value, (str, bytes, int, float, bool)) else list(value)


def _problem(reply: Any) -> str | None:
    if not reply.loaded:
        return "no shard loaded"
    if reply.last_error:
        return f"reports an error: {reply.last_error}"
    return None


class NodeWatch:
    """Asks each node of a RemotePipeline for its Health, and remembers since when each error stands."""

    def __init__(self, pipeline: Any):
        self.pipeline = pipeline
        self._since: dict[tuple[str, str], float] = {}  # (address, error) -> first seen
        self._lock = threading.Lock()

    @staticmethod
    def watches(engine: Any) -> bool:
        """Whether `engine` runs over nodes (its pipeline holds gRPC links to them)."""
        links = getattr(getattr(engine, "pipeline", None), "nodes", None)
        return bool(links) and all(hasattr(n, "stub") and hasattr(n, "address") for n in links)

    def check(self, timeout: float, probe_next: bool = False) -> list[NodeState]:
        """Every node's state, in pipeline order; blocks for at most about `timeout` (call off the event loop)."""
        links = list(self.pipeline.nodes)
        busy = bool(getattr(self.pipeline, "prefilling", False))
        with ThreadPoolExecutor(len(links), thread_name_prefix="node-health") as pool:
            states = list(pool.map(lambda link: self._ask(link, timeout, probe_next, busy), links))
        with self._lock:
            current = {(s.address, s.error) for s in states if s.error}
            self._since = {k: v for k, v in self._since.items() if k in current}
            for s in states:
                if s.error and (s.address, s.error) not in self._since:
                    log.warning("node %s is not ready: %s", s.address, s.error)  # once, not at every poll
                if s.error:
                    s.error_at = self._since.setdefault((s.address, s.error), s.checked_at)
        return states

    @staticmethod
    def _ask(link: Any, timeout: float, probe_next: bool, prefilling: bool = False) -> NodeState:
        """A node that answers late while prompt chunks are in flight is busy in a step, not unready: the
        lease renewals, which tolerate that for longer (pipeline/renewals.py), say when it is lost."""
        import grpc

        from ...node.wire import describe_rpc_error
        from ...proto import mtpipe_pb2 as pb

        try:
            reply = link.stub.Health(pb.HealthRequest(probe_next=probe_next), timeout=timeout)
        except Exception as e:  # noqa: BLE001 - grpc.RpcError, or a closed channel: the node is down either way
            log.debug("node %s does not answer Health: %s", link.address, e)
            if prefilling and isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return NodeState(link.address)  # (no reply, no error: busy in a step)
            return NodeState(link.address, error=f"does not answer: {describe_rpc_error(e)}")
        return NodeState(link.address, reply=reply, error=_problem(reply))


class Readiness:
    """GET /health: the engine's state, checked on a worker thread."""

    def __init__(self, engine: Engine, timeout: float = HEALTH_TIMEOUT_S):
        self.engine = engine
        self.timeout = timeout
        self.nodes = NodeWatch(engine.pipeline) if NodeWatch.watches(engine) else None

    def check(self) -> tuple[bool, dict[str, Any]]:
        """(ready, details): the nodes that are not ready and why, or the local engine's thread."""
        asks = getattr(self.engine, "check_ready", None)  # an engine in another process answers for itself
        if asks is not None:
            return asks(self.timeout)
        if self.nodes is not None:
            states = self.nodes.check(self.timeout)
            down = [{"address": s.address, "reason": s.error, "since": timestamp(s.error_at or s.checked_at)}
                    for s in states if not s.ready]
            reformer = getattr(self.engine.pipeline, "reformer", None)
            details: dict[str, Any] = {}
            if reformer is not None and reformer.down is not None and not reformer.given_up:
                tried = reformer.attempt_error
                details["reforming"] = {"after": str(reformer.down), "since": timestamp(reformer.down_at),
                                        "last_attempt": None if tried is None else str(tried)}
            if not down and reformer is not None and (lost := reformer.down) is not None:
                # every node answers, but the pipeline over them is not formed again yet
                why = str(lost) if reformer.given_up else f"being formed again after: {lost}"
                down = [{"address": getattr(lost, "node", "pipeline"), "reason": why,
                         "since": timestamp(reformer.down_at)}]
                down += [{"address": getattr(e, "node", "pipeline"), "reason": str(e),
                          "since": timestamp(reformer.down_at)} for e in (reformer.also if reformer.given_up else [])]
            return not down, {"nodes": len(states), "unready": down, **details}
        thread = getattr(self.engine, "thread", None)  # a BatchEngine runs every stage on one MLX thread
        if thread is not None and not getattr(thread, "alive", True):
            return False, {"unready": [{"address": "local", "reason": "the engine's thread has stopped",
                                        "since": timestamp(time.time())}]}
        return True, {}
