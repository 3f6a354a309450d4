"""A model's identity, from its files alone (no MLX): what every node checks before it serves a model.

The fingerprint is the sha256 of a canonical JSON of: config.json's content, the hash of each
tokenizer file, every tensor's name, dtype and shape (from the safetensors headers, nothing loaded),
and each safetensors file's content hash. Two copies with the same names and shapes but one weight
changed have different fingerprints.

Hashing a file is a streamed pass over it that also hashes each tensor's bytes (by the offsets in
its header), so the per-tensor hashes a shard transfer is verified with come with the file's hash.
Both are kept in a sidecar (`.mtpipe-hashes.json` in the model directory, keyed by each file's size
and mtime), so fingerprinting a large model again reads only its headers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import struct
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .names import shard_tensors

log = logging.getLogger(__name__)

FORMAT = "mtpipe-fingerprint-1"
SIDECAR = ".mtpipe-hashes.json"
SHARD_MANIFEST = "mtpipe-shard.json"  # in a node's shard cache directory (node/shards.py)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json")
# What a tokenizer is read from: without any of these, transformers builds an empty one.
TOKENIZER_SOURCES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
FINGERPRINT = re.compile(r"[0-9a-f]{64}")
READ_BYTES = 8 << 20
MAX_HEADER_BYTES = 100 << 20

_lock = threading.Lock()
_memo: dict[tuple[str, int, int], FileHashes] = {}  # (file, size, mtime_ns) -> hashes, this process


@dataclass(frozen=True)
class TensorLoc:
    """Where one tensor's bytes are: `size` bytes at absolute offset `start` of `file`."""

    name: str
    file: Path
    start: int
    size: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class FileHashes:
    sha256: str
    tensors: dict[str, str]  # tensor name -> sha256 of its raw bytes


def read_header(file: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header and the offset its data starts at."""
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{file}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{file}: not a safetensors file (header of {n} bytes)")
        header = json.loads(f.read(n))
    return header, 8 + n


# Bytes per element of each safetensors dtype (sizes from headers, before any data is read).
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2,
               "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def tensor_bytes(dtype: str, shape: Sequence[int]) -> int:
    """A tensor's size from its safetensors dtype and shape (an unknown dtype counts 2 bytes)."""
    return math.prod(shape) * DTYPE_BYTES.get(dtype, 2)


def file_tensors(file: Path) -> dict[str, TensorLoc]:
    """Where each tensor of a safetensors file lies; ValueError for a header that does not say."""
    header, data_start = read_header(file)
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in meta["data_offsets"])
            dtype, shape = str(meta["dtype"]), tuple(int(n) for n in meta["shape"])
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{file}: the header's entry for {name!r} is malformed") from None
        if not 0 <= begin <= end or min(shape, default=0) < 0:
            raise ValueError(f"{file}: the header's entry for {name!r} is malformed")
        out[name] = TensorLoc(name, file, data_start + begin, end - begin, dtype, shape)
    return out


def is_fingerprint(value: str) -> bool:
    """A model fingerprint as this module writes it (a sha256 in hex): a name, never a path."""
    return FINGERPRINT.fullmatch(value) is not None


INDEX = "model.safetensors.index.json"


def missing_files(model_dir: Path | str) -> list[str]:
    """The weight files the directory's index lists and it lacks (a download that stopped halfway); none
    without an index. ValueError for an index that cannot be read."""
    index = Path(model_dir) / INDEX
    if not index.is_file():
        return []
    try:
        listed = set(json.loads(index.read_text()).get("weight_map", {}).values())
    except (OSError, AttributeError) as e:  # (JSON that is no object has no .get; bad JSON is a ValueError)
        raise ValueError(f"{index}: {e}") from None
    return sorted(f for f in listed if isinstance(f, str) and not (Path(model_dir) / f).is_file())


def weight_files(model_dir: Path | str) -> list[Path]:
    """The directory's safetensors files; FileNotFoundError naming those its index lists and it lacks,
    rather than the tensors they held."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    try:
        missing = missing_files(model_dir)
    except ValueError:
        return files  # (an index that says nothing usable: the files are what there is)
    if missing:
        raise FileNotFoundError(f"{model_dir}: {', '.join(missing)}, listed in {INDEX}, "
                                f"{'is' if len(missing) == 1 else 'are'} missing (a download that did not finish?)")
    return files


def checkpoint_index(model_dir: Path | str) -> dict[str, TensorLoc]:
    """Every tensor of a checkpoint directory under its checkpoint name (a later file wins, as in loading)."""
    index: dict[str, TensorLoc] = {}
    for f in weight_files(model_dir):
        index.update(file_tensors(f))
    return index


def raw_hf_layout(index: dict[str, TensorLoc]) -> bool:
    """Raw HF checkpoints keep conv1d as [C, 1, K]; converted ones as [C, K, 1] (loading.is_raw_hf)."""
    for name, loc in index.items():
        if name.endswith("conv1d.weight"):
            return loc.shape[-1] != 1
    return False


def hash_range(file: Path, start: int, size: int) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        f.seek(start)
        left = size
        while left > 0:
            block = f.read(min(READ_BYTES, left))
            if not block:
                raise ValueError(f"{file}: truncated ({left} bytes missing at offset {start + size - left})")
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def _hash_file(file: Path) -> FileHashes:
    """One pass over the file: its sha256 and each tensor's, from the bytes as they stream by."""
    tensors = sorted(file_tensors(file).values(), key=lambda t: t.start)
    hashers = [hashlib.sha256() for _ in tensors]
    whole = hashlib.sha256()
    pos, i = 0, 0
    with open(file, "rb") as f:
        while block := f.read(READ_BYTES):
            whole.update(block)
            end = pos + len(block)
            view = memoryview(block)
            j = i
            while j < len(tensors) and tensors[j].start < end:
                t = tensors[j]
                lo, hi = max(t.start, pos), min(t.start + t.size, end)
                if hi > lo:
                    hashers[j].update(view[lo - pos : hi - pos])
                if t.start + t.size <= end:
                    j += 1
                    i = j
                else:
                    break
            pos = end
    return FileHashes(whole.hexdigest(), {t.name: h.hexdigest() for t, h in zip(tensors, hashers)})


