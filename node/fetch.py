"""Fetching a shard's tensors from a peer into the shard cache (shards.py), on the node's event loop.

The bytes of the requested tensors arrive back to back (FetchTensors) and are appended to
`model.safetensors.part` behind a header made from the first message's tensor list, so the part
file is the final file from its first byte. After an interruption (a broken stream, a killed node)
the next attempt asks for the bytes from the part file's size on, after checking that its header is
the one the source describes. Every tensor's hash is checked against the source's list as its bytes
arrive (shards.StreamVerifier, beside the receiving thread; a resumed transfer first hashes what the
part file holds), and the file moves into the cache only if all match; a mismatch drops the part
file and tries the next source.
A node without the disk space for what remains refuses before the first byte.

The bytes travel on the source's data plane (a plain TCP stream, bulk.py) when its first message
offers a token for it; otherwise (an older node, no data port, the port unreachable or the token
refused before the first byte) they come as FetchTensors chunks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ..models.fingerprint import DTYPE_BYTES, tensor_bytes
from ..proto import mtpipe_pb2 as pb
from ..proto import mtpipe_pb2_grpc as pb_grpc
from . import bulk
from .cache_admin import make_room
from .links import split_host_port
from .shards import (
    DISK_MARGIN,
    PART,
    Expected,
    Manifest,
    NoDiskSpace,
    ShardCache,
    ShardKey,
    StreamVerifier,
    TensorInfo,
    free_bytes,
    safetensors_header,
)
from .wire import make_aio_channel

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0  # for the first message (the tensor list) of a source
ROUNDS = 2  # passes over the sources (a broken stream is resumed from the same source on the next one)
LOG_EVERY_S = 5.0


class TransferInterrupted(ConnectionError):
    """Raised by the test hook `Transfer.interrupt_after`: the transfer stops as if the node were killed."""


class _SourceFailed(Exception):
    pass


class _BadBytes(Exception):
    """A tensor failed its hash: the rest of the transfer from this source is not waited for."""


@dataclass
class Transfer:
    """Progress of this node's shard transfers (HealthReply), and counters since the node started."""

    state: str = ""  # "", "fetching" (hashes checked as the bytes arrive), "done", "failed"
    done: int = 0
    total: int = 0
    source: str = ""
    transport: str = ""  # of the last transfer: "tcp" (data plane) or "grpc" (FetchTensors chunks)
    fetched_bytes: int = 0  # received from peers, all transfers
    served_bytes: int = 0  # sent to peers
    interrupt_after: int | None = None  # test hook: stop a transfer after this many bytes received

    def __post_init__(self) -> None:
        self._logged = 0.0

    def advance(self, n: int) -> None:
        self.done += n
        self.fetched_bytes += n
        now = time.monotonic()
        if now - self._logged >= LOG_EVERY_S or self.done >= self.total:
            self._logged = now
            log.info("shard transfer from %s: %.1f / %.1f MiB (%.0f%%)", self.source, self.done / 2**20,
                     self.total / 2**20, 100.0 * self.done / max(self.total, 1))


async def _next_chunk(chunks: Any, call: Any) -> Any:
    """The stream's next chunk, None at its end; a source that sends nothing for IDLE_TIMEOUT_S has
    stalled (its connection may still answer keepalives), as on the data plane."""
    try:
        return await asyncio.wait_for(chunks.__anext__(), bulk.IDLE_TIMEOUT_S)
    except StopAsyncIteration:
        return None
    except TimeoutError:
        call.cancel()
        raise _SourceFailed(f"sent nothing for {bulk.IDLE_TIMEOUT_S:.0f} s") from None


def _resume_offset(part: Path) -> int:
    """Tensor bytes already in the part file (beyond its header), 0 if there is none worth keeping."""
    if not part.exists():
        return 0
    try:
        from ..models.fingerprint import read_header

        _, data_start = read_header(part)
        return max(part.stat().st_size - data_start, 0)
    except (OSError, ValueError):
        part.unlink(missing_ok=True)
        return 0


def _leave_nothing(cache: ShardCache, key: ShardKey) -> None:
    """After a transfer failed: its entry goes, unless a part file holds what a next transfer resumes
    from (listed, and pruned, as an incomplete entry: cache_admin.py)."""
    d = cache.dir(key)
    if (d / PART).exists():
        return
    cache.discard(key)
    for empty in (d, d.parent):  # (the model's directory too, once it holds no shard)
        try:
            empty.rmdir()
        except OSError:
            break


