"""Node-to-node frames over a plain TCP stream: the pipeline's data plane, and `NextStage`, a node's
outbound link, which uses it where the next node offers one and a gRPC Forward stream otherwise.

A frame is the same protobuf `Frame` the gRPC Forward stream carries, prefixed by its length (4
bytes, little-endian). gRPC stays the control plane (loads, results, errors, health, the
coordinator's own frames); between nodes a frame then costs one socket write and one wake-up of the
reader's event loop, where a gRPC stream write and read each cost several thread hand-offs.
Measured on the 2-core VM, ping-pong with a 4-layer MLX step between hops: 0.6-0.8 ms a hop over
gRPC, 0.25-0.4 ms over this stream.

A connection opens with a hello; the listener answers OK and, with a cluster secret, both ends then
turn the stream into mutual TLS keyed by it (tls.py), as gRPC is: a peer without the secret gets no
further, and frames cannot be read, altered or replayed. Frames then flow one way until either
side closes. A connection that opens with `BULK_HELLO` instead is a shard-tensor transfer, handed to
`on_bulk` (bulk.py). Broken input (a wrong hello, an oversized or undecodable frame) closes that
connection only.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from ..proto import mtpipe_pb2 as pb
from ..proto import mtpipe_pb2_grpc as pb_grpc
from .links import split_host_port
from .tls import NAME, ssl_context
from .wire import describe_rpc_error, make_aio_channel

log = logging.getLogger(__name__)

HELLO = b"mtpipe-frames/1\n"
BULK_HELLO = b"mtpipe-tensors1\n"  # a shard-tensor stream (bulk.py), authorized by a FetchTensors token
assert len(BULK_HELLO) == len(HELLO)
LENGTH = struct.Struct("<I")
HANDSHAKE_TIMEOUT_S = 5.0
# A frame's bytes once its length came (the largest a slow link carries in time): a sender that stops
# halfway holds its buffer no longer.
FRAME_BODY_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 30.0  # opening a link to the next stage: one in a long step answers only after it
RECONNECT_TIMEOUT_S = 5.0  # opening it again as the pipeline is formed again (a Connect waits for it)
CLOSE_TIMEOUT_S = 1.0  # closing a link: how long its peer may take to close its end


class DataPlaneError(ConnectionError):
    """The peer is not a data plane, or sent broken input."""


def _keepalive(sock: socket.socket | None) -> None:
    """Notice a peer host that vanished (cable, power) within seconds, where the OS supports it."""
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 2), ("TCP_KEEPALIVE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _any_address_socket(port: int) -> socket.socket:
    """One socket for every address, IPv4 and IPv6 (asyncio would bind '::' as IPv6 only, and each
    family to a different free port)."""
    if socket.has_ipv6:
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("::", port))
            return sock
        except OSError:
            sock.close()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    return sock


def _encode(frame: pb.Frame) -> bytes:
    """The frame with its length, in one buffer: over TLS one record per frame, not one per part."""
    data = frame.SerializeToString()
    return LENGTH.pack(len(data)) + data


class FrameListener:
    """Accepts data-plane connections and hands each frame, in order per connection, to `on_frame`."""

    def __init__(self, on_frame: Callable[[pb.Frame], Awaitable[None]], secret: str | None, max_bytes: int,
                 on_bulk: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]] | None = None):
        self.on_frame = on_frame
        self.on_bulk = on_bulk
        self.ssl = ssl_context(secret, server=True) if secret else None
        self.max_bytes = max_bytes
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closing = False

    async def start(self, host: str, port: int = 0) -> int:
        if host in ("", "0.0.0.0", "::"):
            self._server = await asyncio.start_server(self._serve, sock=_any_address_socket(port))
        else:
            self._server = await asyncio.start_server(self._serve, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        peer = writer.get_extra_info("peername")
        try:
            _keepalive(writer.get_extra_info("socket"))  # (on a socket its peer already left, this fails: OSError)
            try:
                hello = await asyncio.wait_for(reader.readexactly(len(HELLO)), HANDSHAKE_TIMEOUT_S)
            except asyncio.IncompleteReadError as e:
                if e.partial:
                    raise
                log.debug("data plane: %s connected and left (a link probe)", peer)
                return
            if hello == BULK_HELLO and self.on_bulk is not None:
                await self.on_bulk(reader, writer)
                return
            if hello != HELLO:
                raise DataPlaneError("not a data-plane hello")
            if self.ssl is not None:
                hold_plaintext(reader, writer)
            writer.write(b"OK")
            await writer.drain()
            if self.ssl is not None:  # the peer sends nothing more until it has read OK
                await writer.start_tls(self.ssl, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
            while True:
                try:
                    (size,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
                except asyncio.IncompleteReadError:
                    return  # the sender closed the stream
                if size > self.max_bytes:
                    raise DataPlaneError(f"a frame of {size} bytes exceeds the limit of {self.max_bytes}")
                async with asyncio.timeout(FRAME_BODY_TIMEOUT_S):
                    body = await reader.readexactly(size)
                frame = pb.Frame.FromString(body)
                await self.on_frame(frame)
                # A frame already read comes back without a wait: between two (a long prompt's chunks, one
                # after another) the loop runs what else is due: the writer passes the last one on, lease
                # renewals and Health are answered.
                await asyncio.sleep(0)
        except (TimeoutError, DataPlaneError, DecodeError, asyncio.IncompleteReadError) as e:
            log.warning("data plane: closed the stream from %s: %s", peer, e or type(e).__name__)
        except (ConnectionError, OSError) as e:
            log.info("data plane: stream from %s ended: %s", peer, e)
        except asyncio.CancelledError:
            if not self._closing:
                raise
            # (closed by `close`: an ending, not an error for asyncio to log with a traceback)
        finally:
            writer.close()
            if task is not None:
                self._tasks.discard(task)


def hold_plaintext(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Before TLS starts on a stream: read nothing more until it has, and refuse bytes that came after the
    hello. The stream's reader keeps what it holds across start_tls, so plaintext someone on the path
    appended would be read as if it had come through TLS."""
    writer.transport.pause_reading()  # (start_tls resumes reading, into TLS)
    if getattr(reader, "_buffer", b""):  # (asyncio's own buffer: no public way to ask what it holds)
        raise DataPlaneError("bytes after the hello, before TLS")


