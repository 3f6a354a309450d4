"""Shard tensor bytes on a plain TCP stream: the node's data-plane port, outside gRPC.

FetchTensors (weights.py) keeps the tensor list and the authorization: a request that asks for
`raw` gets, in its first (and then only) message, a one-time random token and the holder's data
port. The client connects there, sends `BULK_HELLO` and the token, reads OK (or NO: unknown, used or
expired token), and then receives the requested byte ranges back to back, sent from the files with
sendfile. A token is good for one connection within `TOKEN_TTL_S` of the gRPC call that issued it,
and only for the tensors and offset that call named: it was handed out over the authenticated
gRPC channel, so the data plane needs no cluster secret for it.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from ..models.fingerprint import TensorLoc
from .dataplane import BULK_HELLO, HANDSHAKE_TIMEOUT_S

TOKEN_BYTES = 32
TOKEN_TTL_S = 30.0
RECV_BYTES = 4 << 20
IDLE_TIMEOUT_S = 30.0  # a stalled holder


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
            sent = await loop.sendfile(writer.transport, f, start, count)
        on_sent(sent)
        if sent != count:
            raise OSError(f"{file}: truncated at byte {start + sent}")
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


def receive(sock: socket.socket, out: BinaryIO, want: int, on_data: Callable[[memoryview], None]) -> int:
    """Copy up to `want` bytes from `sock` to `out` (run in a thread), each piece also to `on_data`
    (valid only during the call); the count received."""
    buf = memoryview(bytearray(min(RECV_BYTES, max(want, 1))))
    got = 0
    while got < want:
        n = sock.recv_into(buf, min(len(buf), want - got))
        if not n:
            break
        out.write(buf[:n])
        got += n
        on_data(buf[:n])
    return got


def close(sock: socket.socket) -> None:
    """Close, waking a thread blocked in `receive`."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