async def fetch_shard(cache: ShardCache, key: ShardKey, names: list[str], sources: list[str], secret: str | None,
                      progress: Transfer, expected: Expected | None = None) -> tuple[int, str]:
    """Fetch `names` of model `key.fingerprint` into the cache entry of `key`; (bytes received, source). A
    source whose tensors or config are not `expected` (the coordinator's) is not taken."""
    d = cache.dir(key)
    d.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    refused: set[str] = set()
    for _ in range(ROUNDS):
        for source in sources:
            if source in refused:
                continue
            try:
                received = await _fetch_from(source, cache, key, names, secret, progress, expected=expected)
                progress.state = "done"
                return received, source
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED,
                                grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INVALID_ARGUMENT):
                    refused.add(source)
                elif e.code() == grpc.StatusCode.OUT_OF_RANGE:  # a part file longer than the shard: start over
                    (cache.dir(key) / PART).unlink(missing_ok=True)
                errors.append(f"{source}: {e.code().name}: {e.details()}")
            except (TimeoutError, _SourceFailed) as e:
                errors.append(f"{source}: {e or 'no answer'}")
            except BaseException:
                progress.state = "failed"
                _leave_nothing(cache, key)
                raise
            log.warning("shard transfer from %s failed: %s", source, errors[-1])
    progress.state = "failed"
    _leave_nothing(cache, key)
    raise FileNotFoundError(f"could not fetch the shard's {len(names)} tensors from any of {', '.join(sources)}: "
                            + "; ".join(errors))