class TcpFrameLink:
    """One outgoing data-plane stream. `write` never waits for the peer unless the socket buffer is full."""

    transport = "tcp"

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.peer: tuple | None = writer.get_extra_info("peername")  # (an IPv6 one with its scope)

    @classmethod
    async def connect(cls, host: str, port: int, secret: str | None, timeout: float = HANDSHAKE_TIMEOUT_S
                      ) -> TcpFrameLink:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        _keepalive(writer.get_extra_info("socket"))
        writer.write(HELLO)
        try:
            answer = await asyncio.wait_for(reader.readexactly(2), timeout)
        except TimeoutError:
            writer.close()
            raise TimeoutError(f"{host}:{port} did not answer the data plane's hello within {timeout:.0f} s") from None
        except asyncio.IncompleteReadError:
            writer.close()
            raise DataPlaneError(f"{host}:{port} is not an mtpipe data plane") from None
        if answer != b"OK":
            writer.close()
            raise DataPlaneError(f"{host}:{port} is not an mtpipe data plane")
        if secret:
            try:
                hold_plaintext(reader, writer)
            except DataPlaneError:
                writer.close()
                raise
            await writer.start_tls(ssl_context(secret, server=False), server_hostname=NAME,
                                   ssl_handshake_timeout=timeout)
        return cls(reader, writer)

    async def write(self, frame: pb.Frame) -> None:
        self.writer.write(_encode(frame))
        await self.writer.drain()  # returns at once below the high-water mark; raises if the peer is gone

    async def wait_closed(self) -> None:
        """Returns when the peer closes the stream (it never writes on it); raises if it breaks."""
        if await self.reader.read(1):
            raise DataPlaneError("unexpected bytes from the next stage")

    async def close(self) -> None:
        """Close the stream; one the peer does not close in turn within CLOSE_TIMEOUT_S (a node that hangs:
        TLS waits for its answer for 30 s) is dropped."""
        self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), CLOSE_TIMEOUT_S)
        except TimeoutError:
            self.writer.transport.abort()
        except (ConnectionError, OSError):
            pass


# -- the node's outbound link: this data plane, or a gRPC Forward stream -----------------------------


class GrpcFrameLink:
    """Frames on a Forward stream: to a node without a data plane."""

    transport = "grpc"

    def __init__(self, stub: pb_grpc.NodeStub):
        self.call = stub.Forward()

    async def write(self, frame: pb.Frame) -> None:
        await self.call.write(frame)

    async def wait_closed(self) -> None:
        async for _ in self.call:  # the next node never answers on this stream; wait for its end
            pass

    async def close(self) -> None:
        try:
            await self.call.done_writing()
        except Exception:
            pass


