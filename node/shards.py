"""A node's shard cache: the tensors of the shards it fetched, by model fingerprint and layer range.

    $MTPIPE_SHARD_CACHE (default ~/.cache/mtpipe/shards)/<fingerprint>/<start>-<end>-<mtp>/
        config.json             the model's, as served with the tensors
        model.safetensors       exactly the shard's tensors, under their checkpoint names, bytes as stored
        model.safetensors.part  while a transfer is under way (resumed from its size)
        mtpipe-shard.json       the manifest, written last: fingerprint, layer range, every tensor's
                                dtype, shape, size and sha256, and the model's layout (raw HF or not)

load_shard reads such a directory as any checkpoint (it takes the layout from the manifest: a few
layers may hold no tensor that tells). An entry counts only once every tensor's hash matches its
manifest (checked as the bytes arrive, StreamVerifier); one that does not is deleted and fetched
again. The manifest also records the weights file's size and modification time when it was
verified: a later load trusts an unchanged file and hashes it again only when either differs.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import queue
import shutil
import struct
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..models.fingerprint import SHARD_MANIFEST, TOKENIZER_FILES, file_tensors, hash_range, is_fingerprint
from ..models.fingerprint import config_sha256 as config_hash

log = logging.getLogger(__name__)

CACHE_ENV = "MTPIPE_SHARD_CACHE"
WEIGHTS = "model.safetensors"
PART = WEIGHTS + ".part"
MANIFEST_FORMAT = "mtpipe-shard-1"


def cache_root(root: Path | str | None = None) -> Path:
    if root is not None:
        return Path(root).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mtpipe" / "shards"


DISK_MARGIN = 64 << 20  # left free on a disk that takes weights


class NoDiskSpace(ValueError):
    """Weights that would not fit on the disk that is to hold them (a peer's shard, hub files)."""


def free_bytes(path: Path) -> int:
    """Free space on the file system that holds `path` (its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


@dataclass(frozen=True)
class ShardKey:
    fingerprint: str
    start: int
    end: int
    num_layers: int
    mtp: bool

    @property
    def dirname(self) -> str:
        return f"{self.start}-{self.end}-{int(self.mtp)}"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    size: int
    sha256: str


@dataclass(frozen=True)
class Expected:
    """What the coordinator's copy of the model holds (LoadRequest): a shard fetched from a peer or kept in
    the cache counts only if it matches, not only the hashes its source sent."""

    tensors: dict[str, str]  # name -> sha256
    config_sha256: str = ""
    meta: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # name -> (dtype, shape)
    raw_hf: bool | None = None  # how the coordinator's copy stores its tensors (None: not said)

    def mismatch(self, tensors: list[TensorInfo], config_json: str, raw_hf: bool | None = None) -> str | None:
        """None if the tensors (hashes, dtypes, shapes), their layout and the config are the coordinator's;
        else what differs. The same bytes under another dtype or shape, or read as another layout,
        are other weights."""
        for t in tensors:
            if t.name in self.tensors and t.sha256 != self.tensors[t.name]:
                return (f"tensor {t.name} is not the coordinator's (sha256 {t.sha256[:12]}, expected "
                        f"{self.tensors[t.name][:12]})")
            if t.name in self.meta and (t.dtype, tuple(t.shape)) != self.meta[t.name]:
                return (f"tensor {t.name} is {t.dtype} {list(t.shape)}, the coordinator's "
                        f"{self.meta[t.name][0]} {list(self.meta[t.name][1])}")
        if self.raw_hf is not None and raw_hf is not None and raw_hf != self.raw_hf:
            return "its tensors are laid out as " + ("raw Hugging Face ones" if raw_hf else "converted ones")
        if self.config_sha256:
            try:
                ok = config_hash(config_json) == self.config_sha256
            except ValueError:
                ok = False
            if not ok:
                return "config.json is not the coordinator's"
        return None


def safetensors_header(tensors: list[TensorInfo]) -> bytes:
    """The header (length prefix included) of a file holding `tensors` back to back, in this order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.size]}
        offset += t.size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data 8-byte aligned, as the safetensors writers do
    return struct.pack("<Q", len(raw)) + raw


def verify_file(file: Path, tensors: list[TensorInfo]) -> str | None:
    """None if `file` holds exactly `tensors` with their hashes; else what is wrong."""
    try:
        held = file_tensors(file)
    except (OSError, ValueError, KeyError) as e:
        return f"unreadable: {e}"
    if set(held) != {t.name for t in tensors}:
        return "holds other tensors than its manifest"
    for t in tensors:
        loc = held[t.name]
        if loc.size != t.size or loc.dtype != t.dtype or loc.shape != tuple(t.shape):
            return f"{t.name}: header differs from the manifest"
        try:
            if hash_range(file, loc.start, loc.size) != t.sha256:
                return f"{t.name}: content hash differs"
        except (OSError, ValueError) as e:
            return f"{t.name}: {e}"
    return None


