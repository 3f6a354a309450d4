"""The one thread of a process that does MLX work.

MLX streams belong to threads: a lazy array built on one thread cannot be evaluated on another, and
on Apple silicon a thread without its own GPU stream fails on its first evaluation. So every MLX
operation of a process (loading included) runs on one thread that owns a thread-local stream, as
mlx-lm's generation does; other threads hand it callables and get plain data back.

Between hand-offs the thread can run a background `worker` (the batch scheduler's rounds): it runs
one unit of work at a time, so hand-offs are served between rounds.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import mlx.core as mx

log = logging.getLogger(__name__)

T = TypeVar("T")
_STOP = object()
_LIVE: weakref.WeakSet[MLXThread] = weakref.WeakSet()


def end_thread_streams() -> None:
    """MLX tears a thread's streams down only when told (`clear_streams`); a thread that did MLX work
    and ends without it makes the process abort at exit. Call it last on every such thread."""
    try:
        mx.clear_streams()
    except Exception:  # an MLX without it cleans up by itself
        log.debug("mx.clear_streams failed", exc_info=True)


@functools.cache
def wire_working_set() -> None:
    """On Metal, let MLX keep up to the recommended working set wired, as mlx-lm's server does: weights
    not wired may be compressed or paged out by macOS between requests. Nothing elsewhere (no such size).
    Once per process, before its MLX work (MLX asks that the limit not change under an evaluation).
    Done here rather than through mlx-lm's helper, whose module imports transformers: seconds in every
    node process, which needs no tokenizer."""
    try:
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        size = info.get("max_recommended_working_set_size")
        if size:
            mx.set_wired_limit(int(size))
    except Exception:  # an MLX without these: the system's default
        log.debug("the wired limit was not set", exc_info=True)


@atexit.register
def _close_all() -> None:
    for thread in list(_LIVE):
        thread.close()


class MLXThread:
    def __init__(self, name: str = "mlx"):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: Callable[[], bool] | None = None
        self._closed = False
        self._closing = threading.Lock()
        self._unit_since: float | None = None  # when the unit of work now running began
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _LIVE.add(self)

    # -- hand-offs ------------------------------------------------------------------------------

    def owns(self) -> bool:
        """Whether the calling thread is this MLX thread."""
        return threading.current_thread() is self._thread

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    @property
    def alive(self) -> bool:
        """Whether the thread still runs (GET /health: a dead MLX thread serves nothing)."""
        return self._thread.is_alive() and not self._closed

    def busy_for(self) -> float:
        """How long the unit of work now running has run, 0 when idle: a stuck round shows here while
        the thread itself still looks alive."""
        since = self._unit_since
        return 0.0 if since is None else time.monotonic() - since

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._closing:  # (queued before the stop, so run, or refused: never left behind it)
            if self._closed:
                future.set_exception(RuntimeError("the MLX thread is closed"))
                return future
            self._tasks.put((future, fn, args, kwargs))
        return future

    def call(self, fn: Callable[..., T], *args: Any, timeout: float | None = None, **kwargs: Any) -> T:
        """Run `fn` on the MLX thread and wait for its result (directly when already on it); TimeoutError
        after `timeout` seconds, if given (`fn` may still run later)."""
        if self.owns():
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result(timeout)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`call` for an event loop: the loop keeps serving while the MLX thread works."""
        if self.owns():
            return fn(*args, **kwargs)
        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs))

    def wake(self) -> None:
        """Make an idle thread look at its worker again (new work arrived)."""
        self._tasks.put(None)

    def set_worker(self, worker: Callable[[], bool] | None) -> None:
        """`worker()` runs one unit of work on this thread and returns whether more is waiting."""
        self._worker = worker
        self.wake()

    def close(self, timeout: float | None = 10.0) -> None:
        with self._closing:
            if self._closed:
                return
            self._closed = True
            self._worker = None
            self._tasks.put(_STOP)
        if not self.owns():
            self._thread.join(timeout)

    # -- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        wire_working_set()
        stream = mx.new_thread_local_stream(mx.default_device())
        with mx.stream(stream):
            busy = False
            while True:
                try:
                    item = self._tasks.get(block=not busy)
                except queue.Empty:
                    item = None
                if item is _STOP:
                    break
                if item is not None:
                    self._unit_since = time.monotonic()
                    self._execute(*item)
                    self._unit_since = None
                    continue  # hand-offs first, then the next unit of background work
                worker = self._worker
                if worker is None:
                    busy = False
                    continue
                self._unit_since = time.monotonic()
                try:
                    busy = worker()
                except Exception:  # the worker reports its own failures to its requests
                    log.exception("the MLX thread's worker failed")
                    busy = False
                self._unit_since = None
        while not self._tasks.empty():  # late hand-offs fail rather than hang
            item = self._tasks.get()
            if item not in (None, _STOP):
                item[0].set_exception(RuntimeError("the MLX thread is closed"))
        end_thread_streams()

    @staticmethod
    def _execute(future: Future, fn: Callable, args: tuple, kwargs: dict) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 (handed to the caller, who re-raises it)
            future.set_exception(e)