def _handshake_ms(peer: tuple, timeout: float, tries: int = 3) -> float:
    """The quickest of a few TCP handshakes with `peer` (a socket address): this thread may wait for the
    interpreter after one, which is no part of the link's time."""
    best = float("inf")
    for _ in range(tries):
        with socket.socket(socket.AF_INET6 if len(peer) == 4 else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            t0 = time.perf_counter()
            sock.connect(peer)
            best = min(best, 1000.0 * (time.perf_counter() - t0))
    return best


class NextStage:
    """Where this node sends frames: the next node (or, from the last node, the first).

    `send` queues the frame and returns at once; one writer task writes them in order (a node may
    forward frames of two inbound streams: its client's and the ring's). The link is the next node's
    data plane (plain TCP, above) when its Ping reply offers one, else a gRPC Forward
    stream. If it breaks, `on_error(target, error)` runs once and the next frame opens a new link
    (or `connect`, when the pipeline is formed again); frames in flight are lost, which every client
    learns through that callback.
    """

    def __init__(self, target: str, secret: str | None, on_error: Callable[[str, Exception], None],
                 on_open: Callable[[str], None] | None = None):
        self.target = target
        self.peer_id = ""  # the node it reaches, as told (Connect) or as it answered; "" where not known
        self.secret = secret
        self.on_error = on_error
        self.on_open = on_open  # a link opened (after a break: the break is over)
        self.channel = make_aio_channel(target, secret)
        self.stub = pb_grpc.NodeStub(self.channel)
        self.link: GrpcFrameLink | TcpFrameLink | None = None
        self._queue: asyncio.Queue[pb.Frame] = asyncio.Queue()
        # Held: the loop keeps only weak references to tasks.
        self._watcher: asyncio.Task | None = None
        self._writer: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()
        self._closed = False
        self._opening = asyncio.Lock()  # (the writer and `connect` may both open the link)

    @property
    def transport(self) -> str:
        return self.link.transport if self.link is not None else ""

    def send(self, frame: pb.Frame) -> None:
        self._queue.put_nowait(frame)
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_all())

    async def _open(self) -> GrpcFrameLink | TcpFrameLink:
        # Asked at every opening: a restarted next node may listen on another data port.
        reply = await self.stub.Ping(pb.PingRequest(), timeout=CONNECT_TIMEOUT_S)
        if reply.data_port:
            host, _ = split_host_port(self.target)
            try:
                return await TcpFrameLink.connect(host, reply.data_port, self.secret, CONNECT_TIMEOUT_S)
            except DataPlaneError:
                raise  # its data port is something else
            except (TimeoutError, OSError) as e:  # a firewall, say: gRPC still gets through
                log.warning("no data plane to %s (port %d: %s); sending frames over gRPC", self.target,
                            reply.data_port, e or type(e).__name__)
        return GrpcFrameLink(self.stub)

    @property
    def closed(self) -> bool:
        return self._closed

    async def _opened(self) -> GrpcFrameLink | TcpFrameLink:
        """The link, opened if there is none (never once closed)."""
        async with self._opening:
            if self._closed:
                raise ConnectionError(f"the link to {self.target} is closed")
            if self.link is None:
                link = await self._open()
                if self._closed:  # (closed while it opened)
                    await link.close()
                    raise ConnectionError(f"the link to {self.target} is closed")
                self.link = link
                self._watcher = asyncio.get_running_loop().create_task(self._watch(link))
                if self.on_open is not None:
                    self.on_open(self.target)
            return self.link

    async def connect(self, timeout: float = RECONNECT_TIMEOUT_S) -> bool:
        """Opens the link now if it is down: once the pipeline is formed again after a break, the break
        is over, not at the next frame. False (logged) when the next node does not answer in `timeout`."""
        try:
            await asyncio.wait_for(self._opened(), timeout)
        except Exception as e:  # noqa: BLE001 (the next frame tries again, and reports what fails then)
            log.info("no link to %s yet: %s", self.target, describe_rpc_error(e))
            return False
        return True

    async def _write_all(self) -> None:
        while True:
            frame = await self._queue.get()
            link = self.link
            try:
                if link is None:
                    link = await self._opened()
                await link.write(frame)
            except Exception as e:  # the link ended under us, or could not be opened
                self._broken(link, e)

    async def _watch(self, link: GrpcFrameLink | TcpFrameLink) -> None:
        try:
            await link.wait_closed()
            error: Exception = ConnectionError("the stream was closed by the node")
        except Exception as e:
            error = e
        self._broken(link, error)

    def _broken(self, link: GrpcFrameLink | TcpFrameLink | None, error: Exception) -> None:
        if link is not None and self.link is not link:
            return  # already reported
        self.link = None
        if link is not None:
            task = asyncio.get_running_loop().create_task(link.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        if not self._closed:
            log.warning("stream to %s ended: %s", self.target, describe_rpc_error(error))
            self.on_error(self.target, error)

    async def node_id(self, timeout: float = 2.0) -> str | None:
        """The id of the node that answers at the target, None if none does."""
        try:
            reply = await self.stub.Ping(pb.PingRequest(), timeout=timeout)
        except grpc.RpcError:
            return None
        return reply.node_id

    async def ping_ms(self, timeout: float = 2.0) -> float:
        """The link's round trip, -1 when the next node does not answer a gRPC Ping. Over the data plane,
        a TCP handshake with its listener, timed on a thread of its own: the kernels answer that, so a
        loop busy in a step (the next node's, this one's) does not delay it, as it does not delay a
        frame's way either; the Ping, which waits for such a step, only says the node answers."""
        try:
            await self.stub.Ping(pb.PingRequest(), timeout=timeout)  # connects if needed
            t0 = time.perf_counter()
            await self.stub.Ping(pb.PingRequest(), timeout=timeout)
            rtt = 1000.0 * (time.perf_counter() - t0)
        except grpc.RpcError:
            return -1.0
        link = self.link
        if isinstance(link, TcpFrameLink) and link.peer:
            try:
                return await asyncio.to_thread(_handshake_ms, link.peer, timeout)
            except OSError:
                pass
        return rtt

    async def close(self) -> None:
        self._closed = True
        if self._writer is not None:
            self._writer.cancel()
        link, self.link = self.link, None
        if link is not None:
            await link.close()
        await self.channel.close(grace=None)
