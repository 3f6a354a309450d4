"""The node's gRPC servicer: one shard (a StageWorker), its frames, subscriptions and health.

Steps arrive as Frames on long-lived streams: from the coordinator into the first node (gRPC
Forward), from node i into node i+1 (the data plane, dataplane.py). A node runs its layers, puts
its hidden states (raw bytes) into the frame in place of the ones it received and sends it on to
the next node. The last node pushes the StepResult to the frame's client over that client's
Subscribe stream and, while the client's budget lasts, starts the next decode round itself: it
sends that round's frame (tokens and commit) around the ring to the first node. Any node that
refuses or fails a step pushes an Error to the client directly, so errors never wait on the rest of
the chain. All a node learns about acceptance is the Commit riding on the next step.

The servicer runs on one event loop: a frame is received, computed and queued for the next node on
that loop, with no thread hand-offs on the decode path (each costs more than a small decode step on
a busy machine). That loop's thread is the node's one MLX thread (it owns a thread-local stream, see
server.py): loads (loader.py), steps, releases and tensor decoding all run on it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from ..models import blas
from ..proto import mtpipe_pb2 as pb
from ..proto import mtpipe_pb2_grpc as pb_grpc
from .conditions import LINK_LOST, Conditions
from .coordinators import Coordinators, relink
from .dataplane import NextStage
from .group_frames import GroupFrames
from .health import MemoryReadings, health_reply
from .sysinfo import machine_id
from .kept import KeptFrames
from .leases import LeaseHolder
from .loader import LoadKey
from .loads import ShardLoads
from .protocol import StageError, StepOutput
from .weights import WeightStore
from .wire import describe_rpc_error, frame_to_request, next_round, output_to_result, tensor_from_pb, tensor_to_pb

if TYPE_CHECKING:
    from .stage import StageWorker

log = logging.getLogger(__name__)

RING_PROBE_S = 2.0  # how long the last node tries to reach the first at load
# A client (coordinator) whose subscription ended and was not renewed this long is gone: its
# sequences are released, so a crashed coordinator does not pin caches on the nodes forever.
ORPHAN_GRACE_S = 30.0


@dataclass
class LinkStats:
    frames: int = 0
    bytes: int = 0
    decode_frames: int = 0
    decode_bytes: int = 0


class NodeService(GroupFrames, LeaseHolder, KeptFrames, ShardLoads, pb_grpc.NodeServicer):
    """The servicer, on one asyncio loop. Steps run on the loop itself: a decode step is milliseconds
    and a thread hop would cost more than it saves, and MLX arrays must be evaluated on the thread
    that built them (streams are per thread), so every shard and sequence lives on this one thread.
    Loads run there too, in pieces between which the loop serves other calls."""

    def __init__(self, node_id: str | None = None, secret: str | None = None, name: str | None = None,
                 model_dirs: list[Any] | None = None, shard_cache: Any = None, download: bool = False,
                 draft_vocab: int | None = None, mtp_window: int | None = None):
        self.node_id = node_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        self.name = name or self.node_id  # how errors name this node; the coordinator sets host:port
        self.secret = secret
        self.started = time.monotonic()
        self.coordinating = False  # it drives the cluster (set by `mtpipe launch`): Ping says so
        self.placed: dict[str, str] = {}  # coordinating: the nodes it placed the model on, id -> address (Health)
        self.memory_offered: Callable[[], int] | None = None  # what `mtpipe launch` offers: Health says so
        self.memory_readings: MemoryReadings | None = None  # (health.py)
        self.worker: StageWorker | None = None
        self.key: LoadKey | None = None
        self.next: NextStage | None = None
        self.data_port = 0  # set by NodeServer when it runs a data-plane listener
        self.link_stats = LinkStats()
        # The last node's link to the first, for the decode rounds it starts itself; a node that is
        # the whole pipeline starts them in-process.
        self.ring: NextStage | None = None
        self.ring_stats = LinkStats()
        self._tasks: set[asyncio.Task] = set()  # in-process rounds (the loop keeps only weak references)
        self.conditions = Conditions()  # what is wrong with the node now, since when (Health)
        self.loop: asyncio.AbstractEventLoop | None = None  # set by NodeServer: the node's MLX thread's loop
        self._load_lock: asyncio.Lock | None = None
        self._subs: dict[str, asyncio.Queue] = {}
        self.coordinators = Coordinators()  # whose frames run here (coordinators.py)
        self._owners: dict[str, str] = {}  # sequence id -> the client that started it
        self.orphan_grace = ORPHAN_GRACE_S
        self.blas = blas.warn_if_reference()
        machine_id()  # (asked now, off the loop: Health answers it from then on, and macOS asks a command)
        self.weights = WeightStore(model_dirs, shard_cache, secret, download)  # where shards come from (weights.py)
        self.draft_vocab = draft_vocab  # the last stage's draft vocabulary (None: the default size)
        self.mtp_window = mtp_window  # what its drafts attend to (None: the default window)

    # -- loading (loads.py) ----------------------------------------------------------------------

    async def Connect(self, request: pb.ConnectRequest, context: grpc.aio.ServicerContext) -> pb.ConnectReply:
        self._load_lock = self._load_lock or asyncio.Lock()
        async with self._load_lock:
            if self.worker is None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.name} has no shard loaded")
            others = bool(request.client_id) and any(c != request.client_id and self.coordinators.admits(c)
                                                     for c in self._subs)
            ring = request.ring if self.worker.spec.is_last and not self.worker.spec.is_first else ""
            asked = {"next stage": (self.next, request.next, request.next_node_id),
                     "first stage": (self.ring, ring, request.ring_node_id)}
            for role, (link, target, node_id) in asked.items():
                live = link is not None and not link.closed
                answered = await link.node_id(timeout=RING_PROBE_S) if others and live else None
                done = relink(others, link.target if live else "", answered, target, node_id)
                if done == "refuse":
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.name} serves another "
                                        f"coordinator through its {role} {link.target}: its links stay")
                if done == "keep":  # (the same node, at the address the others reach it at)
                    asked[role] = (link, link.target, answered)
            await self._set_next(*asked["next stage"][1:])
            if not (others and self.ring is None and ring):  # (a ring where none was would take their rounds)
                await self._set_ring(*asked["first stage"][1:])
            return pb.ConnectReply(ring=self.ring is not None or self.ring_self,
                                   next_transport=self.next.transport if self.next is not None else "")

    async def _set_next(self, target: str, node_id: str = "") -> None:
        if self.next is not None and self.next.target == target and not self.next.closed:
            self.next.peer_id = node_id or self.next.peer_id
            if self.next.link is None:  # (formed again after a break: the link opens now)
                await self.next.connect()
            return
        if self.next is not None:
            await self.next.close()
        self.conditions.clear("link:next stage")  # (what broke was the link it replaces)
        self.next = NextStage(target, self.secret, *self._link_watch("next stage")) if target else None
        if self.next is not None:
            self.next.peer_id = node_id  # (as the coordinator knows it: "" where it did not say)

    @property
    def subscribed(self) -> list[str]:
        """The clients (coordinators) subscribed to this node now."""
        return list(self._subs)

    @property
    def ring_self(self) -> bool:
        """The node is the whole pipeline: it starts its rounds in-process."""
        return self.worker is not None and self.worker.spec.is_first and self.worker.spec.is_last

    async def _set_ring(self, target: str, first_node_id: str) -> None:
        spec = self.worker.spec
        want = target if spec.is_last and not spec.is_first else ""
        if self.ring is not None and self.ring.target == want and not self.ring.closed:
            self.ring.peer_id = first_node_id or self.ring.peer_id
            if self.ring.link is None:
                await self.ring.connect()
            return
        if self.ring is not None:
            await self.ring.close()
            self.ring = None
        self.conditions.clear("link:first stage")
        if not want:
            return
        link = NextStage(want, self.secret, *self._link_watch("first stage"))
        answered = await link.node_id(timeout=RING_PROBE_S)
        # The coordinator's address of the first node may mean another host from here (127.0.0.1, a
        # subnet this node is not on): start rounds only where the first node itself answers. Without
        # that the coordinator sends every round itself, one hop more per round.
        if answered is None or answered == self.node_id or (first_node_id and answered != first_node_id):
            log.warning("the first node does not answer at %s (%s); the client will start every round", want,
                        f"{answered} answered" if answered else "unreachable")
            await link.close()
            return
        link.peer_id = answered
        self.ring = link

    def _link_watch(self, role: str) -> tuple[Callable[[str, Exception], None], Callable[[str], None]]:
        """What the node does when a link breaks, and when one opens (the break is over)."""

        def lost(target: str, error: Exception) -> None:
            # Frames in flight on that link are lost: every client waiting on this chain must know.
            msg = f"{LINK_LOST}{role} {target}: {describe_rpc_error(error)}"
            self.conditions.set(f"link:{role}", msg)
            self.end_groups()
            self._broadcast(pb.Event(error=pb.Error(code="UNAVAILABLE", message=msg, node=target)))

        return lost, lambda target: self.conditions.clear(f"link:{role}")

    def _dtype_name(self) -> str:
        return str(self.worker.dtype).removeprefix("mlx.core.") if self.worker else ""

    # -- steps ----------------------------------------------------------------------------------

    async def _compile(self, frame: pb.Frame) -> None:
        """A first step's grammar compiled off the loop (and kept: constraints.py), so the loop, which runs
        every round here, only copies it; StageError for one that does not compile."""
        head = self.worker.head if self.worker is not None else None
        if frame.step == 0 and frame.params.HasField("grammar") and head is not None and head.grammars is not None:
            try:
                await asyncio.to_thread(head.grammars.check, frame.params.grammar)
            except ValueError as e:
                raise StageError(f"{self.name}: the grammar does not compile: {e}") from None

    def _run(self, frame: pb.Frame) -> StepOutput | pb.Tensor:
        """One step on this node, on the loop thread."""
        worker = self.worker
        if worker is None:
            raise StageError(f"{self.name} has no shard loaded")
        if not self.coordinators.admits(frame.client_id):
            raise StageError(f"{self.name} holds another coordinator's shard now")
        if not self._owned_by(frame.seq_id, frame.client_id):  # (before it is touched, or its step told)
            raise StageError(f"{self.name}: sequence {frame.seq_id!r} belongs to another client")
        if frame.step == 0 and not worker.overlap and self.ring_groups.holds(frame.seq_id):
            raise StageError(f"sequence {frame.seq_id!r} is decoding here already")  # (before it is touched)
        req = self.scope(frame_to_request(frame), frame.client_id)
        hidden = tensor_from_pb(frame.hidden) if frame.HasField("hidden") else None
        out = worker.step(req, hidden, None if worker.overlap else self.ring_groups.joins_at(frame.client_id, req))
        if frame.step == 0:  # a sequence starts: only its client may release it, and only while it renews it
            self._owners[frame.seq_id] = frame.client_id
            self.lease(frame.seq_id)
        if req.keep and req.keep not in worker.prefixes:  # (no room here: none after this keeps it either)
            frame.keep, frame.keep_refused = "", True
        if isinstance(out, StepOutput):
            out.keep_refused = frame.keep_refused
            return out
        return tensor_to_pb(out)

    def _release(self, seq_id: str) -> bool:
        worker = self.worker
        if worker is None:
            return False
        self._owners.pop(seq_id, None)
        # freeing arrays is MLX work too: on the loop thread, as always
        return self.ring_groups.release(seq_id) if not worker.overlap else worker.release(seq_id)

    async def on_frame(self, frame: pb.Frame) -> None:
        if not self.coordinators.admits(frame.client_id):  # its requests fail at once, rather than wait for nothing
            if frame.kind != pb.RELEASE:  # (its client's condition, not this node's: it serves the other one)
                self._fail(frame, "FAILED_PRECONDITION", f"{self.name} holds another coordinator's shard now",
                           node_fault=False)
            return
        if frame.kind == pb.RELEASE and frame.prefix and not frame.seq_id:
            self.drop_kept(frame)
            return
        if frame.kind == pb.RELEASE:
            if not self._owned_by(frame.seq_id, frame.client_id):
                log.info("%s: a release of %s by a client that did not start it, ignored", self.name, frame.seq_id)
                return
            if self.release_grouped(frame):
                return
            self._release(frame.seq_id)
            if self.worker is not None and not self.worker.spec.is_last:
                self._forward(frame)
            return
        if frame.kind == pb.GROUP:
            self.on_group(frame)
            return
        if frame.ring and (self.worker is None or frame.seq_id not in self.worker.sequences):
            # The client released the sequence while the last node was starting this round.
            log.debug("round %d of released sequence %s dropped", frame.step, frame.seq_id)
            return
        try:
            await self._compile(frame)
            started = time.monotonic()
            try:
                out = self._run(frame)
            finally:
                self.held(time.monotonic() - started)  # (no renewal could be heard meanwhile: leases.py)
        except StageError as e:
            self._fail(frame, "INVALID_ARGUMENT", str(e))
            return
        except Exception as e:  # a bug or an MLX failure: report it, keep serving other sequences
            log.exception("step %d of %s failed", frame.step, frame.seq_id)
            self._fail(frame, "INTERNAL", f"{type(e).__name__}: {e}")
            return
        if self.worker.spec.is_last and not self.worker.overlap and self._ring_groups is not None:
            self._ring_groups.interrupt()
        if isinstance(out, StepOutput) and frame.group and frame.final and not self.worker.overlap:
            self._emit(frame.client_id, self.joined(frame, out))
        elif isinstance(out, StepOutput):
            # Only while the client listens: a vanished coordinator must not leave a sequence running.
            ring = (self.ring is not None or self.ring_self) and frame.client_id in self._subs
            nxt = next_round(frame, out) if ring else None
            out.continued = nxt is not None
            event = pb.Event(result=output_to_result(out))
            if nxt is not None:
                self._start_round(nxt)  # first: the first node starts computing at once
            self._emit(frame.client_id, event)
        else:
            frame.hidden.CopyFrom(out)
            self._forward(frame)

    def _forward(self, frame: pb.Frame) -> None:
        link = self.next
        if link is None:
            self._fail(frame, "FAILED_PRECONDITION", f"{self.name} is not the last stage but knows no next stage")
            return
        size = frame.ByteSize()
        s = self.link_stats
        s.frames += 1
        s.bytes += size
        if frame.kind == pb.DECODE:
            s.decode_frames += 1
            s.decode_bytes += size
        link.send(frame)

    def _start_round(self, frame: pb.Frame) -> None:
        self.ring_stats.frames += 1
        self.ring_stats.bytes += frame.ByteSize()
        if self.ring is not None:
            self.ring.send(frame)
            return
        task = asyncio.get_running_loop().create_task(self.on_frame(frame))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _fail(self, frame: pb.Frame, code: str, message: str, node_fault: bool = True) -> None:
        if node_fault:  # (else the request's client's own: not on show in this node's Health)
            self.conditions.failed(code, message)
        log.info("step %d of %s refused: %s", frame.step, frame.seq_id, message)
        err = pb.Error(code=code, message=message, node=self.name, seq_id=frame.seq_id, step=frame.step)
        self._emit(frame.client_id, pb.Event(error=err))

    async def Forward(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        async for frame in request_iterator:  # one stream's frames, strictly in order
            await self.on_frame(frame)
            await asyncio.sleep(0)  # (as FrameListener does between frames)
        return
        yield  # an async generator: the reply stream stays silent

    async def Step(self, request: pb.Frame, context: grpc.aio.ServicerContext) -> pb.StepReply:
        if request.kind == pb.RELEASE:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "use Release to drop a sequence")
        try:
            await self._compile(request)
            out = self._run(request)
        except StageError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if isinstance(out, StepOutput):
            return pb.StepReply(result=output_to_result(out))
        return pb.StepReply(hidden=out)

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseReply:
        if not self._owned_by(request.seq_id, request.client_id):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{self.name}: sequence {request.seq_id!r} belongs to another client")
        return pb.ReleaseReply(released=self._release(request.seq_id))

    def _owned_by(self, seq_id: str, client_id: str) -> bool:
        """Whether `client_id` may step or release `seq_id` here (one this node does not hold: nothing to guard)."""
        return self._owners.get(seq_id, client_id) == client_id

    # -- subscriptions --------------------------------------------------------------------------

    async def Subscribe(self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext) -> Any:
        q: asyncio.Queue = asyncio.Queue()
        old = self._subs.get(request.client_id)
        self._subs[request.client_id] = q
        if old is not None:
            old.put_nowait(None)
        try:
            yield pb.Event()  # an empty first event: the subscription is registered
            while (event := await q.get()) is not None:
                yield event
        finally:
            if self._subs.get(request.client_id) is q:
                del self._subs[request.client_id]
                asyncio.get_running_loop().call_later(self.orphan_grace, self._expire, request.client_id)

    def _expire(self, client_id: str) -> None:
        """Release the sequences of a client that has not subscribed again since it went away."""
        if client_id in self._subs:
            return
        if gone := self.forget_client(client_id):
            log.info("released %d sequence(s) of client %s: gone for %.0f s", gone, client_id, self.orphan_grace)

    def forget_client(self, client_id: str, alone: bool = True) -> int:
        """What a client has here goes: its kept prefixes, its groups with their rows and the rows waiting
        to join them, and with `alone` its other sequences too; how many sequences went."""
        gone = [seq for seq, owner in self._owners.items() if owner == client_id] if alone else []
        self.forget_kept(client_id)
        if self.worker is not None and not self.worker.overlap:
            gone += [seq for seq in self.ring_groups.drop_client(client_id) if seq not in gone]
        for seq in gone:
            self._release(seq)
        return len(gone)

    def _emit(self, client_id: str, event: pb.Event) -> None:
        q = self._subs.get(client_id)
        if q is None:
            log.debug("no subscriber %r; dropped %s", client_id, event.WhichOneof("kind"))
            return
        q.put_nowait(event)

    def _broadcast(self, event: pb.Event) -> None:
        for q in list(self._subs.values()):
            q.put_nowait(event)

    async def close(self) -> None:
        subs, self._subs = list(self._subs.values()), {}
        for q in subs:
            q.put_nowait(None)
        if self.next is not None:
            await self.next.close()
        if self.ring is not None:
            await self.ring.close()

    # -- health ---------------------------------------------------------------------------------

    async def FetchTensors(self, request: pb.FetchRequest, context: grpc.aio.ServicerContext) -> Any:
        async for chunk in self.weights.serve(request, context, self.name):
            yield chunk

    async def Ping(self, request: pb.PingRequest, context: grpc.aio.ServicerContext) -> pb.PingReply:
        claim = self.coordinators.claim
        return pb.PingReply(payload=request.payload, node_id=self.node_id, data_port=self.data_port,
                            coordinator=self.coordinating, term=claim.term, term_holder=claim.holder)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthReply:
        return await health_reply(self, request.probe_next)
