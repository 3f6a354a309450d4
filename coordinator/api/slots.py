"""The API's generation slots: how many generations run at once (`--max-concurrency`), the rest waiting.

A request takes a slot for each of its choices, all or none, so that two whose choices each hold part
of what they need never wait on each other. Waiting requests get them in order of priority (lower
first, as vLLM's priority policy; all 0 under first come, first served), then of arrival, and none
overtakes one before it that does not fit yet. On the API's event loop only.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class Slots:
    def __init__(self, total: int):
        self.total = total
        self.free = total
        # heap: (priority, arrival, order, count, future); several of one request may share an arrival
        self._waiting: list[tuple[int, int, int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()
        self._order = itertools.count()  # (ties within an arrival: first asked, first served)
        # Choices past `total` of requests under way, not yet asking: each asks for its slot once one is free.
        self.deferred = 0

    def arrival(self) -> int:
        """A place in the queue's order, taken now (`acquire`'s `arrival`)."""
        return next(self._arrivals)

    async def acquire(self, count: int = 1, priority: int = 0, arrival: int | None = None) -> None:
        """`count` slots (at most `total`), once they are free and no request before this one waits; it
        comes where `arrival` (taken before) puts it, else after all that came before."""
        if not 0 < count <= self.total:
            raise ValueError(f"{count} slots asked of {self.total}")
        if not self._waiting and count <= self.free:
            self.free -= count
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (priority, self.arrival() if arrival is None else arrival, next(self._order), count, future)
        heapq.heappush(self._waiting, entry)
        self._grant()  # (first in priority, it may fit what those it overtook left free)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # (given as it was cancelled: given back)
                self.release(count)
            elif entry in self._waiting:
                self._waiting.remove(entry)
                heapq.heapify(self._waiting)
                self._grant()  # (the one it held back may go now)
            raise

    def release(self, count: int = 1) -> None:
        self.free += count
        self._grant()

    @property
    def waiting(self) -> int:
        """Generations waiting (a request's choices each wait, those not yet asking too: the engine's queue
        counts them so)."""
        return self.deferred + sum(entry[3] for entry in self._waiting if not entry[4].done())

    def _grant(self) -> None:
        while self._waiting and self._waiting[0][3] <= self.free:
            *_, count, future = heapq.heappop(self._waiting)
            if future.done():  # (cancelled: its task takes itself out)
                continue
            self.free -= count
            future.set_result(None)