@dataclass
class Manifest:
    fingerprint: str
    start: int
    end: int
    num_layers: int
    mtp: bool
    raw_hf: bool
    tensors: list[TensorInfo]
    format: str = MANIFEST_FORMAT
    # the weights file as verified: (size, mtime_ns); an entry without them is hashed at every lookup
    verified_size: int = -1
    verified_mtime_ns: int = -1

    @property
    def total_bytes(self) -> int:
        return sum(t.size for t in self.tensors)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def read(cls, path: Path) -> Manifest:
        data = json.loads(path.read_text())
        if data.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"{path}: not a shard manifest of format {MANIFEST_FORMAT}")
        data["tensors"] = [TensorInfo(t["name"], t["dtype"], tuple(t["shape"]), t["size"], t["sha256"])
                           for t in data["tensors"]]
        return cls(**data)


def _stray_weights(d: Path) -> list[str]:
    """Weights files in an entry other than the shard's own."""
    return sorted(f.name for f in d.glob("*.safetensors") if f.name != WEIGHTS)


def _unchanged(file: Path, m: Manifest) -> bool:
    try:
        st = file.stat()
    except OSError:
        return False
    return (st.st_size, st.st_mtime_ns) == (m.verified_size, m.verified_mtime_ns)


class StreamVerifier:
    """The tensors' hashes over their bytes as they arrive, in order, on a thread of its own (hashlib
    releases the GIL, so hashing overlaps receiving): no second read of the finished file."""

    def __init__(self, tensors: list[TensorInfo]):
        self.tensors = tensors
        self._problem: str | None = None
        self._starts = list(itertools.accumulate((t.size for t in tensors), initial=0))
        self.problem_at = 0  # where the tensor that failed its hash begins, in the tensors' bytes
        self._index = -1
        self._next()
        self._queue: queue.SimpleQueue[tuple[Any, Callable[[], None] | None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="shard-verify", daemon=True)
        self._thread.start()

    def feed(self, data: bytes | memoryview, done: Callable[[], None] | None = None) -> None:
        """The next bytes of the concatenated tensors: copied, or with `done`, read in place until
        `done` is called (the caller keeps the buffer untouched until then)."""
        self._queue.put((data, done) if done is not None else (bytes(data), None))

    @property
    def problem(self) -> str | None:
        """A tensor that failed its hash so far (set by the hashing thread): the transfer can stop there."""
        return self._problem

    def settle(self) -> str | None:
        """Wait until every byte fed so far is hashed; the problem so far."""
        hashed = threading.Event()
        self._queue.put((b"", hashed.set))
        hashed.wait()
        return self._problem

    def finish(self) -> str | None:
        """None if every tensor arrived whole with its hash; else what is wrong."""
        self._queue.put(None)
        self._thread.join()
        if self._problem is None and self._index < len(self.tensors):
            return f"{self.tensors[self._index].name}: truncated"
        return self._problem

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            data, done = item
            try:
                self._hash_bytes(memoryview(data))
            finally:
                if done is not None:
                    done()

    def _hash_bytes(self, view: memoryview) -> None:
        while view and self._problem is None:
            if self._index >= len(self.tensors):
                self._problem = "more bytes than the tensors hold"
                return
            take = min(self._left, len(view))
            self._hash.update(view[:take])
            view, self._left = view[take:], self._left - take
            if self._left == 0:
                self._check()
                self._next()

    def _next(self) -> None:
        """On to the next tensor that has bytes (empty ones are checked on the way)."""
        self._index += 1
        self._hash = hashlib.sha256()
        while self._index < len(self.tensors) and self.tensors[self._index].size == 0:
            self._check()
            self._index += 1
            self._hash = hashlib.sha256()
        self._left = self.tensors[self._index].size if self._index < len(self.tensors) else 0

    def _check(self) -> None:
        t = self.tensors[self._index]
        if self._problem is None and self._hash.hexdigest() != t.sha256:
            self.problem_at = self._starts[self._index]
            self._problem = f"{t.name}: content hash differs"


class ShardCache:
    """Shard directories under one root; the blocking calls here run on an executor thread."""

    def __init__(self, root: Path | str | None = None):
        self.root = cache_root(root)

    def dir(self, key: ShardKey) -> Path:
        if not is_fingerprint(key.fingerprint):  # a path component, never a path
            raise ValueError(f"invalid model fingerprint {key.fingerprint!r}")
        return self.root / key.fingerprint / key.dirname

    def lookup(self, key: ShardKey, names: list[str] | None = None, repair: bool = True,
               expected: Expected | None = None) -> Path | None:
        """The verified directory of this shard, or None; a corrupted entry, or one that is not `expected`, is
        removed (fetched again). Without `repair` (under a shared lock, cache_lock.py) an entry that would
        need hashing or removing is left as it is, and None returned."""
        d = self.dir(key)
        manifest_file = d / SHARD_MANIFEST
        if not manifest_file.exists():
            return None
        try:
            m = Manifest.read(manifest_file)
        except (OSError, ValueError, KeyError, TypeError) as e:
            problem: str | None = f"bad manifest: {e}"
        else:
            problem = None
            if (m.fingerprint, m.start, m.end, m.num_layers, m.mtp) != (key.fingerprint, key.start, key.end,
                                                                         key.num_layers, key.mtp):
                problem = "manifest is for another shard"
            elif names is not None and sorted(names) != sorted(t.name for t in m.tensors):
                problem = "manifest lists other tensors than the shard needs"
            elif not (d / "config.json").exists():
                problem = "config.json is missing"
            elif stray := _stray_weights(d):  # a loader reads every .safetensors of a directory
                problem = f"holds weights that are not the shard's: {', '.join(stray)}"
            elif expected is not None and (bad := expected.mismatch(m.tensors, (d / "config.json").read_text(),
                                                                     m.raw_hf)):
                problem = bad
            elif not _unchanged(d / WEIGHTS, m):
                if not repair:
                    return None
                problem = verify_file(d / WEIGHTS, m.tensors)
                if problem is None:  # intact after all (copied, touched): trusted from now on
                    try:
                        self._write_manifest(d, m)
                    except OSError as e:  # (read-only: verified again next time)
                        log.debug("could not note %s as verified: %s", d, e)
        if problem is None:
            try:
                os.utime(manifest_file)  # when it was last used: the least recently used go first (cache_admin.py)
            except OSError as e:  # (a read-only cache is used as it is)
                log.debug("could not stamp %s as used: %s", manifest_file, e)
            return d
        if not repair:
            return None
        log.warning("shard cache %s is invalid (%s): removed, to be fetched again", d, problem)
        self.discard(key)
        return None

    def discard(self, key: ShardKey) -> None:
        d = self.dir(key)
        for name in (SHARD_MANIFEST, WEIGHTS, "config.json", *TOKENIZER_FILES, *_stray_weights(d)):
            (d / name).unlink(missing_ok=True)

    def complete(self, key: ShardKey, manifest: Manifest, config_json: str,
                 files: dict[str, bytes] | None = None) -> Path:
        """Move a verified .part into place and write the manifest last (the entry exists from then on).
        `files`: the model's tokenizer files, by name (others are not written)."""
        d = self.dir(key)
        (d / "config.json").write_text(config_json)
        for name, data in (files or {}).items():
            if name in TOKENIZER_FILES:
                (d / name).write_bytes(data)
        _sync(d / PART)  # on disk before a manifest vouches for it (a power loss keeps no half file)
        os.replace(d / PART, d / WEIGHTS)
        try:
            self._write_manifest(d, manifest)
        except OSError:  # (a full disk): a part again, which the next fetch resumes at its end
            with contextlib.suppress(OSError):
                os.replace(d / WEIGHTS, d / PART)
            raise
        return d

    def _write_manifest(self, d: Path, manifest: Manifest) -> None:
        """The manifest, with the weights file's size and time as verified now (written last, atomically)."""
        st = (d / WEIGHTS).stat()
        manifest.verified_size, manifest.verified_mtime_ns = st.st_size, st.st_mtime_ns
        tmp = d / (SHARD_MANIFEST + ".tmp")
        try:
            tmp.write_text(manifest.to_json())
            _sync(tmp)
            os.replace(tmp, d / SHARD_MANIFEST)
        finally:
            tmp.unlink(missing_ok=True)
        _sync(d)  # the renames too

    def holding(self, fingerprint: str, names: list[str]) -> tuple[Path, Manifest] | None:
        """A complete entry of this model that holds every one of `names` (to serve them to a peer);
        ValueError if only entries changed on disk since they were verified hold them."""
        base = self.root / fingerprint
        if not is_fingerprint(fingerprint) or not base.is_dir():
            return None
        want = set(names)
        changed = None
        for d in sorted(base.iterdir()):
            try:
                m = Manifest.read(d / SHARD_MANIFEST)
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if m.fingerprint == fingerprint and want <= {t.name for t in m.tensors} and (d / WEIGHTS).exists():
                if _unchanged(d / WEIGHTS, m):
                    return d, m
                changed = d  # (not served: its next lookup verifies it again)
        if changed is not None:
            raise ValueError(f"cache entry {changed} changed since it was verified")
        return None


def _sync(path: Path) -> None:
    """Flush a file's (or a directory's entries') writes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
