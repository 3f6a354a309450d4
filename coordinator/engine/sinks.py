"""What an engine hands a request's chunks to, and how it says the request ended.

An engine's `open(req, sink, admitted=None)` calls `sink` with GenerationChunks, then an exception or
END, from its own thread; `admitted()`, when given, once the request leaves the queue for the batch
(before that it may still be refused: a stream waits for it before it answers with 200). Kept apart
from the engines (no MLX here) so that the API's process of its own imports it without loading a
model's code.
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ...node.protocol import StageUnavailable
from .request import GenerationChunk, GenerationRequest

log = logging.getLogger(__name__)

Sink = Callable[[Any], None]  # gets GenerationChunks, then an exception or END
END = object()


def guarded(callback: Callable[..., None], on_failure: Callable[[], None], name: str) -> Callable[..., None]:
    """A client's callback (a sink, `admitted`) as an engine calls it: one that raises is logged, gets
    nothing more, and `on_failure()` ends its request as a cancel would. So a broken client ends its
    own request, never an engine's thread, its round or another request."""
    failed = threading.Event()

    def call(*args: Any) -> None:
        if failed.is_set():
            return
        try:
            callback(*args)
        except Exception:  # noqa: BLE001 - the client's fault: its request ends
            failed.set()
            log.exception("the client callback of request %s failed: the request ends", name)
            on_failure()

    return call


def stream(open_request: Callable[[Sink], Any]) -> Iterator[GenerationChunk]:
    """A request an engine feeds to a sink, as an iterator: its chunks, then its exception raised or
    the end; the request is cancelled (through the handle `open_request` returns) if the caller stops
    early."""
    out: queue.SimpleQueue = queue.SimpleQueue()
    handle = open_request(out.put)
    try:
        while (item := out.get()) is not END:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        handle.cancel()


def open_admitted(engine: Any, req: GenerationRequest, sink: Sink, admitted: Callable[[], None]) -> Any:
    """`engine.open`, with `admitted()` called when the engine admits the request: at once after `open`
    for an engine that does not say (it admits what it opens)."""
    if "admitted" in inspect.signature(engine.open).parameters:
        return engine.open(req, sink, admitted=admitted)
    handle = engine.open(req, sink)
    admitted()
    return handle


def open_stream(engine: Any, req: GenerationRequest, sink: Sink) -> None:
    """Feed `req`'s chunks, then an exception or END, to `sink`: through the engine's own `open` where
    it has one (batch and ring engines), else from its `generate` on a thread of its own."""
    if hasattr(engine, "open"):
        engine.open(req, sink)
        return

    def run() -> None:
        try:
            for chunk in engine.generate(req):
                sink(chunk)
        except Exception as e:  # noqa: BLE001 - handed to the sink, as the engines' own `open` does
            try:
                sink(e)
            except Exception:  # noqa: BLE001 - the sink itself failed (on a chunk, and on this)
                log.debug("a stream's sink failed", exc_info=True)
        finally:
            sink(END)  # (even after a sink that raised: whoever waits on it hears the end)

    threading.Thread(target=run, name="stream", daemon=True).start()


class EngineLost(StageUnavailable):
    """The engine's process (the API runs in one of its own) is gone: no node failed, the server did."""


class ServerBusy(RuntimeError):
    """The engine cannot take a request now (it waited past the queue timeout for room, or the
    pipeline is being formed again): the client should retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after
