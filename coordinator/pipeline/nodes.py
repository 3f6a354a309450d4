"""The coordinator's connections to nodes: the Forward stream into the first one, a channel per node,
and the errors that name a node."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from ...node.coordinators import Claim
from ...node.protocol import StageError, StageUnavailable, StepOutput
from ...node.wire import describe_rpc_error, describe_unreached, make_channel
from ...proto import mtpipe_pb2 as pb
from ...proto import mtpipe_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from ...models.shard import ShardSpec

log = logging.getLogger(__name__)

IN_USE_SETTLE_S = 3.0  # a node another coordinator holds: how long a Load waits for it to let go


class NodeFailure(StageUnavailable):
    """A node died, hung or cannot be reached. The steps in flight are lost."""

    def __init__(self, node: str, message: str):
        for named in (f"node {node}: ", f"{node}: "):  # (a node's own message may name it already)
            message = message.removeprefix(named)
        super().__init__(f"node {node}: {message}")
        self.node = node


class NodeInUse(NodeFailure):
    """The node serves another coordinator, connected to it, with another shard (RemotePipeline's `take_over`)."""


class TakenOver(NodeFailure):
    """Another coordinator took the node over: this one no longer serves on it, and does not try to."""


class RemoteStageError(StageError):
    """A node refused a step (INVALID_ARGUMENT) or failed it; that node's state is unchanged."""

    def __init__(self, node: str, code: str, message: str):
        super().__init__(f"node {node}: {code}: {message}")
        self.node = node
        self.code = code


class RowLost(NodeFailure):
    """A node ended a sequence on its own account (its group's rounds stopped coming there, or its
    lease ran out there): the sequence is gone, the nodes are not, so its request may go on anew."""

    def __init__(self, node: str, code: str, message: str):
        super().__init__(node, f"{code}: {message}")
        self.code = code


def step_error(node: str, code: str, message: str) -> RowLost | RemoteStageError:
    """A node's error about one sequence: UNAVAILABLE or ABORTED if the node ended it on its own
    account (its group's rounds stopped coming there, its lease ran out there), else a refused step."""
    if code in ("UNAVAILABLE", "ABORTED"):
        return RowLost(node, code, message)
    return RemoteStageError(node, code, message)


def check_hops(nodes: list[NodeLink], timeout: float = 2.0) -> None:
    """Each node but the last reaches the next (its Health, probing the hop). A pipeline formed again
    over a hop that does not carry would lose its first round there, and again at every re-forming."""
    def probe(i: int) -> None:
        reply = nodes[i].stub.Health(pb.HealthRequest(probe_next=True), timeout=3 * timeout)
        if reply.next and reply.next_rtt_ms < 0:
            raise NodeFailure(nodes[i + 1].address, f"not reached from node {nodes[i].address} ({reply.next})")

    if len(nodes) > 1:
        with ThreadPoolExecutor(len(nodes) - 1) as pool:
            list(pool.map(probe, range(len(nodes) - 1)))


@dataclass
class StepWaiter:
    """One step the engine waits for: its output or error, set once."""

    done: threading.Event = field(default_factory=threading.Event)
    decode: bool = False
    output: StepOutput | None = None
    error: Exception | None = None
    # A step the last node started itself: the tokens and commit it sent, until the engine asks for it.
    started: tuple[list[int], StepOutput] | None = None
    claimed: bool = False

    def set(self, output: StepOutput | None = None, error: Exception | None = None) -> None:
        if not self.done.is_set():
            self.output, self.error = output, error
            self.done.set()


@dataclass
class WireStats:
    """What crossed the coordinator's own links (serialized protobuf bytes)."""

    frames_sent: int = 0
    bytes_sent: int = 0
    events_received: int = 0
    bytes_received: int = 0
    decode_rounds: int = 0
    decode_frames_sent: int = 0  # decode rounds this side started (the rest the last node started)
    decode_bytes_sent: int = 0
    decode_bytes_received: int = 0


class FrameStream:
    """A long-lived Forward stream to one node. Frames are queued and written in order by gRPC's own thread.

    If the stream breaks, `on_error(target, error)` is called once and the next `send` opens a new
    one; the frames in flight are lost, which the caller learns through that callback.
    """

    def __init__(
        self, target: str, secret: str | None = None, on_error: Callable[[str, Exception], None] | None = None
    ):
        self.target = target
        self.secret = secret
        self.on_error = on_error
        self.channel = make_channel(target, secret)
        self.stub = pb_grpc.NodeStub(self.channel)
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue | None = None
        self._watcher: threading.Thread | None = None
        self._closed = False

    def send(self, frame: pb.Frame) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"stream to {self.target} is closed")
            if self._queue is None:
                self._open()
            self._queue.put(frame)

    def _open(self) -> None:
        q: queue.SimpleQueue = queue.SimpleQueue()

        def frames() -> Iterator[pb.Frame]:
            while (f := q.get()) is not None:
                yield f

        call = self.stub.Forward(frames())
        self._queue = q
        self._watcher = threading.Thread(target=self._watch, args=(call, q), name=f"stream-{self.target}", daemon=True)
        self._watcher.start()

    def _watch(self, call: Any, q: queue.SimpleQueue) -> None:
        error: Exception | None = None
        try:
            for _ in call:  # the node never answers on this stream; we only wait for its end
                pass
        except grpc.RpcError as e:
            error = e
        with self._lock:
            if self._queue is q:
                self._queue = None
            closed = self._closed
        if not closed:
            error = error or ConnectionError("the stream was closed by the node")
            log.warning("stream to %s ended: %s", self.target, describe_rpc_error(error))
            if self.on_error is not None:
                self.on_error(self.target, error)

    def close(self, drain: float = 2.0) -> None:
        with self._lock:
            self._closed = True
            if self._queue is not None:
                self._queue.put(None)  # half-close: the node finishes what it has and ends the call
            self._queue = None
        if self._watcher is not None:
            # Closing the channel cancels the call: frames still queued (a release) would be lost.
            self._watcher.join(drain)
        self.channel.close()


