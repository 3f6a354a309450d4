"""The pipeline over gRPC: the coordinator's side of a chain of `mtpipe node` daemons.

A step is one trip around a ring: a Frame goes out on one long-lived stream to the first node, the
nodes pass hidden states along among themselves, and the last node's StepResult comes back on a
Subscribe stream. The commit of a round rides on the next round's frame. Decode rounds go further:
the engine's steps carry how many tokens it still wants, so the last node starts the next round
itself, straight to the first node, and says so in its result (`continued`). The engine's request
for that step then only waits for its result: a decode round is one trip around the nodes, with the
coordinator off the path. A release travels the coordinator's stream behind the sequence's last step;
a round the last node started meanwhile is dropped by the first node.

Failures: every node also holds a Subscribe stream to this client, so a node that refuses a step
(INVALID_ARGUMENT) answers at once, a node process that dies breaks its stream at once, a node
that stops answering (stopped, unplugged) misses HTTP/2 keepalive pings and has its connection cut
within ~2.5 s (see node/wire.py), and one whose loop hangs while its connections stay up stops
answering lease renewals (renewals.py). Either way the step fails naming the node.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from ...models.shard import ShardSpec
from ...node.coordinators import Claim
from ...node.protocol import GroupEnd, StageError, StageUnavailable, StepKind, StepOutput, StepRequest
from ...node.wire import describe_rpc_error, end_from_pb, request_to_frame, result_to_output
from ...proto import mtpipe_pb2 as pb
from .nodes import (
    FrameStream,
    NodeFailure,
    NodeLink,
    StepWaiter,
    TakenOver,
    WireStats,
    load_node,
    load_requests,
    node_ids,
    step_error,
)
from .reform import HEAL_AFTER_S, Heal, Layout, Reformer, Reforming
from .renewals import Renewer

log = logging.getLogger(__name__)

# Prompt chunks in flight at once: enough to keep every stage busy, while bounding the hidden states
# queued on the nodes (a 512-token chunk of a hidden-8192 bfloat16 model is 8 MiB).
STEPS_IN_FLIGHT = 4


class RemotePipeline(Reforming):
    """The Pipeline protocol over a chain of nodes, in order. Thread-safe for concurrent sequences."""

    def __init__(
        self,
        nodes: list[str],
        *,
        secret: str | None = None,
        step_timeout: float = 600.0,
        connect_timeout: float = 15.0,  # a live node under load can be slow to accept; dead ones fail at once
        ring: bool = True,
        steps_in_flight: int = STEPS_IN_FLIGHT,
        sources: list[str] | list[list[str]] | None = None,
        take_over: bool = False,
        ring_targets: list[str] | None = None,
        heal: Heal | None = None,
        heal_after: float = HEAL_AFTER_S,
        ring_groups: bool = False,
        claim: Claim = Claim(),  # a launched coordinator's term and node id (node/coordinators.py)
    ):
        if not nodes:
            raise ValueError("a pipeline needs at least one node")
        self.addresses = list(nodes)
        # Where node i sends its hidden states: at first the address this side reaches node i+1 at.
        self.next_targets = [*self.addresses[1:], ""]
        # Where the last node may reach the first, best first: this side's address of it may mean another
        # host from there (127.0.0.1, a subnet the last node is not on).
        self.ring_targets = list(dict.fromkeys([*(ring_targets or []), self.addresses[0]]))
        self.secret = secret
        self.step_timeout = step_timeout
        self.connect_timeout = connect_timeout
        self.ring = ring  # let the last node start decode rounds (False: this side sends every round)
        self.steps_in_flight = max(1, steps_in_flight)
        # Nodes (host:port) that can serve the model's tensors to a node without them: one list for
        # every node, or a list per node in pipeline order (the addresses each one reaches them at).
        srcs = list(sources or [])
        self.sources = srcs if srcs and not isinstance(srcs[0], str) else [srcs] * len(nodes)
        self.client_id = uuid.uuid4().hex[:16]  # 64 random bits: unique among a node's clients, short on the wire
        self.take_over, self.claim = take_over, claim  # (take_over: load nodes another holds, ending its requests)
        # A ring engine's: one node (two of which one was lost, after a heal) runs ring groups too.
        self.ring_groups = ring_groups
        self.nodes = [NodeLink(a, secret) for a in nodes]
        self.stats = WireStats()
        self.load_replies: list[pb.LoadReply] = []
        self.connect_replies: list[pb.ConnectReply] = []
        self._first = FrameStream(nodes[0], secret, self._stream_failed)
        self._waiters: dict[tuple[str, int], StepWaiter] = {}
        # Sequences in ring groups (engine/ring.py): each row's results and errors, as they come.
        self.row_sinks: dict[str, Callable[[StepOutput | Exception], None]] = {}
        self.on_kept: Callable[[GroupEnd], None] = lambda end: None  # a row's state kept on every node as it ended
        self._lock = threading.Lock()
        self._connect_lock = threading.Lock()
        self._closed = False
        # Sequences this client still wants: their leases on every node are renewed about once a second
        # (node/leases.py), so a lost release or a crash of this process never pins them there.
        self.live: set[str] = set()
        self._renewer: Renewer | None = None
        self._prefilling = 0  # calls of `steps` with prompt chunks in flight
        self._prefill_failed_at = 0.0  # when one last failed (monotonic), its chunks perhaps still computing
        self._load_args: tuple | None = None
        self.reformer = Reformer(self._reform, final=(TakenOver,))  # a lost node: down, then formed again
        self.heal, self.heal_after = heal, heal_after  # where a node lost that long has its layers go (reform.py)
        self.on_healed: Callable[[Layout], None] = lambda layout: None
        self._missing_since: dict[str, float] = {}

    # -- setup ----------------------------------------------------------------------------------

    def load(
        self, model_path: Path | str, specs: list[ShardSpec], *, mtp: bool = True, dtype: str | None = None,
        timeout: float | None = None,
    ) -> list[pb.LoadReply]:
        """Ask every node, in parallel, to load its shard (nodes.load_requests), then link each to the next."""
        if len(specs) != len(self.nodes):
            raise ValueError(f"{len(specs)} shard specs for {len(self.nodes)} nodes")
        self._load_args = (model_path, specs, mtp, dtype)
        # (the last node checks that its ring reaches the first, by its id; a node knows its next by id too)
        ids = node_ids(self.nodes, self.secret, self.connect_timeout)
        first_id = ids[0]
        last = len(self.nodes) - 1
        requests = load_requests(model_path, specs, mtp, dtype, self.addresses, self.sources, self.client_id,
                                 self.take_over, self.claim)
        if self.ring_groups and len(requests) == 1:
            requests[0].ring_groups = True

        def called(node: NodeLink, failing: str, rpc: Callable[[], Any]) -> Any:
            try:
                return rpc()
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise ValueError(f"node {node.address}: {e.details()}") from None
                raise NodeFailure(node.address, f"{failing}: {describe_rpc_error(e)}") from None

        def load_one(i: int) -> pb.LoadReply:
            return called(self.nodes[i], "load failed", lambda: load_node(self.nodes[i], requests[i], timeout))

        def link_one(i: int) -> pb.ConnectReply:
            node, ask = self.nodes[i], pb.ConnectRequest(next=self.next_targets[i], client_id=self.client_id,
                                                         next_node_id=ids[i + 1] if i < last else "")
            return called(node, "linking it failed", lambda: node.stub.Connect(ask, timeout=timeout)
                          if i < last else self._connect_ring(node, first_id, timeout))

        self._connect()  # subscribed first: a node holds for this coordinator from its Load on (node/service.py)
        with ThreadPoolExecutor(len(self.nodes)) as pool:  # (linked once every node took its shard: a pipeline
            self.load_replies = list(pool.map(load_one, range(len(self.nodes))))  # refused changes no link)
            self.connect_replies = list(pool.map(link_one, range(len(self.nodes))))
        self.take_over = False  # once: a pipeline formed again never takes its nodes from another
        return self.load_replies

    def _connect_ring(self, last: NodeLink, first_id: str, timeout: float | None) -> pb.ConnectReply:
        """Tell the last node where the first is: the first of `ring_targets` where the first node itself
        answers from there (kept first, for the pipeline formed again)."""
        for target in self.ring_targets:
            reply = last.stub.Connect(pb.ConnectRequest(ring=target, ring_node_id=first_id, client_id=self.client_id),
                                      timeout=timeout)
            if reply.ring:
                self.ring_targets = [target, *(t for t in self.ring_targets if t != target)]
                break
        return reply

    def keep_next_targets(self, targets: list[str]) -> None:
        """How each node reaches the next, as confirmed after the load: the pipeline formed again uses them."""
        if len(targets) != len(self.nodes) - 1:
            raise ValueError(f"{len(targets)} next-stage addresses for {len(self.nodes)} nodes")
        self.next_targets = [*targets, ""]

    @property
    def constrains(self) -> bool:
        """The last node holds output to grammars (it loaded the model's tokenizer with its shard)."""
        return bool(self.load_replies) and self.load_replies[-1].constrains

    @property
    def rings(self) -> bool:
        """The last node starts rounds itself (it reached the first node): ring groups can run."""
        # (one node: only if it said it runs groups on the whole model, as a node that knows the ask does)
        alone = self.ring_groups and bool(self.load_replies) and self.load_replies[-1].ring_groups
        return (len(self.nodes) > 1 or alone) and bool(self.connect_replies) and self.connect_replies[-1].ring

    def _connect(self) -> None:
        """Make sure every node holds a live subscription for this client (results and errors)."""
        if self._renewer is not None and all(n.subscription is not None for n in self.nodes):
            return
        with self._connect_lock:
            if self._closed:  # (a re-forming attempt that ran on as it closed subscribes nothing)
                raise RuntimeError("the pipeline is closed")
            for node in self.nodes:
                if node.subscription is None:
                    self._subscribe(node)
            if self._renewer is None:
                self._renewer = Renewer([n.stub for n in self.nodes], self.addresses, self.client_id, self._wanted,
                                        self._silent, paused=lambda: self.reformer.down is not None,
                                        busy_until=lambda: math.inf if self._prefilling else self._prefill_failed_at)

    def _wanted(self) -> list[str]:
        with self._lock:
            return sorted(self.live)

    def _silent(self, address: str, seconds: float) -> None:
        """A node whose loop answers nothing while its connections stay up (the renewer's report)."""
        if not self._closed and not self.reformer.given_up:
            self._lost(NodeFailure(address, f"stopped answering: no reply for {seconds:.1f} s (its process hangs)"))

    def _subscribe(self, node: NodeLink) -> None:
        call = node.stub.Subscribe(pb.SubscribeRequest(client_id=self.client_id))
        ready = threading.Event()
        failure: list[Exception] = []
        threading.Thread(
            target=self._listen, args=(node, call, ready, failure), name=f"sub-{node.address}", daemon=True
        ).start()
        if not ready.wait(self.connect_timeout):
            call.cancel()
            raise NodeFailure(node.address, f"did not answer within {self.connect_timeout:.0f} s")
        if failure:
            raise NodeFailure(node.address, f"cannot subscribe ({describe_rpc_error(failure[0])})")

    def _listen(self, node: NodeLink, call: Any, ready: threading.Event, failure: list[Exception]) -> None:
        try:
            for i, event in enumerate(call):
                if i == 0:  # the node's empty hello: subscribed
                    node.subscription = call
                    ready.set()
                    continue
                self._dispatch(event)
            error: Exception = ConnectionError("the node closed the subscription")
        except grpc.RpcError as e:
            error = e
        if not ready.is_set():
            failure.append(error)
            ready.set()
            return
        node.subscription = None
        if not self._closed and not self.reformer.given_up and not self.retired(node):
            log.warning("lost node %s: %s", node.address, describe_rpc_error(error))
            self._lost(NodeFailure(node.address, f"died or stopped answering ({describe_rpc_error(error)})"))

    def _dispatch(self, event: pb.Event) -> None:
        size = event.ByteSize()
        self.stats.events_received += 1
        self.stats.bytes_received += size
        kind = event.WhichOneof("kind")
        if kind == "result":
            out = result_to_output(event.result)
            key = (out.seq_id, out.step)
            with self._lock:
                w = self._waiters.get(key)
                if w is not None and out.continued and out.seq_id not in self.row_sinks:
                    # Registered before this result is handed over, so the next one always finds it.
                    # (A row in a ring group hears of its rounds through its row sink, errors included.)
                    nxt = StepWaiter(decode=True, started=([out.tokens[-1], *out.drafts], out))
                    self._waiters.setdefault((out.seq_id, out.step + 1), nxt)
            if w is None:
                log.debug("late result for %s step %d dropped", *key)
                return
            if w.decode:
                self.stats.decode_bytes_received += size
            w.set(output=out)
        elif kind == "group":
            self.stats.decode_bytes_received += size
            for r in event.group.rows:
                sink = self.row_sinks.get(r.seq_id)
                if sink is not None:
                    sink(result_to_output(r))
            for end in event.group.kept:
                self.on_kept(end_from_pb(end))
        elif kind == "error":
            e = event.error
            if not e.seq_id and e.code == "ABORTED":  # another coordinator took this node over
                taken = TakenOver(e.node, e.message.removeprefix(f"{e.node} "))
                self.reformer.give_up(taken)
                self._fail_all(taken)
                return
            if not e.seq_id:  # a broken link between nodes: every step in flight is lost
                self._lost(NodeFailure(e.node, f"died or stopped answering ({e.message})"))
                return
            with self._lock:
                w = self._waiters.get((e.seq_id, e.step))
            error = step_error(e.node, e.code, e.message)
            if w is not None:
                w.set(error=error)
            elif (sink := self.row_sinks.get(e.seq_id)) is not None:
                sink(error)

    def _stream_failed(self, target: str, error: Exception) -> None:
        if not self._closed:
            self._lost(NodeFailure(target, f"stream lost ({describe_rpc_error(error)})"))

    def _lost(self, error: NodeFailure) -> None:
        self.reformer.lost(error)  # first: a failed step's owner may ask whether the pipeline comes back
        self._fail_all(error)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            waiters = list(self._waiters.values())
        for w in waiters:
            w.set(error=error)
        for sink in list(self.row_sinks.values()):
            sink(error)

    # -- the Pipeline protocol ------------------------------------------------------------------

    def step(self, req: StepRequest) -> StepOutput:
        return self.steps([req])[0]

    @property
    def prefilling(self) -> bool:
        """Prompt chunks are in flight: a node may be in a step that holds its loop for a while."""
        return self._prefilling > 0

    def steps(self, reqs: list[StepRequest], stop: Callable[[], bool] | None = None) -> list[StepOutput]:
        """Consecutive steps of one sequence (a prompt's chunks), up to `steps_in_flight` at once: the
        first node computes chunk i+1 while the next ones work on chunk i. Once `stop()` says so (its
        client went away), no more are sent, and StageUnavailable is raised: the nodes compute only
        those already in flight."""
        if self._closed:
            raise RuntimeError("the pipeline is closed")
        in_flight: deque[tuple[StepRequest, StepWaiter]] = deque()
        outs: list[StepOutput] = []
        prefill = any(r.kind is StepKind.PREFILL for r in reqs)
        with self._lock:
            self._prefilling += prefill
        try:
            for req in reqs:
                if stop is not None and in_flight and stop():
                    raise StageUnavailable(f"{req.seq_id}: its client went away while its prompt went in")
                waiter = self._register(req)
                in_flight.append((req, waiter))
                if not waiter.claimed:
                    self._send(req)
                if len(in_flight) >= self.steps_in_flight:
                    outs.append(self._finish(*in_flight.popleft()))
            while in_flight:
                outs.append(self._finish(*in_flight.popleft()))
        finally:
            with self._lock:  # after a failure: steps nobody waits for any more
                self._prefilling -= prefill
                if in_flight and prefill:
                    self._prefill_failed_at = time.monotonic()
                for req, _ in in_flight:
                    self._waiters.pop((req.seq_id, req.step), None)
        return outs

    def _register(self, req: StepRequest) -> StepWaiter:
        """The waiter for this step's result: a new one, or the one of a round the last node started."""
        key = (req.seq_id, req.step)
        with self._lock:
            self.live.add(req.seq_id)
            waiter = self._waiters.get(key)
            if waiter is None:
                waiter = self._waiters[key] = StepWaiter(decode=req.kind is StepKind.DECODE)
                return waiter
            if waiter.started is None or waiter.claimed:
                raise StageError(f"step {req.step} of {req.seq_id!r} is already in flight")
            tokens, prev = waiter.started
            if req.kind is not StepKind.DECODE or req.tokens != tokens or req.commit != prev.commit:
                del self._waiters[key]
                raise StageError(f"step {req.step} of {req.seq_id!r} differs from the round the last node started")
            waiter.claimed = True
        self.stats.decode_rounds += 1
        return waiter

    def _send(self, req: StepRequest) -> None:
        frame = request_to_frame(req, self.client_id)
        if not self.ring:
            frame.budget = 0
        # Registered first, then connected: a subscription lost from here on fails the waiter.
        self._connect()
        size = frame.ByteSize()
        self.stats.frames_sent += 1
        self.stats.bytes_sent += size
        if req.kind is StepKind.DECODE:
            self.stats.decode_rounds += 1
            self.stats.decode_frames_sent += 1
            self.stats.decode_bytes_sent += size
        self._first.send(frame)

    def _finish(self, req: StepRequest, waiter: StepWaiter) -> StepOutput:
        try:
            return self._wait(waiter, req)
        finally:
            with self._lock:
                self._waiters.pop((req.seq_id, req.step), None)

    def _wait(self, waiter: StepWaiter, req: StepRequest) -> StepOutput:
        # (dead and silent nodes end it through their subscriptions: the timeout backstops one that never answers)
        if not waiter.done.wait(self.step_timeout):
            raise NodeFailure(self.addresses[-1], f"no result for step {req.step} within {self.step_timeout:.0f} s")
        if waiter.error is not None:
            raise waiter.error
        return waiter.output

    def release(self, seq_id: str, group: int = 0) -> None:
        """Drop the sequence on every node: one frame behind its last step, no waiting. `group`: the
        ring group it was meant for (the last node then decides when the others free it)."""
        if self._closed:
            return
        with self._lock:  # rounds the last node started that nobody will ask for
            self.live.discard(seq_id)
            for key in [k for k, w in self._waiters.items() if k[0] == seq_id and not w.claimed and w.started]:
                del self._waiters[key]
        try:
            self._first.send(pb.Frame(client_id=self.client_id, seq_id=seq_id, kind=pb.RELEASE, group=group))
        except RuntimeError:
            pass

    def drop_prefix(self, key: str) -> None:
        """Drop a kept prompt prefix on every node, behind the steps sent before."""
        if not self._closed:
            with contextlib.suppress(RuntimeError):
                self._first.send(pb.Frame(client_id=self.client_id, kind=pb.RELEASE, prefix=key))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._renewer is not None:
            self._renewer.stop()
        self.reformer.stop()
        self._first.close()
        for n in self.nodes:
            if n.subscription is not None:
                n.subscription.cancel()
            n.channel.close()
        self._fail_all(RuntimeError("the pipeline was closed"))

    def describe(self) -> dict[str, Any]:
        return {"kind": "remote", "stages": [{"index": i, "address": a} for i, a in enumerate(self.addresses)]}

    def health(self, probe_next: bool = False, timeout: float = 5.0) -> list[pb.HealthReply]:
        return [n.stub.Health(pb.HealthRequest(probe_next=probe_next), timeout=timeout)
                for n in self.nodes]
