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
    """Per node, the send times of the renewals it has not answered yet (plain data: times are given).
    A silence runs from the oldest of them, so a coordinator that sent nothing for a while (a stall of
    its own) hears none."""

    def __init__(self, nodes: int):
        self.waiting: list[list[float]] = [[] for _ in range(nodes)]

    def reset(self) -> None:
        """Nothing is asked of the nodes (no sequences, or the pipeline is being formed)."""
        self.waiting = [[] for _ in self.waiting]

    def sent(self, at: float) -> None:
        for w in self.waiting:
            w.append(at)

    def answer(self, node: int, sent: float) -> None:
        """An answer to the renewal sent at `sent` (the loop served then: older ones count as answered)."""
        self.waiting[node] = [t for t in self.waiting[node] if t > sent]

    def silent(self, now: float, busy_until: float) -> list[tuple[int, float]]:
        """The nodes silent for too long, with for how long: `PREFILL_SILENT_S` for a node asked before
        `busy_until` (it may be computing prompt chunks sent until then), `SILENT_S` for the others."""
        out = []
        for i, w in enumerate(self.waiting):
            if w and now - w[0] > (PREFILL_SILENT_S if w[0] < busy_until else SILENT_S):
                out.append((i, now - w[0]))
        return out


class Renewer:
    """A thread that renews `wanted()` on every node and reports a node that stops answering.

    `paused()` while the pipeline is down: a node lost already is the re-forming's business.
    `busy_until()`: until when nodes may be computing this client's prompt chunks (infinite while a
    prompt goes in; after one failed, when it did, as chunks sent before may still be computing)."""

    def __init__(self, stubs: list[Any], addresses: list[str], client_id: str, wanted: Callable[[], list[str]],
                 on_silent: Callable[[str, float], None], paused: Callable[[], bool],
                 busy_until: Callable[[], float], interval: float = RENEW_S):
        self.stubs, self.addresses, self.client_id = stubs, addresses, client_id
        self.wanted, self.on_silent, self.paused, self.busy_until = wanted, on_silent, paused, busy_until
        self.interval = interval
        self.silence = Silence(len(stubs))
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
                    self.silence.reset()
                    continue
                silent = self.silence.silent(now, self.busy_until())
                if silent:
                    self.silence.reset()  # (one report per silence; the pipeline is down from it on)
                else:
                    self.silence.sent(now)
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
