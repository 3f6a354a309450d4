"""Locks on shard cache entries, for nodes that share one cache root (several node processes on one machine).

An entry's lock is a file under `<root>/.locks` that is never removed: removing it would let two nodes
lock two different files of one name. The locks are flock(2) locks, held by an open file description,
so two nodes in one process exclude each other as two processes do, and a killed node's locks go
with it.
- A node looks its entry up under the lock held shared, and keeps holding it if the entry is complete.
- Otherwise it holds it exclusively while it looks again (and removes a corrupted entry) and fetches:
  two nodes never write one part file, and the second finds the entry the first completed.
- It holds it shared from then until the shard is read into memory (the Load that asked for it).
- Making room for a fetch and `mtpipe cache prune` remove only the entries they can lock
  exclusively at once: never one that is being fetched or loaded.
On a network file system (NFS, SMB) Linux emulates flock with per-process locks: there, nodes in one
process do not exclude each other. A root where no lock file can be made (read-only) is used unlocked.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from ..models.fingerprint import is_fingerprint

log = logging.getLogger(__name__)

LOCKS = ".locks"
POLL_S = 0.1
_warned: set[Path] = set()


class EntryLock:
    """An open lock file of one entry; closing it releases whatever it holds."""

    def __init__(self, root: Path, fingerprint: str, dirname: str):
        if not is_fingerprint(fingerprint):  # a part of a file name, never a path
            raise ValueError(f"invalid model fingerprint {fingerprint!r}")
        path = root / LOCKS / f"{fingerprint}-{dirname}.lock"
        self._fd: int | None = None
        self.unlocked = False  # a root where no lock file can be made (read-only): entries are used unlocked
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            self.unlocked = True
            if root not in _warned:
                _warned.add(root)
                log.warning("shard cache %s: no lock files (%s); its entries are used without locks", root, e)

    def try_exclusive(self) -> bool:
        return self._try(fcntl.LOCK_EX)

    def try_shared(self) -> bool:
        return self._try(fcntl.LOCK_SH)

    def _try(self, mode: int) -> bool:
        if self._fd is None:
            return self.unlocked
        try:
            fcntl.flock(self._fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def share(self) -> None:
        """From exclusive to shared: others may load the entry too, nobody may remove it. (flock makes the
        change in two steps: a prune that lands between them removes the entry, and the load fails.) It may
        wait for another node's exclusive lock taken in between: not on an event loop."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_SH)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


async def hold(root: Path, fingerprint: str, dirname: str,
               complete: Callable[[], Awaitable[Path | None]]) -> tuple[EntryLock, Path | None]:
    """The entry's lock: held shared, with `complete()`'s directory, once that finds the entry complete under
    it; else held exclusively, with None (to repair or fetch the entry). Waits by polling, so that a
    cancelled Load leaves no lock behind."""
    while True:
        lock = EntryLock(root, fingerprint, dirname)
        try:
            if lock.try_shared():
                found = await complete()
                if found is not None:
                    return lock, found
                lock.release()
                lock = EntryLock(root, fingerprint, dirname)
            if lock.try_exclusive():
                return lock, None
        except BaseException:
            lock.release()
            raise
        lock.release()
        await asyncio.sleep(POLL_S)


def try_exclusive(entry: Path) -> EntryLock | None:
    """The lock of the entry directory `entry` (<root>/<fingerprint>/<dirname>) if nobody holds it, else None."""
    lock = EntryLock(entry.parent.parent, entry.parent.name, entry.name)
    if lock.try_exclusive():
        return lock
    lock.release()
    return None
