"""The link between the API's front process and the engine's process (vLLM v1's split).

The front (front.py) parses bodies, tokenizes, streams server-sent events and keeps the HTTP
connections; the engine's process runs the MLX thread and nothing else in Python but this link, so
the API's per-chunk work never takes the interpreter lock from the thread that builds the next round.

Over a `multiprocessing` pipe, as pickled lists of tuples:
- front to engine: ("open", rid, GenerationRequest), ("cancel", rid), ("call", cid, name),
  ("listening", host, port);
- engine to front: first [("hello", info)] alone, then ("admitted", rid) once a request left the
  engine's queue (one refused before gets its "error" instead, so a stream is refused with its status,
  not inside a 200), ("chunk", rid, GenerationChunk), ("error", rid, WireError), ("end", rid) and
  ("reply", cid, ok, value).

Each side sends from a thread of its own (`Outbox`, pipe.py): the engine's sinks, called on its MLX
thread, and the front's event loop only append to it, so neither ever blocks on the pipe, and a
round's chunks for every row go as one message. A front that goes away cancels every request it opened
(their caches are freed on every stage); an engine that goes away fails every open request with
EngineLost (a StageUnavailable that names no node). So does an engine that is stuck
(`EngineClient.watch`): one whose MLX thread has been in one round, or whose process has not answered,
for the stall timeout. The front then stops, and `mtpipe serve` exits 1 for its supervisor to start it
again, as vLLM's server does when its engine core is dead.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..engine.request import GenerationRequest, check_request, check_vocabulary
from ..engine.sinks import END, EngineLost, Sink, open_admitted
from .pipe import Outbox, WireError, hang_up, receive
from .readiness import Readiness, timestamp

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0
SCHEDULER_TIMEOUT_S = 2.0  # /metrics reports the scheduler as it last was when its engine answers no sooner
READY_MARGIN_S = 2.0  # GET /health waits this much beyond the engine's own check before it says "not ready"


def engine_info(engine: Any, *, cluster: bool) -> dict[str, Any]:
    """What the front needs to know of the engine to validate and answer without asking it."""
    return {"has_mtp": bool(engine.has_mtp), "max_context": int(engine.max_context),
            "vocab_size": int(engine.vocab_size), "eos": sorted(engine.eos), "cluster": cluster,
            "constrains": bool(getattr(engine, "constrains", False)),
            "keeps_prefixes": bool(getattr(engine, "keeps_prefixes", False))}


class EngineHost:
    """Serves an engine (one with `open`: the batch or ring engine) to a front process over `conn`.

    `cluster_info` answers the front's GET /v1/cluster over nodes; `listening` gets the front's
    (host, port) once it serves; `closed` is set when the front is gone.
    """

    def __init__(self, engine: Any, conn: Any, *, cluster_info: Callable[[], dict] | None = None):
        self.engine = engine
        self.conn = conn
        self.cluster_info = cluster_info
        self.listening: Future[tuple[str, int]] = Future()
        self.closed = threading.Event()
        self._handles: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._outbox: Outbox | None = None
        self._readiness = Readiness(engine)  # one for the link's life: it remembers since when each node is down
        self._calls = ThreadPoolExecutor(4, thread_name_prefix="engine-link-call")
        self._ready_calls = ThreadPoolExecutor(1, thread_name_prefix="engine-link-ready")  # never behind slow calls
        self._reader = threading.Thread(target=self._read, name="engine-link-in", daemon=True)

    def start(self) -> None:
        self.conn.send([("hello", engine_info(self.engine, cluster=self.cluster_info is not None))])
        self._outbox = Outbox(self.conn, "engine-link-out", self._unsendable)
        self._reader.start()

    def close(self) -> None:
        """Cancel what the front left open and stop the link's threads (the engine is the caller's)."""
        hang_up(self.conn)
        if self._reader.ident is not None:  # (started)
            self._reader.join(5.0)
        self._cancel_all()
        if self._outbox is not None:
            self._outbox.close()
        for pool in (self._calls, self._ready_calls):
            pool.shutdown(wait=False, cancel_futures=True)
        self.conn.close()

    @property
    def open_requests(self) -> int:
        with self._lock:
            return len(self._handles)

    def _read(self) -> None:
        try:
            receive(self.conn, self._dispatch, "the API front")
        finally:
            hang_up(self.conn)  # the front sees the link end, and fails what it has open
            if not self.listening.done():
                self.listening.set_exception(RuntimeError("the API process ended before it served "
                                                          "(its log says why)"))
            self._cancel_all()
            self.closed.set()

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        op = msg[0]
        if op == "open":
            self._open(msg[1], msg[2])
        elif op == "cancel":
            with self._lock:
                handle = self._handles.get(msg[1])
            if handle is not None:
                handle.cancel()
        elif op == "call" and msg[2] in ("progress", "scheduler"):  # (answered here: never behind a slow call)
            self._answer_now(msg[1], msg[2])
        elif op == "call":
            (self._ready_calls if msg[2] == "ready" else self._calls).submit(self._answer, msg[1], msg[2])
        elif op == "listening":
            if not self.listening.done():
                self.listening.set_result((msg[1], msg[2]))
        else:
            log.warning("the API front sent an unknown message %r", op)

    def _cancel_all(self) -> None:
        with self._lock:
            handles = [h for h in self._handles.values() if h is not None]
        for handle in handles:
            handle.cancel()
        if handles:
            log.info("the API front is gone: %d request(s) cancelled", len(handles))

    def _open(self, rid: int, req: GenerationRequest) -> None:
        with self._lock:
            self._handles[rid] = None  # the request may end before open() returns
        outbox = self._outbox
        assert outbox is not None
        try:
            handle = open_admitted(self.engine, req, lambda item: self._deliver(rid, item),
                                   lambda: outbox.put(("admitted", rid)))
        except Exception as e:  # noqa: BLE001 - refused at once: the front answers it like any failure
            self._deliver(rid, e)
            self._deliver(rid, END)
            return
        with self._lock:
            if rid in self._handles:
                self._handles[rid] = handle

    def _deliver(self, rid: int, item: Any) -> None:
        """A request's sink (on the engine's thread): queue its item for the front."""
        assert self._outbox is not None
        if item is END:
            with self._lock:
                self._handles.pop(rid, None)
            self._outbox.put(("end", rid))
        elif isinstance(item, BaseException):
            self._outbox.put(("error", rid, WireError.of(item)))
        else:
            self._outbox.put(("chunk", rid, item))

    def _answer_now(self, cid: int, name: str) -> None:
        """What never waits: how long the MLX thread has been in its unit, the scheduler's state."""
        assert self._outbox is not None
        try:
            value = self._busy_for() if name == "progress" else self.engine.scheduler_state()
        except Exception as e:  # noqa: BLE001 - the front raises it where it asked
            self._outbox.put(("reply", cid, False, f"{type(e).__name__}: {e}"))
            return
        self._outbox.put(("reply", cid, True, value))

    def _answer(self, cid: int, name: str) -> None:
        assert self._outbox is not None
        calls: dict[str, Callable[[], Any]] = {
            "describe": lambda: self.engine.pipeline.describe(),
            "ready": self._ready,
            "cluster": lambda: self.cluster_info() if self.cluster_info else None,
        }
        try:
            self._outbox.put(("reply", cid, True, calls[name]()))
        except Exception as e:  # noqa: BLE001 - the front raises it where it asked
            self._outbox.put(("reply", cid, False, f"{type(e).__name__}: {e}"))

    def _ready(self) -> tuple[bool, dict[str, Any]]:
        return self._readiness.check()

    def _busy_for(self) -> float:
        """How long the engine's MLX thread has been in its current unit of work (0 for an engine
        without one: the ring engine watches its nodes' rounds itself)."""
        thread = getattr(self.engine, "thread", None)
        return float(thread.busy_for()) if thread is not None else 0.0

    @staticmethod
    def _unsendable(msg: tuple[Any, ...], e: Exception) -> list[tuple[Any, ...]]:
        """What the front gets instead of a message that does not pickle: the request's error, the
        call's refusal."""
        if msg[0] in ("chunk", "error"):
            return [("error", msg[1], WireError("other", f"could not send this output: {e}"))]
        if msg[0] == "reply":
            return [("reply", msg[1], False, f"could not send the answer: {e}")]
        return []