async def _fetch_from(source: str, cache: ShardCache, key: ShardKey, names: list[str], secret: str | None,
                      progress: Transfer, raw: bool = True, reask: bool = True,
                      expected: Expected | None = None) -> int:
    """One attempt from one source. `reask`: a data-plane token that aged while room was made is asked for again
    once, rather than taking the transfer to gRPC. `expected`: see fetch_shard."""
    loop = asyncio.get_running_loop()
    part = cache.dir(key) / PART
    offset = _resume_offset(part)
    async with make_aio_channel(source, secret) as channel:
        call = pb_grpc.NodeStub(channel).FetchTensors(
            pb.FetchRequest(fingerprint=key.fingerprint, names=names, offset=offset, raw=raw,
                            tokenizer=key.end == key.num_layers))  # (the last stage holds output to grammars)
        chunks = call.__aiter__()
        try:
            first = await asyncio.wait_for(chunks.__anext__(), CONNECT_TIMEOUT_S)
        except StopAsyncIteration:
            raise _SourceFailed("sent nothing") from None
        issued = time.monotonic()
        tensors = [TensorInfo(t.name, t.dtype, tuple(t.shape), t.size, t.sha256) for t in first.tensors]
        if [t.name for t in tensors] != names:
            call.cancel()
            raise _SourceFailed("answered with other tensors than asked for")
        if expected is not None and (bad := expected.mismatch(tensors, first.config_json, first.raw_hf)):
            call.cancel()
            raise _SourceFailed(f"serves another copy of the model: {bad}")
        if wrong := next((t for t in tensors if t.dtype not in DTYPE_BYTES or t.size != tensor_bytes(t.dtype, t.shape)
                          or min(t.shape, default=0) < 0), None):  # (believed, it would make room on the disk)
            call.cancel()
            raise _SourceFailed(f"claims {wrong.size} bytes for tensor {wrong.name}, {wrong.dtype} {list(wrong.shape)}")
        header = safetensors_header(tensors)
        total = sum(t.size for t in tensors)
        if offset and (await loop.run_in_executor(None, _head, part, len(header))) != header:
            call.cancel()
            log.info("%s holds another transfer; starting over", part)
            part.unlink()
            return await _fetch_from(source, cache, key, names, secret, progress, raw, reask, expected)
        need = total - offset + (0 if offset else len(header))
        free = await loop.run_in_executor(None, free_bytes, part.parent)
        if free < need + DISK_MARGIN:  # make room: other cached shards, least recently used first
            free = await loop.run_in_executor(None, make_room, cache.root, need + DISK_MARGIN, free, part.parent,
                                              free_bytes)
        if free < need + DISK_MARGIN:
            call.cancel()
            raise NoDiskSpace(f"not enough disk space for the shard: {need / 2**30:.2f} GiB to fetch into "
                              f"{part.parent}, {free / 2**30:.2f} GiB free")
        if reask and first.token and time.monotonic() - issued > bulk.TOKEN_TTL_S / 2:
            call.cancel()
            log.info("the data-plane token from %s aged while room was made; asking again", source)
            return await _fetch_from(source, cache, key, names, secret, progress, raw, False, expected)
        progress.state, progress.source, progress.total, progress.done = "fetching", source, total, offset
        if offset:
            log.info("resuming the shard transfer from %s at %.1f of %.1f MiB", source, offset / 2**20, total / 2**20)
        received = 0

        def count(n: int) -> None:  # in the receiving thread on the data plane
            nonlocal received
            received += n
            progress.advance(n)
            if verifier.problem is not None:
                raise _BadBytes
            if progress.interrupt_after is not None and received >= progress.interrupt_after:
                raise TransferInterrupted(f"transfer stopped after {received} bytes (test hook)")

        fallback, sock, resumed_at = False, None, offset
        f = await loop.run_in_executor(None, open, part, "ab" if offset else "wb")
        verifier = StreamVerifier(tensors)  # (its thread, once the part file is open: `finish` ends it)
        try:
            if first.token and first.data_port:  # before a large part file is hashed: the token is short-lived
                host = split_host_port(source)[0]
                try:
                    sock = await loop.run_in_executor(None, bulk.connect, host, first.data_port, first.token)
                except (TimeoutError, OSError) as e:
                    log.warning("no data plane to %s (port %d: %s); fetching over gRPC", source, first.data_port, e)
                    fallback = True
            if offset:  # what the part file holds goes through the hashes first
                if await loop.run_in_executor(None, _feed_part, part, len(header), offset, verifier):
                    raise _BadBytes
            if not offset:
                f.write(header)
            if sock is not None:
                progress.transport = "tcp"
                try:
                    offset += await loop.run_in_executor(None, bulk.receive, sock, f, total - offset,
                                                       verifier.feed, count)
                except TransferInterrupted:
                    raise
                except bulk.WriteFailed as e:  # (final, as over gRPC: no other source would fit either)
                    raise OSError(e.errno, f"writing {part}: {e.strerror}") from e
                except OSError as e:
                    raise _SourceFailed(f"the data-plane stream broke: {e}") from e
            elif not fallback:
                progress.transport = "grpc"
            while (chunk := await _next_chunk(chunks, call)) is not None:
                if chunk.offset != offset:
                    call.cancel()
                    raise _SourceFailed(f"sent bytes at {chunk.offset}, expected {offset}")
                try:
                    await loop.run_in_executor(None, f.write, chunk.data)
                except OSError as e:
                    raise OSError(e.errno, f"writing {part}: {e.strerror or e}") from e
                verifier.feed(chunk.data)
                if verifier.problem is not None:
                    raise _BadBytes
                offset += len(chunk.data)
                received += len(chunk.data)
                progress.advance(len(chunk.data))
                if progress.interrupt_after is not None and received >= progress.interrupt_after:
                    call.cancel()
                    raise TransferInterrupted(f"transfer stopped after {received} bytes (test hook)")
        except _BadBytes:
            call.cancel()
        finally:
            if sock is not None:
                bulk.close(sock)
            try:
                f.close()  # (a full disk may fail it)
            finally:
                problem = await loop.run_in_executor(None, verifier.finish)  # the thread ends either way
    if verifier.problem is not None:  # no byte of this part is kept
        part.unlink(missing_ok=True)
        if verifier.problem_at < resumed_at:  # in what an earlier transfer left: not this source's bytes
            log.info("%s failed its hashes (%s); starting over", part, verifier.problem)
            return await _fetch_from(source, cache, key, names, secret, progress, raw, reask, expected)
        raise _SourceFailed(f"verification failed ({verifier.problem}); the part file is dropped")
    if fallback:
        return await _fetch_from(source, cache, key, names, secret, progress, False, reask, expected)
    if offset != total:
        raise _SourceFailed(f"the stream ended at {offset} of {total} bytes")
    if problem is not None:
        part.unlink(missing_ok=True)
        raise _SourceFailed(f"verification failed ({problem}); the part file is dropped")
    manifest = Manifest(key.fingerprint, key.start, key.end, key.num_layers, key.mtp, first.raw_hf, tensors)
    await loop.run_in_executor(None, cache.complete, key, manifest, first.config_json,
                               {f.name: f.data for f in first.files})
    log.info("shard [%d, %d) of model %s: %.1f MiB fetched from %s", key.start, key.end, key.fingerprint[:12],
             received / 2**20, source)
    return received


def _feed_part(part: Path, data_start: int, size: int, verifier: StreamVerifier) -> str | None:
    """What a part file holds, through the hashes; what is wrong with it."""
    with open(part, "rb") as f:
        f.seek(data_start)
        while size > 0:
            block = f.read(min(bulk.RECV_BYTES, size))
            if not block:
                raise OSError(f"{part}: shorter than its resume offset")
            verifier.feed(block)
            if verifier.problem is not None:
                break
            size -= len(block)
    return verifier.settle()


def _head(path: Path, n: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)