def _sidecar(model_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((model_dir / SIDECAR).read_text())
        return data if data.get("format") == FORMAT else {}
    except (OSError, ValueError):
        return {}


def _write_sidecar(model_dir: Path, files: dict[str, Any]) -> None:
    path = model_dir / SIDECAR
    tmp = path.with_name(f"{SIDECAR}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(json.dumps({"format": FORMAT, "files": files}))
        os.replace(tmp, path)
    except OSError as e:  # a read-only copy: hashed again next time
        log.debug("cannot keep file hashes in %s: %s", path, e)
        tmp.unlink(missing_ok=True)


def file_hashes(model_dir: Path | str, names: Collection[str] | None = None) -> dict[str, FileHashes]:
    """Hashes of every safetensors file of a directory (or of the files `names`), from the sidecar
    where size and mtime still match."""
    model_dir = Path(model_dir)
    everything = weight_files(model_dir)
    files = everything if names is None else [f for f in everything if f.name in names]
    out: dict[str, FileHashes] = {}
    stale = False
    stored = _sidecar(model_dir).get("files", {})
    for f in files:
        st = f.stat()
        key = (str(f.resolve()), st.st_size, st.st_mtime_ns)
        with _lock:
            memo = _memo.get(key)
        entry = stored.get(f.name, {})
        if memo is None and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
            memo = FileHashes(entry["sha256"], dict(entry["tensors"]))
        if memo is None:
            log.info("hashing %s (%.1f MiB)", f, st.st_size / 2**20)
            memo = _hash_file(f)
            stale = True
        with _lock:
            _memo[key] = memo
        if not stale and entry.get("sha256") != memo.sha256:
            stale = True
        out[f.name] = memo
        stored[f.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": memo.sha256,
                          "tensors": memo.tensors}
    if stale:
        present = {f.name for f in everything}
        _write_sidecar(model_dir, {k: v for k, v in stored.items() if k in present})
    return out


def tensor_hashes(model_dir: Path | str, names: list[str]) -> dict[str, str]:
    """The sha256 of each named tensor's raw bytes, as stored (KeyError for a name the model lacks)."""
    index = checkpoint_index(model_dir)
    hashes = file_hashes(model_dir)
    return {n: hashes[index[n].file.name].tensors[n] for n in names}


def identity(model_dir: Path | str) -> dict[str, Any]:
    """What the fingerprint is a hash of."""
    model_dir = Path(model_dir)
    config_file = model_dir / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    tokenizer = {}
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            tokenizer[name] = hashlib.sha256((model_dir / name).read_bytes()).hexdigest()
    index = checkpoint_index(model_dir)
    return identity_of(json.loads(config_file.read_text()), tokenizer,
                       {n: (t.dtype, t.shape) for n, t in index.items()},
                       {name: h.sha256 for name, h in file_hashes(model_dir).items()})


def identity_of(config: dict[str, Any], tokenizer: dict[str, str], tensors: dict[str, tuple[str, Any]],
                files: dict[str, str]) -> dict[str, Any]:
    """The identity from its parts, wherever they were read (a directory, or a hub repo's metadata):
    config.json's content, tokenizer file -> sha256, tensor -> (dtype, shape), safetensors file -> sha256."""
    return {
        "format": FORMAT,
        "config": config,
        "tokenizer": dict(sorted(tokenizer.items())),
        "tensors": {n: [dtype, list(shape)] for n, (dtype, shape) in sorted(tensors.items())},
        "files": dict(sorted(files.items())),
    }


def shard_names(model_dir: Path | str, start: int, end: int, num_layers: int, mtp: bool) -> list[str]:
    """The checkpoint names of the tensors a shard of layers [start, end) reads (models/names.py)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return shard_tensors(checkpoint_index(model_dir), config, start, end, num_layers, mtp)


def config_sha256(config_json: str) -> str:
    """config.json's content as the fingerprint takes it (parsed, canonical), hashed."""
    return hashlib.sha256(canonical_json(json.loads(config_json))).hexdigest()


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def model_fingerprint(model_dir: Path | str) -> str:
    """The model's identity as 64 hex digits (see the module docstring)."""
    return digest(identity(model_dir))


def digest(identity: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(identity)).hexdigest()
