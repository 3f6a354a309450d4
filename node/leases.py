"""Leases on a node's sequences: a sequence stays only while the client that started it renews it.

A client (coordinator) renews every sequence it still wants, on every node, about once a second
(Renew). A sequence whose lease runs out is released, whatever happened to the frames that would
have released it: a release lost with a broken stream, a client that crashed or hung, a node that
was frozen longer than the lease. So a stage never fills up with the dead. A lease starts with the
sequence's first frame, so a sequence whose first renewal is still on its way keeps its place.

A lease runs while the node's loop could have heard renewals: a step holds the loop (a long prompt
chunk may take longer than a lease), and the renewals sent meanwhile wait behind it, so each step's
time is added to every lease, and to the groups' idle clocks, as is the time a sweep comes late
beyond the steps'. Steps back to back (a long prompt's chunks) leave the loop a turn between two, too
few for a renewal to get through in time: without this, their leases would run out under them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc

from ..proto import mtpipe_pb2 as pb

log = logging.getLogger(__name__)

LEASE_S = 5.0
SWEEP_S = 1.0
LATE_S = 0.25  # a sweep later than this held the loop up (a step): the leases stood still meanwhile


class Leases:
    """Expiry times of the sequences clients started (plain data; the service does the releasing)."""

    def __init__(self, lease_s: float = LEASE_S):
        self.lease_s = lease_s
        self.expires: dict[str, float] = {}

    def start(self, seq_id: str, now: float | None = None) -> None:
        self.expires[seq_id] = (now if now is not None else time.monotonic()) + self.lease_s

    def renew(self, seq_ids: list[str], owned: set[str], now: float | None = None) -> None:
        """Extend the leases of `seq_ids` that `owned` (the renewing client's sequences) holds."""
        until = (now if now is not None else time.monotonic()) + self.lease_s
        for seq_id in seq_ids:
            if seq_id in owned and seq_id in self.expires:
                self.expires[seq_id] = until

    def pause(self, seconds: float) -> None:
        """Every lease runs `seconds` longer: the loop that would have heard their renewals was held."""
        for seq_id in self.expires:
            self.expires[seq_id] += seconds

    def expired(self, now: float | None = None) -> list[str]:
        now = now if now is not None else time.monotonic()
        return [s for s, t in self.expires.items() if t < now]

    def end(self, seq_id: str) -> None:
        self.expires.pop(seq_id, None)


class LeaseHolder:
    """The node service's side (a mixin of NodeService, on its loop)."""

    _owners: dict[str, str]
    _leases: Leases | None = None
    _sweeping: bool = False
    _sweep_due: float = 0.0
    _held: float = 0.0  # the steps' time since the last sweep (already added to the leases)

    name: str
    _subs: dict[str, Any]

    def _release(self, seq_id: str) -> bool: ...  # NodeService's
    def _emit(self, client_id: str, event: pb.Event) -> None: ...  # NodeService's
    def left_to_the_ring(self, seq_id: str) -> bool: ...  # GroupFrames'
    def end_idle_groups(self, idle_s: float) -> None: ...  # GroupFrames'
    def pause_groups(self, seconds: float) -> None: ...  # GroupFrames'
    def has_groups(self) -> bool: ...  # GroupFrames'

    @property
    def leases(self) -> Leases:
        if self._leases is None:
            self._leases = Leases()
        return self._leases

    def lease(self, seq_id: str) -> None:
        """A client's sequence starts here: its lease runs from now; the sweep runs while any does."""
        self.leases.start(seq_id)
        if not self._sweeping:
            self._sweeping, self._held = True, 0.0
            self._next_sweep()

    def held(self, seconds: float) -> None:
        """A step held the loop this long: the leases and the groups' idle clocks stand still for it."""
        if seconds > LATE_S and self._leases is not None:
            self._leases.pause(seconds)
            self.pause_groups(seconds)
            self._held += seconds

    def _next_sweep(self) -> None:
        self._sweep_due = time.monotonic() + SWEEP_S
        asyncio.get_running_loop().call_later(SWEEP_S, self._sweep)

    def _sweep(self) -> None:
        late, self._held = time.monotonic() - self._sweep_due - self._held, 0.0
        if late > LATE_S:  # the loop was held (a step): no renewal could be heard meanwhile
            self.leases.pause(late)
            self.pause_groups(late)
        try:
            self._release_expired()
        except Exception:  # noqa: BLE001 - a failed sweep must not be the last one
            log.exception("the lease sweep failed")
        # (and while groups are held: a lost group's rows may have no lease left, their release deferred to
        # a next round that never comes, and only the sweep ends the group)
        self._sweeping = bool(self.leases.expires) or self.has_groups()
        if self._sweeping:
            self._next_sweep()

    def _release_expired(self) -> None:
        self.end_idle_groups(self.leases.lease_s)
        leases = self.leases
        gone = [s for s in leases.expired() if s in self._owners and not self.left_to_the_ring(s)]
        for seq_id in gone:
            client = self._owners[seq_id]
            self._release(seq_id)
            if client in self._subs:  # its client is still there (its renewals missed this node): say so
                message = f"{self.name} released it: no lease renewal came for {leases.lease_s:.0f} s"
                self._emit(client, pb.Event(error=pb.Error(code="ABORTED", message=message, node=self.name,
                                                           seq_id=seq_id)))
        for seq_id in leases.expired():  # released some other way meanwhile, or just now
            if seq_id not in self._owners:
                leases.end(seq_id)
        if gone:
            log.info("released %d sequence(s) whose client stopped renewing them for %.0f s", len(gone),
                     leases.lease_s)

    async def Renew(self, request: pb.RenewRequest, context: grpc.aio.ServicerContext) -> pb.RenewReply:
        owned = {s for s, c in self._owners.items() if c == request.client_id}
        self.leases.renew(list(request.seq_ids), owned)
        return pb.RenewReply(lease_s=self.leases.lease_s)

