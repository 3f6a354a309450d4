"""Bringing a pipeline of nodes back after one is lost, without restarting the coordinator.

When a node dies or stops answering, the pipeline is down: every step in flight fails (naming the
node) and engines refuse new requests with a retry hint. A watcher then tries, about once a second,
to form the same pipeline again: every node answers, each is asked to load its shard (the ones that
kept theirs say so at once; a restarted node loads it, or fetches it from a peer), the ring is
connected again and the subscriptions renewed. From then on the pipeline serves, and requests that
wait for it (engine/ring.py resumes them) go on. An error of the kinds in `final` (another coordinator
took the nodes over) ends the attempts: the pipeline stays down, and whoever waits hears so at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

RETRY_S = 1.0


class Reformer:
    def __init__(self, reform: Callable[[], None], interval: float = RETRY_S,
                 final: tuple[type[Exception], ...] = ()):
        self._reform = reform  # raises while the pipeline cannot be formed again
        self.interval = interval
        self.final = final
        self.given_up = False  # down for good (`down` says why)
        self.down: Exception | None = None  # why the pipeline is down, None while it serves
        self.down_at = 0.0  # since when (time.time())
        self.reformed = threading.Event()  # set while it serves
        self.reformed.set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._losses = 0  # a loss reported while an attempt runs makes that attempt not count

    def lost(self, error: Exception) -> None:
        """A node is lost: down until formed again (one watcher however many failures report it)."""
        with self._lock:
            if self._stop.is_set():
                return
            if self.down is None:
                log.warning("pipeline down: %s; re-forming it", error)
                self.down_at = time.time()
            self.down = error
            self._losses += 1
            self.reformed.clear()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="pipeline-reform", daemon=True)
                self._thread.start()

    def wait(self, timeout: float) -> bool:
        """True once the pipeline serves again (at once if it does), False after `timeout` seconds or
        once it is given up."""
        return self.reformed.wait(timeout) and not self.given_up

    def give_up(self, error: Exception) -> None:
        """Down for good: no more attempts."""
        with self._lock:
            if self.given_up or (self._stop.is_set() and self.down is None):
                return  # (already, or the pipeline was closed)
            log.warning("pipeline down for good: %s", error)
            if self.down is None:
                self.down_at = time.time()
            self.down, self.given_up = error, True
            self._stop.set()
            self.reformed.set()  # waiters hear it at once (wait() says False)

    def stop(self) -> None:
        self._stop.set()
        self.reformed.set()  # nobody waits for a closed pipeline

    def _run(self) -> None:
        attempt = 0
        while not self._stop.wait(self.interval):
            attempt += 1
            with self._lock:
                losses = self._losses
            try:
                self._reform()
            except self.final as e:
                self.give_up(e)
                return
            except Exception as e:  # a node still missing, still loading: try again
                log.debug("re-forming the pipeline (attempt %d): %s", attempt, e)
                continue
            with self._lock:
                if losses != self._losses:
                    continue
                log.warning("pipeline formed again after %d attempt(s)", attempt)
                self.down = None
                self.reformed.set()
                self._thread = None  # (a loss from now on starts a new watcher: this one is ending)
            return
