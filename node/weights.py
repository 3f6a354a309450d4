"""Where a node's shard comes from, and the tensors it serves to its peers.

A Load that names the model's fingerprint is resolved in this order:
  1. a local copy: the request's path (a hint, followed only under the node's model directories,
     model_dirs.py) or one of the node's own model copies (`--model-dir`), used only if its
     fingerprint is the requested one;
  2. the node's shard cache (shards.py), verified tensor by tensor, its entry locked against other
     nodes on this machine from the lookup until the shard is loaded (cache_lock.py);
  3. the shard's tensors fetched from the first of the request's sources that holds them (fetch.py);
  (2 and 3 only where the tensors' hashes and the config are those the request gives: the coordinator's)
  4. with `--download` and a hub repo in the request, the hub files that hold them (hub.py).
A Load without a fingerprint reads the request's path as it is, if it lies under those directories.

FetchTensors serves raw tensor bytes, by checkpoint name, of a model whose fingerprint this node
holds: a local copy that matched, or a shard cache entry holding every name asked for. It reads only
the byte ranges that the safetensors headers of that model give for those names: no other file,
nothing outside the model. The cluster's mutual TLS (tls.py) guards it like every other call. A
request with `raw` set gets a one-time token and the data port instead of the bytes, which then
travel on a plain TCP stream (bulk.py), sent from the files with sendfile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from ..models.fingerprint import (
    TOKENIZER_FILES,
    TensorLoc,
    checkpoint_index,
    file_tensors,
    is_fingerprint,
    model_fingerprint,
    raw_hf_layout,
    tensor_hashes,
)
from ..proto import mtpipe_pb2 as pb
from . import cache_lock
from .bulk import BulkGrants, serve_bulk
from .cache_lock import EntryLock
from .fetch import Transfer, fetch_shard
from .hub import HubRepo, download_shard, hub_repo
from .model_dirs import ModelDirs, env_model_dirs
from .shards import WEIGHTS, Expected, ShardCache, ShardKey

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20


@dataclass
class Found:
    path: Path
    source: str  # "local", "cache", "peer <host:port>", "path"
    fetched: int = 0
    fingerprint: str = ""
    lock: EntryLock | None = None  # a shard cache entry's, shared: nobody removes it before it is loaded

    def release(self) -> None:
        """Once the shard is in memory (or will not be loaded)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None


@dataclass
class _Held:
    """What this node serves of one model: where each tensor is, its hash, config and layout."""

    index: dict[str, TensorLoc]
    hashes: Callable[[list[str]], dict[str, str]]
    config_json: str
    raw_hf: bool
    directory: Path  # where its tokenizer files are, if it has them

    def tokenizer_files(self) -> list[pb.NamedFile]:
        return [pb.NamedFile(name=name, data=(self.directory / name).read_bytes()) for name in TOKENIZER_FILES
                if (self.directory / name).is_file()]