class LinkHandle:
    def __init__(self, client: EngineClient, rid: int):
        self._client = client
        self._rid = rid

    def cancel(self) -> None:
        """The client is gone: the engine drops the request at its next round."""
        self._client._cancel(self._rid)


class EngineClient:
    """The engine of another process as the API uses it: requests are validated here, opened and
    cancelled over the link, and their chunks handed to their sinks on the link's reader thread."""

    def __init__(self, conn: Any, info: dict[str, Any], tokenizer: Any):
        self.conn = conn
        self.tokenizer = tokenizer
        self.has_mtp: bool = info["has_mtp"]
        self.max_context: int = info["max_context"]
        self.vocab_size: int = info["vocab_size"]
        self.eos = set(info["eos"])
        self.constrains: bool = info["constrains"]  # (the engine holds output to grammars)
        self.keeps_prefixes: bool = info["keeps_prefixes"]  # (a prompt's other choices may start from its prefix)
        self.pipeline = self  # describe() and close(), as an engine's pipeline offers them
        self.on_lost: Callable[[], None] | None = None
        self.lost: str | None = None
        self._sinks: dict[int, Sink] = {}
        self._admitted: dict[int, Callable[[], None]] = {}  # told when the engine admits the request
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._outbox = Outbox(conn, "api-link-out", self._unsendable)
        self._reader = threading.Thread(target=self._read, name="api-link-in", daemon=True)
        self._reader.start()

    def validate(self, req: GenerationRequest) -> None:
        check_request(req, max_context=self.max_context, has_mtp=self.has_mtp, constrains=self.constrains)
        check_vocabulary(req, self.vocab_size)

    def open(self, req: GenerationRequest, sink: Sink, admitted: Callable[[], None] | None = None) -> LinkHandle:
        """Queue a request in the engine; its chunks, then END or an exception, go to `sink`, and
        `admitted()` is called once it leaves the engine's queue."""
        self.validate(req)
        rid = next(self._ids)
        with self._lock:
            if self.lost is not None:
                raise EngineLost(self.lost)
            self._sinks[rid] = sink
            if admitted is not None:
                self._admitted[rid] = admitted
        self._outbox.put(("open", rid, req))
        return LinkHandle(self, rid)

    def call(self, name: str, timeout: float = CALL_TIMEOUT_S) -> Any:
        """Ask the engine's process (blocking: call off the event loop)."""
        cid = next(self._ids)
        future: Future = Future()
        with self._lock:
            if self.lost is not None:
                raise EngineLost(self.lost)
            self._calls[cid] = future
        self._outbox.put(("call", cid, name))
        try:
            return future.result(timeout)
        finally:
            with self._lock:
                self._calls.pop(cid, None)

    def describe(self) -> dict[str, Any]:
        return self.call("describe")

    def check_ready(self, timeout: float) -> tuple[bool, dict[str, Any]]:
        """GET /health as the engine's process sees it (its MLX thread, or its nodes)."""
        try:
            return tuple(self.call("ready", timeout + READY_MARGIN_S))  # type: ignore[return-value]
        except Exception as e:  # noqa: BLE001 - an engine that does not answer is not ready
            reason = self.lost or f"the engine's process does not answer: {type(e).__name__}: {e}"
            return False, {"unready": [{"address": "engine", "reason": reason, "since": timestamp(time.time())}]}

    def cluster_info(self) -> dict[str, Any]:
        return self.call("cluster")

    def scheduler_state(self) -> Any:
        """The engine's SchedulerState (or None), for /metrics."""
        return self.call("scheduler", SCHEDULER_TIMEOUT_S)

    def watch(self, stall_after: float) -> None:
        """Fail every open request and stop (as if the engine's process were gone) once the engine has
        been stuck for `stall_after` seconds: its MLX thread in one round, or its process silent."""
        threading.Thread(target=self._watch, args=(stall_after,), name="api-link-watch", daemon=True).start()

    def _watch(self, stall_after: float) -> None:
        period = min(5.0, max(stall_after / 4, 0.05))
        answered = time.monotonic()
        while not self._closing.wait(period) and self.lost is None:
            try:
                busy = float(self.call("progress", period))
                answered = time.monotonic()
            except Exception:  # noqa: BLE001 - no answer in time: counted below
                busy = 0.0
            silent = time.monotonic() - answered
            if busy > stall_after:
                self._lose(f"the engine is stuck: its MLX thread has been in one round for {busy:.0f} s")
            elif silent > stall_after:
                self._lose(f"the engine is stuck: its process has not answered for {silent:.0f} s")

    def announce(self, host: str, port: int) -> None:
        self._outbox.put(("listening", host, port))

    def close(self) -> None:
        """Send what is queued (a last cancel), then end the link."""
        self._closing.set()
        self._outbox.close(timeout=2.0)
        hang_up(self.conn)
        if threading.current_thread() is not self._reader:  # (not from a sink or `on_lost`)
            self._reader.join(5.0)
            self.conn.close()

    def _cancel(self, rid: int) -> None:
        with self._lock:
            if rid not in self._sinks:  # ended already: the engine holds nothing of it
                return
        self._outbox.put(("cancel", rid))

    def _unsendable(self, msg: tuple[Any, ...], e: Exception) -> list[tuple[Any, ...]]:
        """A request or call that does not pickle fails here, at once."""
        error = RuntimeError(f"could not send this to the engine: {type(e).__name__}: {e}")
        with self._lock:
            sink = self._sinks.pop(msg[1], None) if msg[0] == "open" else None
            future = self._calls.get(msg[1]) if msg[0] == "call" else None
        if sink is not None:
            sink(error)
            sink(END)
        if future is not None and not future.done():
            future.set_exception(error)
        return []

    def _read(self) -> None:
        receive(self.conn, self._dispatch, "the engine's process")
        hang_up(self.conn)
        self._lose("the engine's process is gone")

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        op = msg[0]
        if op == "reply":
            with self._lock:
                future = self._calls.get(msg[1])
            if future is not None and not future.done():
                if msg[2]:
                    future.set_result(msg[3])
                else:
                    future.set_exception(RuntimeError(msg[3]))
            return
        with self._lock:
            sink = self._sinks.pop(msg[1], None) if op == "end" else self._sinks.get(msg[1])
            admitted = self._admitted.pop(msg[1], None) if op in ("admitted", "end") else None
        if op == "admitted":
            if admitted is not None:
                admitted()
            return
        if sink is None:
            return
        if op == "chunk":
            sink(msg[2])
        elif op == "error":
            sink(msg[2].exception())
        elif op == "end":
            sink(END)

    def _lose(self, why: str) -> None:
        with self._lock:
            if self.lost is not None:  # (the watch and the reader may both find it)
                return
            self.lost = why
            sinks, self._sinks = list(self._sinks.values()), {}
            calls, self._calls = list(self._calls.values()), {}
            self._admitted = {}
        if sinks:
            log.error("%s: %d request(s) fail", why, len(sinks))
        for sink in sinks:
            sink(EngineLost(why))
            sink(END)
        for future in calls:
            if not future.done():
                future.set_exception(EngineLost(why))
        if self.on_lost is not None:
            self.on_lost()