class NodeLink:
    """One node as the coordinator sees it: a channel for unary calls and its Subscribe stream."""

    def __init__(self, address: str, secret: str | None):
        self.address = address
        self.channel = make_channel(address, secret)
        self.stub = pb_grpc.NodeStub(self.channel)
        self.subscription: Any = None  # the live Subscribe call, None when there is none



def wait_for_nodes(nodes: list[str], timeout: float = 30.0, secret: str | None = None) -> None:
    """Block until every node answers a Ping (gRPC waits for the connection; no polling sleeps)."""
    deadline = time.monotonic() + timeout
    for address in nodes:
        with make_channel(address, secret) as channel:
            stub = pb_grpc.NodeStub(channel)
            try:
                stub.Ping(pb.PingRequest(), timeout=max(0.1, deadline - time.monotonic()), wait_for_ready=True)
            except grpc.RpcError as e:
                why = describe_unreached(address, secret, e)
                raise NodeFailure(address, f"not ready within {timeout:.0f} s ({why})") from None


def node_ids(nodes: list[NodeLink], secret: str | None, timeout: float) -> list[str]:
    """Each node's id, as its Ping says, in pipeline order: NodeFailure naming one that cannot be reached,
    ValueError where two addresses (`localhost` and `127.0.0.1`, say) reach one node, whose second load
    would replace the shard of its first."""
    def ping(node: NodeLink) -> str:
        try:
            return node.stub.Ping(pb.PingRequest(), timeout=timeout).node_id
        except grpc.RpcError as e:
            raise NodeFailure(node.address, f"cannot reach it ({describe_unreached(node.address, secret, e)})") \
                from None

    with ThreadPoolExecutor(len(nodes)) as pool:
        ids = list(pool.map(ping, nodes))
    seen: dict[str, str] = {}
    for node, node_id in zip(nodes, ids):
        if node_id in seen:
            raise ValueError(f"{seen[node_id]} and {node.address} are the same node ({node_id}): list each node once")
        seen[node_id] = node.address
    return ids


def load_requests(model_path: Path | str, specs: list[ShardSpec], mtp: bool, dtype: str | None, addresses: list[str],
                  sources: list[list[str]], client_id: str, take_over: bool,
                  claim: Claim = Claim()) -> list[pb.LoadRequest]:
    """Each node's Load: the model by identity (its fingerprint; each node checks its own copy against it,
    or fetches its shard's tensors from `sources`, by name, hash, dtype and shape); the path is a hint."""
    from ...models.fingerprint import checkpoint_index, config_sha256, model_fingerprint, raw_hf_layout
    from ...models.fingerprint import shard_names, tensor_hashes
    from ...models.registry import hub_origin

    path = str(Path(model_path).resolve())
    fingerprint = model_fingerprint(path)
    hub_repo, hub_revision = hub_origin(model_path) or ("", "")  # nodes with --download may use it
    config = config_sha256((Path(path) / "config.json").read_text())
    shard_tensors = [shard_names(path, s.start, s.end, s.num_layers, mtp) for s in specs]
    # (kept beside the model since the fingerprint was taken: its headers are read, not its tensors)
    hashes, index = tensor_hashes(path, sorted({n for ns in shard_tensors for n in ns})), checkpoint_index(path)
    layout = "raw_hf" if raw_hf_layout(index) else "mlx"
    return [pb.LoadRequest(model_path=path, start=s.start, end=s.end, num_layers=s.num_layers, mtp=mtp,
                           dtype=dtype or "", node_name=address, fingerprint=fingerprint, sources=srcs,
                           hub_repo=hub_repo, hub_revision=hub_revision, tensors=names,
                           tensor_sha256=[hashes[n] for n in names], config_sha256=config,
                           tensor_meta=[pb.TensorMeta(dtype=index[n].dtype, shape=index[n].shape) for n in names],
                           layout=layout, client_id=client_id, take_over=take_over, term=claim.term,
                           term_holder=claim.holder)
            for s, address, srcs, names in zip(specs, addresses, sources, shard_tensors)]


def load_node(node: NodeLink, request: pb.LoadRequest, timeout: float | None) -> pb.LoadReply:
    """The node's Load, waiting a moment for a coordinator that is closing to let it go. NodeInUse if
    another one holds it still, TakenOver if another took it from this coordinator; other errors raise."""
    settle = time.monotonic() + IN_USE_SETTLE_S
    while True:
        try:
            return node.stub.Load(request, timeout=timeout)
        except grpc.RpcError as e:
            details = e.details().removeprefix(f"{node.address} ")
            if e.code() == grpc.StatusCode.ABORTED:
                raise TakenOver(node.address, details) from None
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            if time.monotonic() > settle:
                raise NodeInUse(node.address, details) from None
            time.sleep(0.2)