class WeightStore:
    def __init__(self, model_dirs: list[Path | str] | None = None, shard_cache: Path | str | None = None,
                 secret: str | None = None, download: bool = False):
        given = [Path(d).expanduser() for d in model_dirs or ()] + env_model_dirs()
        self.model_dirs = list(dict.fromkeys(given))  # (each once, in order)
        self.cache = ShardCache(shard_cache)
        self.readable = ModelDirs(self.model_dirs, self.cache.root)  # what a Load may read at all
        self.secret = secret
        self.transfer = Transfer()
        self.data_port = 0  # the node's data-plane listener, where raw transfers go (0: none)
        self.grants = BulkGrants()
        self.loaded: Found | None = None
        # The request's path is a hint of where the coordinator keeps the model; False ignores it (the
        # tests' nodes share one file system, and play machines that do not have it).
        self.path_hint = True
        self.download = download  # may fetch its shard's files from the hub (hub.py)
        self.hub_repo: Callable[[str, str], HubRepo] = hub_repo

    def add_model_dir(self, path: Path | str) -> None:
        """A local copy this node may load and serve (checked by fingerprint whenever used)."""
        path = Path(path).expanduser()
        if path not in self.model_dirs:
            self.model_dirs.append(path)

    async def _fingerprint(self, path: Path) -> str | None:
        if not (path / "config.json").is_file():
            return None
        try:
            return await asyncio.get_running_loop().run_in_executor(None, model_fingerprint, path)
        except (OSError, ValueError, KeyError) as e:
            log.warning("cannot fingerprint %s: %s", path, e)
            return None

    # -- Load -----------------------------------------------------------------------------------

    async def resolve(self, request: pb.LoadRequest) -> Found:
        """The directory to load `request`'s shard from (see the module docstring)."""
        fp = request.fingerprint
        if fp and not is_fingerprint(fp):
            raise ValueError(f"{fp[:80]!r} is not a model fingerprint")
        from ..models.shard import ShardSpec

        ShardSpec(request.start, request.end, request.num_layers)  # a layer range it has (before any fetch)
        hint = request.model_path if request.model_path and self.path_hint else ""
        refused = bool(hint) and not self.readable.allows(hint)
        if refused:  # (a warning only where nothing else can give it the shard: a peer or the hub can)
            log.log(logging.INFO if request.sources or request.hub_repo else logging.WARNING, "Load named %s: %s",
                    hint, self.readable.refusal(hint))
        if not fp:
            if refused or not hint:
                raise PermissionError(self.readable.refusal(request.model_path or "''"))
            return self._found(Found(Path(hint), "path"))
        candidates = [Path(hint)] if hint and not refused else []
        for path in candidates + [d for d in self.model_dirs if d not in candidates]:
            got = await self._fingerprint(path)
            if got == fp:
                self.add_model_dir(path)
                return self._found(Found(path, "local", 0, fp))
            if got is not None:
                log.warning("%s is another model (fingerprint %s, asked for %s): not used", path, got[:12], fp[:12])
        key = ShardKey(fp, request.start, request.end, request.num_layers, request.mtp)
        names = list(request.tensors)
        if request.tensor_sha256 and len(request.tensor_sha256) != len(names):
            raise ValueError(f"the Load names {len(names)} tensors and {len(request.tensor_sha256)} hashes")
        if request.tensor_meta and len(request.tensor_meta) != len(names):
            raise ValueError(f"the Load names {len(names)} tensors and {len(request.tensor_meta)} dtypes and shapes")
        if request.layout not in ("", "raw_hf", "mlx"):
            raise ValueError(f"unknown tensor layout {request.layout!r}")
        meta = {n: (m.dtype, tuple(m.shape)) for n, m in zip(names, request.tensor_meta)}
        expected = Expected(dict(zip(names, request.tensor_sha256)), request.config_sha256, meta,
                            request.layout == "raw_hf" if request.layout else None) \
            if request.tensor_sha256 or request.config_sha256 or meta else None
        hub = bool(self.download and request.hub_repo and names)
        loop = asyncio.get_running_loop()

        def complete() -> Awaitable[Path | None]:  # under a shared lock: look, change nothing
            return loop.run_in_executor(None, self.cache.lookup, key, names or None, False, expected)

        lock, cached = await cache_lock.hold(self.cache.root, key.fingerprint, key.dirname, complete)
        if cached is not None:
            return self._found(Found(cached, "cache", 0, fp, lock))
        try:  # held exclusively
            found = await self._from_cache(key, names, expected, request, hub, hint, refused)
        except BaseException:
            lock.release()
            raise
        if found is None:  # to the hub
            lock.release()
        else:
            try:
                await loop.run_in_executor(None, lock.share)
            except BaseException:  # (a cancelled Load)
                lock.release()
                raise
            found.lock = lock
            return self._found(found)
        repo = self.hub_repo(request.hub_repo, request.hub_revision)
        path = await loop.run_in_executor(None, download_shard, repo, fp, names)
        return self._found(Found(path, f"hub {request.hub_repo}@{request.hub_revision[:12]}", 0, fp))

    async def _from_cache(self, key: ShardKey, names: list[str], expected: Expected | None, request: pb.LoadRequest,
                          hub: bool, hint: str, refused: bool) -> Found | None:
        """The shard cache's entry, fetched from a peer if need be; None: to be downloaded from the hub."""
        fp = key.fingerprint
        cached = await asyncio.get_running_loop().run_in_executor(None, self.cache.lookup, key, names or None, True,
                                                                  expected)
        if cached is not None:
            return Found(cached, "cache", 0, fp)
        if not names or not (request.sources or hub):
            where = self.readable.refusal(hint) if refused else \
                f"no local copy at {hint or 'any model directory'} with that fingerprint"
            raise FileNotFoundError(
                f"model {fp[:12]} is not here ({where}; no shard cache entry) and the request names "
                f"{'no tensors' if not names else 'no node'} to fetch it from"
                + (f" (and this node may not download {request.hub_repo} from the hub: --download)"
                   if request.hub_repo and not self.download else ""))
        if request.sources:
            try:
                received, source = await fetch_shard(self.cache, key, names, list(request.sources), self.secret,
                                                     self.transfer, expected)
                return Found(self.cache.dir(key), f"peer {source}", received, fp)
            except FileNotFoundError as e:  # no source could serve it (a full disk or a bad fingerprint is final)
                if not hub:
                    raise
                log.warning("%s; downloading the shard's files from the hub instead", e)
        return None

    def _found(self, found: Found) -> Found:
        self.loaded = found
        if found.fingerprint:
            log.info("shard of model %s from %s (%s)", found.fingerprint[:12], found.source, found.path)
        return found

    def health(self) -> pb.HealthReply:
        t, found = self.transfer, self.loaded
        return pb.HealthReply(
            fingerprint=found.fingerprint if found else "", weights_source=found.source if found else "",
            transfer_state=t.state, transfer_done=t.done, transfer_total=t.total, fetched_bytes=t.fetched_bytes,
            served_bytes=t.served_bytes)

    # -- FetchTensors ---------------------------------------------------------------------------

    async def _held(self, fp: str, names: list[str]) -> _Held | None:
        for path in list(self.model_dirs):
            if await self._fingerprint(path) == fp:
                index = await asyncio.get_running_loop().run_in_executor(None, checkpoint_index, path)
                return _Held(index, lambda ns, p=path: tensor_hashes(p, ns), (path / "config.json").read_text(),
                             raw_hf_layout(index), path)
        entry = await asyncio.get_running_loop().run_in_executor(None, self.cache.holding, fp, names)
        if entry is None:
            return None
        d, m = entry
        hashes = {t.name: t.sha256 for t in m.tensors}
        return _Held(file_tensors(d / WEIGHTS), lambda ns: {n: hashes[n] for n in ns}, (d / "config.json").read_text(),
                     m.raw_hf, d)

    async def serve(self, request: pb.FetchRequest, context: grpc.aio.ServicerContext, node: str) -> AsyncIterator:
        names = list(request.names)
        if not names:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{node}: no tensor names asked for")
        if len(set(names)) != len(names):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{node}: a tensor is asked for twice")
        if not is_fingerprint(request.fingerprint):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{node}: {request.fingerprint[:80]!r} is not a model fingerprint")
        try:
            held = await self._held(request.fingerprint, names)
        except (OSError, ValueError) as e:  # a damaged copy or cache entry: the asker tries another source
            log.warning("cannot serve model %s: %s", request.fingerprint[:12], e)
            await context.abort(grpc.StatusCode.DATA_LOSS, f"{node}: its copy of the model is damaged")
        if held is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"{node} holds no model with fingerprint {request.fingerprint[:16]!r}")
        unknown = [n for n in names if n not in held.index]
        if unknown:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{node}: the model has no tensor {unknown[0]!r}"
                                + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
        locs = [held.index[n] for n in names]
        total = sum(t.size for t in locs)
        if not 0 <= request.offset <= total:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, f"{node}: offset {request.offset} beyond {total} bytes")
        loop = asyncio.get_running_loop()
        hashes = await loop.run_in_executor(None, held.hashes, names)
        files = await loop.run_in_executor(None, held.tokenizer_files) if request.tokenizer else []
        raw = bool(request.raw and self.data_port)
        yield pb.TensorChunk(
            tensors=[pb.TensorInfo(name=t.name, dtype=t.dtype, shape=t.shape, size=t.size, sha256=hashes[t.name])
                     for t in locs],
            total_bytes=total, config_json=held.config_json, raw_hf=held.raw_hf, files=files,
            token=self.grants.issue(locs, request.offset) if raw else b"", data_port=self.data_port if raw else 0)
        log.info("serving %d tensors (%.1f MiB from byte %d) of model %s%s", len(locs), total / 2**20,
                 request.offset, request.fingerprint[:12], f" on data port {self.data_port}" if raw else "")
        if raw:
            return
        offset = request.offset
        while offset < total:
            try:
                data = await loop.run_in_executor(None, _read_stream, locs, offset, CHUNK_BYTES)
            except OSError as e:
                log.warning("serving model %s failed: %s", request.fingerprint[:12], e)
                await context.abort(grpc.StatusCode.DATA_LOSS, f"{node}: its copy of the model is damaged")
            yield pb.TensorChunk(offset=offset, data=data)
            offset += len(data)
            self.transfer.served_bytes += len(data)

    async def serve_bulk(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A data-plane connection that opened with bulk.BULK_HELLO: the bytes a FetchTensors token grants."""

        def sent(n: int) -> None:
            self.transfer.served_bytes += n

        await serve_bulk(self.grants, reader, writer, sent)


def _read_stream(locs: list[TensorLoc], offset: int, limit: int) -> bytes:
    """Up to `limit` bytes of the tensors' concatenated bytes, from `offset` on."""
    out: list[bytes] = []
    got, pos = 0, 0
    for t in locs:
        if got >= limit:
            break
        end = pos + t.size
        if end > offset + got:
            start = offset + got - pos
            n = min(t.size - start, limit - got)
            with open(t.file, "rb") as f:
                f.seek(t.start + start)
                piece = f.read(n)
            if len(piece) != n:
                raise OSError(f"{t.file}: truncated at tensor {t.name}")
            out.append(piece)
            got += n
        pos = end
    return b"".join(out)

