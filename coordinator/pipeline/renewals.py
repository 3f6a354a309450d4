"""Lease renewals, and what their answers say about each node.

The coordinator renews the sequences it still wants on every node about once a second
(node/leases.py). A node's event loop answers them, so they also tell whether each node still serves.
HTTP/2 keepalive (node/wire.py) cuts off a node that is gone or stopped (its process, its machine, its
link), but not one whose loop hangs while gRPC's core still answers pings: its connections stay up and
its rounds simply stop. A node that has answered no renewal for a while, as this client had
sequences on it, is reported by name as lost. A node's loop also runs its steps, so it answers none
while it computes one: a decode round takes a fraction of a second, but a prompt chunk of a large
model on a small machine takes seconds, so while prompt chunks are in flight the wait is longer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from ...proto import mtpipe_pb2 as pb

log = logging.getLogger(__name__)

RENEW_S = 1.0  # how often the sequences' leases are renewed on every node (a lease runs for seconds)
SILENT_S = 2.5  # a node that answered no renewal for this long is lost
PREFILL_SILENT_S = 30.0  # the same while prompt chunks are in flight (a node answers none during a step)
# Codes that say the node's loop did not answer (anything else it sent is an answer).
_UNANSWERED = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class Silence:
    """Per node, the send time of the latest renewal it answered (plain data: times are given)."""

    def __init__(self, nodes: int, now: float):
        self.answered = [now] * nodes

    def reset(self, now: float) -> None:
        """Nothing was asked of the nodes until now (no sequences, or the pipeline was being formed)."""
        self.answered = [now] * len(self.answered)

    def answer(self, node: int, sent: float) -> None:
        self.answered[node] = max(self.answered[node], sent)

    def silent(self, now: float, limit: float) -> list[tuple[int, float]]:
        """The nodes that answered nothing sent in the last `limit` seconds, with how long they have not."""
        return [(i, now - t) for i, t in enumerate(self.answered) if now - t > limit]


class Renewer:
    """A thread that renews `wanted()` on every node and reports a node that stops answering.

    `paused()` while the pipeline is down: a node lost already is the re-forming's business.
    `prefilling()` while prompt chunks are in flight."""

    def __init__(self, stubs: list[Any], addresses: list[str], client_id: str, wanted: Callable[[], list[str]],
                 on_silent: Callable[[str, float], None], paused: Callable[[], bool],
                 prefilling: Callable[[], bool], interval: float = RENEW_S):
        self.stubs, self.addresses, self.client_id = stubs, addresses, client_id
        self.wanted, self.on_silent, self.paused, self.prefilling = wanted, on_silent, paused, prefilling
        self.interval = interval
        self.silence = Silence(len(stubs), time.monotonic())
        self._lock = threading.Lock()  # (answers come on gRPC's threads)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-renewer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            live = self.wanted()
            with self._lock:
                if not live or self.paused():
                    self.silence.reset(now)
                    continue
                silent = self.silence.silent(now, PREFILL_SILENT_S if self.prefilling() else SILENT_S)
                if silent:
                    self.silence.reset(now)  # (one report per silence; the pipeline is down from it on)
            if silent:
                node, seconds = max(silent, key=lambda s: s[1])
                log.warning("node %s answered no lease renewal for %.1f s", self.addresses[node], seconds)
                self.on_silent(self.addresses[node], seconds)
                continue
            self._send(live, now)

    def _send(self, seq_ids: list[str], now: float) -> None:
        request = pb.RenewRequest(client_id=self.client_id, seq_ids=seq_ids)
        for i, stub in enumerate(self.stubs):
            # (a late answer still counts: it came from a loop that serves)
            future = stub.Renew.future(request, timeout=SILENT_S + self.interval)
            future.add_done_callback(lambda f, i=i: self._answered(i, now, f))

    def _answered(self, node: int, sent: float, future: Any) -> None:
        if future.cancelled():
            return
        error = future.exception()
        if error is not None and getattr(error, "code", lambda: None)() in _UNANSWERED:
            log.debug("renewal not answered by %s: %s", self.addresses[node], error)
            return
        with self._lock:
            self.silence.answer(node, sent)
