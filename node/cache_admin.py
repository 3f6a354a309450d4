"""What a node's shard cache holds, and making room in it.

Entries are removed least recently used first: a cache hit touches the entry's manifest (shards.py),
so its modification time says when the entry was last loaded or completed. A node that lacks disk
space for a shard it must fetch first removes other entries this way (fetch.py): a peer fetching one
of them then fails over to its other sources. `mtpipe cache` lists and prunes by hand. Neither removes
an entry that a node is fetching or loading (cache_lock.py).
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..models.fingerprint import FINGERPRINT, SHARD_MANIFEST
from .cache_lock import EntryLock, try_exclusive
from .shards import PART, WEIGHTS, Manifest, free_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    path: Path
    fingerprint: str
    layers: str  # the entry's directory name: <start>-<end>-<mtp 0|1>
    bytes: int  # on disk
    last_used: float  # seconds since the epoch
    complete: bool  # False: a transfer under way or interrupted (its .part)

    def to_dict(self) -> dict:
        return {"path": str(self.path), "fingerprint": self.fingerprint, "layers": self.layers, "bytes": self.bytes,
                "last_used": self.last_used, "complete": self.complete}


def _size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file())


SHARD_DIR = re.compile(r"\d+-\d+-[01]")


def entries(root: Path) -> list[Entry]:
    """Every shard directory under `root`, least recently used first. Only what the cache itself
    writes counts: <64 hex digits>/<start>-<end>-<0|1>/ holding a manifest or a part file, so a root
    pointed at the wrong directory lists (and prunes) nothing of it."""
    out = []
    if not root.is_dir():
        return out
    for model in sorted(p for p in root.iterdir() if p.is_dir() and FINGERPRINT.fullmatch(p.name)):
        for d in sorted(p for p in model.iterdir() if p.is_dir() and SHARD_DIR.fullmatch(p.name)):
            manifest = d / SHARD_MANIFEST
            if not manifest.exists() and not (d / PART).exists():
                continue
            complete = False
            if manifest.exists():
                try:
                    complete = Manifest.read(manifest).fingerprint == model.name and (d / WEIGHTS).exists()
                except (OSError, ValueError, KeyError, TypeError):
                    complete = False
            stamp = manifest if complete else (d / PART if (d / PART).exists() else d)
            try:
                out.append(Entry(d, model.name, d.name, _size(d), stamp.stat().st_mtime, complete))
            except FileNotFoundError:  # a part file renamed meanwhile: the next listing has it
                continue
    return sorted(out, key=lambda e: e.last_used)


def remove(entry: Entry) -> None:
    shutil.rmtree(entry.path, ignore_errors=True)
    try:
        entry.path.parent.rmdir()  # the model's directory, once it holds no shard
    except OSError:
        pass
    log.info("shard cache: removed %s (%.1f MiB)", entry.path, entry.bytes / 2**20)


def _lock_all(chosen: list[Entry], need: int | None = None) -> tuple[list[tuple[Entry, EntryLock]], list[Entry]]:
    """The entries that no node is fetching or loading, each locked; and the others (cache_lock.py).
    With `need`: in order, until the locked ones hold that many bytes (a busy one frees nothing)."""
    free, busy, held = [], [], 0
    for e in chosen:
        if need is not None and held >= need:
            break
        lock = try_exclusive(e.path)
        if lock is None:
            busy.append(e)
        else:
            free.append((e, lock))
            held += e.bytes
    if busy:
        log.info("shard cache: %d entries in use by a node are kept: %s", len(busy),
                 ", ".join(str(e.path) for e in busy))
    return free, busy


def make_room(root: Path, need: int, free: int, keep: Path | None = None,
              measure: Callable[[Path], int] = free_bytes) -> int:
    """Remove entries other than `keep`, least recently used first, until `need` bytes fit; returns
    the free bytes `measure` finds after the last removal. When removing them all would not make
    room, none is removed (peers may still fetch them from here); an entry in use is never removed."""
    others, _ = _lock_all([e for e in entries(root) if e.path != keep])
    try:
        if free + sum(e.bytes for e, _ in others) < need:
            return free
        for e, _ in others:
            if free >= need:
                break
            remove(e)
            free = measure(root)
        return free
    finally:
        for _, lock in others:
            lock.release()


def prune(root: Path, *, max_bytes: int | None = None,
          fingerprint: str | None = None) -> tuple[list[Entry], list[Entry]]:
    """Remove every entry of `fingerprint` (or of every model when None) or, with `max_bytes`, the least
    recently used entries until the cache holds at most that many bytes. Returns what was removed, and
    what was chosen but kept because a node is fetching or loading it."""
    if fingerprint is not None and not fingerprint:
        raise ValueError("an empty model fingerprint names every model: use --all for that")
    fingerprint = fingerprint.lower() if fingerprint is not None else None  # (hex digits, as written)
    all_entries = entries(root)
    if max_bytes is None:
        removable, busy = _lock_all([e for e in all_entries
                                     if fingerprint is None or e.fingerprint.startswith(fingerprint)])
    else:  # least recently used first
        removable, busy = _lock_all(all_entries, need=sum(e.bytes for e in all_entries) - max_bytes)
    try:
        for e, _ in removable:
            remove(e)
    finally:
        for _, lock in removable:
            lock.release()
    return [e for e, _ in removable], busy
