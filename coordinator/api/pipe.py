"""The pipe under the API's link (link.py): errors as they cross it, hanging up, and a sender thread.

Messages cross as pickled lists of tuples; each side sends from an `Outbox`, so whatever puts a
message (the MLX thread, the event loop) never blocks on the pipe.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ...node.protocol import StageError, StageUnavailable
from ..engine.request import RequestError
from ..engine.sinks import ServerBusy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WireError:
    """An engine's exception as it crosses the link (exceptions with extra fields do not unpickle)."""

    kind: str
    message: str
    retry_after: int = 0
    param: str | None = None
    code: str | None = None

    @classmethod
    def of(cls, e: BaseException) -> WireError:
        if isinstance(e, ServerBusy):
            return cls("busy", str(e), retry_after=e.retry_after)
        if isinstance(e, RequestError):
            return cls("request", str(e), param=e.param, code=e.code)
        if isinstance(e, StageUnavailable):
            return cls("unavailable", str(e))
        if isinstance(e, StageError):
            return cls("stage", str(e))
        return cls("other", f"{type(e).__name__}: {e}")

    def exception(self) -> Exception:
        if self.kind == "busy":
            return ServerBusy(self.message, self.retry_after)
        if self.kind == "request":
            return RequestError(self.message, self.param, self.code)
        if self.kind == "unavailable":
            return StageUnavailable(self.message)
        if self.kind == "stage":
            return StageError(self.message)
        return RuntimeError(self.message)


def hang_up(conn: Any) -> None:
    """End a pipe for both sides at once (a plain close() does not reach the other end while a reader
    of this process is blocked on it). The connection stays open, so that a thread still using it
    gets an error rather than another file on its descriptor: its owner closes it once that thread is
    done."""
    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
    except (OSError, ValueError):  # already closed, or not a socket
        return
    with sock:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def receive(conn: Any, dispatch: Callable[[tuple[Any, ...]], None], peer: str) -> None:
    """Hand each message from `peer` to `dispatch` until the link ends: one message's failure is logged
    and the next one read; a message this side cannot read ends the link."""
    try:
        while True:
            for msg in conn.recv():
                try:
                    dispatch(msg)
                except Exception:  # noqa: BLE001 - one message's failure (a sink's) is not the link's
                    log.exception("%s's message %r failed", peer, msg[0])
    except (EOFError, OSError):
        pass  # the other side is gone, or this one hung up
    except Exception:  # noqa: BLE001 - a message this side cannot read: the link is unusable
        log.exception("the link to %s failed", peer)


class Outbox:
    """Messages for the other process, sent in batches by a thread of their own. A message that does
    not pickle goes to `unsendable`, which returns what to send in its place, so that none hangs."""

    def __init__(self, conn: Any, name: str, unsendable: Callable[[tuple[Any, ...], Exception], list]):
        self.conn = conn
        self.unsendable = unsendable
        self._items: list[tuple[Any, ...]] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, msg: tuple[Any, ...]) -> None:
        with self._cond:
            if self._closed:
                return
            self._items.append(msg)
            if len(self._items) == 1:
                self._cond.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._items and not self._closed:
                        self._cond.wait()
                    batch, self._items = self._items, []
                    if not batch:
                        return
                data = self._pickle(batch)
                if data is not None:
                    self.conn.send_bytes(data)
        except OSError as e:  # the other side is gone, or this one hung up
            log.debug("the link is closed: %s", e)
        except Exception:  # noqa: BLE001 - nothing more would be sent: end the link for both sides
            log.exception("the link's sender failed")
            hang_up(self.conn)
        finally:
            with self._cond:
                self._closed = True
                self._items.clear()

    def _pickle(self, batch: list[tuple[Any, ...]]) -> Any:
        """The batch as `Connection.send` would write it; one that does not pickle, message by message,
        each that does not pickle replaced by what `unsendable` returns for it (None: nothing left)."""
        try:
            return ForkingPickler.dumps(batch)
        except Exception:  # noqa: BLE001 - any error pickling raises
            log.exception("a message over the link does not pickle")
        kept: list[tuple[Any, ...]] = []
        for msg in batch:
            try:
                ForkingPickler.dumps(msg)
            except Exception as e:  # noqa: BLE001 - this one
                kept.extend(self.unsendable(msg, e))
            else:
                kept.append(msg)
        return ForkingPickler.dumps(kept) if kept else None
