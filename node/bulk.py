"""Shard tensor bytes on a plain TCP stream: the node's data-plane port, outside gRPC.

FetchTensors (weights.py) keeps the tensor list and the authorization: a request that asks for
`raw` gets, in its first (and then only) message, a one-time random token and the holder's data
port. The client connects there, sends `BULK_HELLO` and the token, reads OK (or NO: unknown, used or
expired token), and then receives the requested byte ranges back to back, sent from the files with
sendfile. A token is good for one connection within `TOKEN_TTL_S` of the gRPC call that issued it,
and only for the tensors and offset that call named: it was handed out over the authenticated
gRPC channel (TLS keyed by the cluster secret). The bytes themselves travel in the clear, sent
with sendfile: they are the model's weights, and each tensor is checked against the hash in the
fingerprint the client got over that authenticated channel, so altered or replayed bytes fail.
"""

from __future__ import annotations

import asyncio
import hashlib
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from ..models.fingerprint import TensorLoc
from .dataplane import BULK_HELLO, HANDSHAKE_TIMEOUT_S

TOKEN_BYTES = 32
TOKEN_TTL_S = 30.0
RECV_BYTES = 4 << 20
BUFFERS = 4  # receive buffers in turn: one filling while the others are written and hashed
IDLE_TIMEOUT_S = 30.0  # a stalled holder, or fetcher
SEND_PIECE = 32 << 20  # a holder sends a range in pieces of this many bytes, each within IDLE_TIMEOUT_S


class BulkRefused(ConnectionError):
    """The holder's data plane did not accept the token (or is not an mtpipe data plane)."""


@dataclass
class _Grant:
    locs: list[TensorLoc]
    offset: int
    expires: float


class BulkGrants:
    """One-time tokens issued by FetchTensors; keyed by the token's hash."""

    def __init__(self) -> None:
        self._grants: dict[bytes, _Grant] = {}

    def issue(self, locs: list[TensorLoc], offset: int) -> bytes:
        now = time.monotonic()
        self._grants = {k: g for k, g in self._grants.items() if g.expires > now}
        token = secrets.token_bytes(TOKEN_BYTES)
        self._grants[hashlib.sha256(token).digest()] = _Grant(locs, offset, now + TOKEN_TTL_S)
        return token

    def take(self, token: bytes) -> _Grant | None:
        grant = self._grants.pop(hashlib.sha256(token).digest(), None)
        return grant if grant is not None and grant.expires > time.monotonic() else None


def _ranges(locs: list[TensorLoc], offset: int) -> list[tuple[str, int, int]]:
    """(file, start, count) of the tensors' concatenated bytes from `offset` on; adjacent ranges merged."""
    out: list[tuple[str, int, int]] = []
    pos = 0
    for t in locs:
        end = pos + t.size
        if end > offset:
            skip = max(offset - pos, 0)
            file, start, count = str(t.file), t.start + skip, t.size - skip
            if out and out[-1][0] == file and out[-1][1] + out[-1][2] == start:
                out[-1] = (file, out[-1][1], out[-1][2] + count)
            else:
                out.append((file, start, count))
        pos = end
    return out


async def serve_bulk(grants: BulkGrants, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     on_sent: Callable[[int], None]) -> None:
    """After `BULK_HELLO` (read by the listener): check the token, then send the granted bytes."""
    token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), HANDSHAKE_TIMEOUT_S)
    grant = grants.take(token)
    writer.write(b"OK" if grant is not None else b"NO")
    await writer.drain()
    if grant is None:
        return
    loop = asyncio.get_running_loop()
    for file, start, count in _ranges(grant.locs, grant.offset):
        with await loop.run_in_executor(None, open, file, "rb") as f:
            # In pieces, each given IDLE_TIMEOUT_S: a fetcher that stopped taking bytes (stopped, cut
            # off: its kernel still answers) must not hold this coroutine and the file for ever.
            for at in range(start, start + count, SEND_PIECE):
                n = min(SEND_PIECE, start + count - at)
                try:
                    sent = await asyncio.wait_for(loop.sendfile(writer.transport, f, at, n), IDLE_TIMEOUT_S)
                except TimeoutError:
                    raise TimeoutError(f"the fetcher took less than {n >> 20} MiB in {IDLE_TIMEOUT_S:.0f} s") from None
                on_sent(sent)
                if sent != n:
                    raise OSError(f"{file}: truncated at byte {at + sent}")
    await writer.drain()


def connect(host: str, port: int, token: bytes, timeout: float = HANDSHAKE_TIMEOUT_S) -> socket.socket:
    """A blocking socket on which the granted bytes follow (run in a thread)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.sendall(BULK_HELLO + token)
        answer = b""
        while len(answer) < 2:
            piece = sock.recv(2 - len(answer))
            if not piece:
                break
            answer += piece
        if answer != b"OK":
            raise BulkRefused(f"{host}:{port} refused the transfer token" if answer == b"NO"
                              else f"{host}:{port} is not an mtpipe data plane")
        sock.settimeout(IDLE_TIMEOUT_S)
        return sock
    except BaseException:
        sock.close()
        raise


class _Piece:
    """A filled receive buffer on its way to the writer and the hasher; back to the pool after both."""

    def __init__(self, buf: bytearray, n: int, pool: queue.SimpleQueue):
        self.view = memoryview(buf)[:n]
        self._buf, self._pool, self._left, self._lock = buf, pool, 2, threading.Lock()

    def done(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._pool.put(self._buf)


class WriteFailed(OSError):
    """Writing what was received failed (a full disk): this node's fault, not the sender's."""


def receive(sock: socket.socket, out: BinaryIO, want: int, hash_piece: Callable[[memoryview, Callable[[], None]], None],
            on_bytes: Callable[[int], None]) -> int:
    """Copy up to `want` bytes from `sock` to `out`; the count received. This thread receives into a
    few large buffers in turn, a second one writes them and `hash_piece(view, done)` hashes them (it
    calls `done` when finished with the view), so receiving, writing and hashing overlap and no byte
    is copied in Python."""
    pool: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
    for _ in range(BUFFERS):
        pool.put(bytearray(min(RECV_BYTES, max(want, 1))))
    writes: queue.SimpleQueue[_Piece | None] = queue.SimpleQueue()
    failed: list[BaseException] = []

    def write() -> None:
        while (piece := writes.get()) is not None:
            try:
                if not failed:
                    out.write(piece.view)
            except BaseException as e:  # handed to the receiving thread, which raises it
                failed.append(e)
            finally:
                piece.done()

    writer = threading.Thread(target=write, name="shard-write", daemon=True)
    writer.start()
    got = 0
    try:
        while got < want and not failed:
            buf = pool.get()
            view, n = memoryview(buf), 0
            room = min(len(buf), want - got)
            while n < room:  # fill the buffer: fewer, larger writes and hash calls
                k = sock.recv_into(view[n:room])
                if not k:
                    break
                n += k
            view.release()
            if not n:
                pool.put(buf)
                break
            piece = _Piece(buf, n, pool)
            writes.put(piece)
            hash_piece(piece.view, piece.done)
            got += n
            on_bytes(n)
            if n < room:  # the sender closed
                break
    finally:
        writes.put(None)
        writer.join()
    if failed:
        if isinstance(failed[0], OSError):
            raise WriteFailed(failed[0].errno, failed[0].strerror or str(failed[0])) from failed[0]
        raise failed[0]
    return got


def close(sock: socket.socket) -> None:
    """Close, waking a thread blocked in `receive`."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
