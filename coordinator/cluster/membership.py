"""Which discovered nodes belong to the cluster: the ones that proved it, not the ones that say so.

An advert is public: anyone on the LAN can send one with the cluster's hash, any node id, a huge
memory offer and the coordinator flag. A discovered node counts (waiting for peers, the election,
the placement) only after it answered, under the id it advertises, a Ping over a link that, with a
secret, is mutual TLS keyed by it; its coordinator flag is the one that Ping reports and the memory
it offers the one its Health reports over that link, not the advert's. Adverts are probed in
parallel as they arrive; a proof is kept for as long as the advert stays the same, a failure is
logged once and tried again a little later (a node may advertise a moment before it answers).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from ...node.advertise import NodeAdvert
from ...node.links import Interface
from ...node.sysinfo import machine_id, memory_offered, sharing
from .formation import resources_from_advert
from .health import Reached, first_reachable
from .placement import hop_candidates

log = logging.getLogger(__name__)

Key = tuple[str, tuple[str, ...], bool]  # node id, where it is reached, whether the advert claims to coordinate

PROOF_TIMEOUT_S = 2.0
RETRY_S = 2.0
MAX_PROBES = 16  # at once


def advert_targets(local: list[Interface], ad: NodeAdvert) -> list[str]:
    """Where this machine can reach an advertised node, best link first."""
    return [c.target for c in hop_candidates(local, resources_from_advert(ad, 0))]


class Membership:
    """Proofs of membership, one probe per advert (see the module docstring)."""

    def __init__(self, me: str, local: list[Interface], secret: str | None, timeout: float = PROOF_TIMEOUT_S,
                 retry_s: float = RETRY_S, clock: Callable[[], float] = time.monotonic):
        self.me, self.local, self.secret = me, local, secret
        self.timeout, self.retry_s, self.clock = timeout, retry_s, clock
        self._proven: dict[Key, Reached] = {}  # -> how it answered
        self._health: dict[Key, Any] = {}  # -> its Health reply (the memory it offers, its machine)
        self._member_health: dict[str, Any] = {}  # node id -> the Health of the member under that id
        self._failed: dict[Key, float] = {}  # -> when it last failed

    def _key(self, ad: NodeAdvert) -> Key:
        # The coordinator flag is part of it: a node's advert that starts to claim it is checked again.
        return ad.node_id, tuple(advert_targets(self.local, ad)), ad.coordinator

    def _due(self, key: Key, now: float) -> bool:
        failed = self._failed.get(key)
        return key not in self._proven and (failed is None or now - failed >= self.retry_s)

    def _prove(self, key: Key) -> Reached | None:
        import grpc

        from ...node.wire import make_channel
        from ...proto import mtpipe_pb2 as pb
        from ...proto import mtpipe_pb2_grpc as pb_grpc

        node_id, targets, _ = key
        reached = first_reachable(list(targets), self.secret, node_id, timeout=self.timeout)
        if reached is not None:
            try:
                with make_channel(reached.target, self.secret) as channel:
                    health = pb_grpc.NodeStub(channel).Health(pb.HealthRequest(), timeout=self.timeout)
            except grpc.RpcError:
                return None  # (answered a Ping, then not: tried again later)
            self._health[key] = health
        return reached

    def address(self, ad: NodeAdvert) -> str | None:
        """Where a proven node answered (None if it has not proved it belongs)."""
        reached = self._proven.get(self._key(ad))
        return reached.target if reached is not None else None

    def members(self, peers: dict[str, NodeAdvert]) -> dict[str, NodeAdvert]:
        """The peers that proved they belong (this node always does), probing the ones not yet tried."""
        keys = {node_id: self._key(ad) for node_id, ad in peers.items() if node_id != self.me}
        now = self.clock()
        due = [(node_id, key) for node_id, key in keys.items() if self._due(key, now)]
        if due:
            with ThreadPoolExecutor(min(len(due), MAX_PROBES)) as pool:
                results = list(pool.map(self._prove, [key for _, key in due]))
            for (node_id, key), reached in zip(due, results):
                if reached is not None:
                    self._proven[key] = reached
                    self._failed.pop(key, None)
                    continue
                if key not in self._failed:
                    log.warning("node %s (advertised from %s) did not prove it belongs to this cluster at %s: "
                                "left out (not reached there, or not this cluster's secret)", node_id,
                                ", ".join(peers[node_id].addresses) or "?", ", ".join(key[1]) or "no address")
                self._failed[key] = self.clock()
        proven = {node_id: key for node_id, key in keys.items() if key in self._proven}
        self._member_health = {node_id: self._health[key] for node_id, key in proven.items()}
        return {node_id: ad if node_id == self.me else self._as_proven(ad, keys[node_id])
                for node_id, ad in peers.items() if node_id == self.me or node_id in proven}

    def _as_proven(self, ad: NodeAdvert, key: Key) -> NodeAdvert:
        """The advert with what the node said over the authenticated link: its coordinator flag, and the
        memory it offers (a forged copy of its advert may claim any)."""
        return replace(ad, coordinator=self._proven[key].coordinator, mem_available=memory_offered(self._health[key]))

    def shared(self, members: dict[str, NodeAdvert], own: Callable[[int], int]) -> dict[str, NodeAdvert]:
        """`members` (as `members` gave them, this node's own advert among them) with the memory each offers
        as its share of its machine: nodes on one machine (their Health's `machine`; this node's is this
        machine, and `own(k)` what it offers with k nodes there) share what it has free, as a static
        cluster's placement counts them. A launched node's cap (--max-memory) is its own, not shared."""
        healths = [None if node_id == self.me else self._member_health.get(node_id) for node_id in members]
        counts = sharing([machine_id() if node_id == self.me else getattr(h, "machine", "")
                          for node_id, h in zip(members, healths)])
        return {node_id: ad if k == 1 else replace(ad, mem_available=own(k) if node_id == self.me
                                                   else memory_offered(h, k) if h is not None else ad.mem_available)
                for (node_id, ad), h, k in zip(members.items(), healths, counts)}

    def report(self, peers: dict[str, NodeAdvert]) -> tuple[list[str], dict[str, str]]:
        """Without probing: the ids of the peers that proved they belong, and why each other is left out."""
        members, left_out = [], {}
        for node_id, ad in peers.items():
            key = self._key(ad)
            if node_id == self.me or key in self._proven:
                members.append(node_id)
            else:
                left_out[node_id] = "did not prove it belongs" if key in self._failed else "not checked"
        return sorted(members), left_out


def members_only(peers: dict[str, NodeAdvert], me: str, local: list[Interface], secret: str | None,
                 timeout: float = PROOF_TIMEOUT_S) -> dict[str, NodeAdvert]:
    """The peers that prove they belong, each probed once now."""
    return Membership(me, local, secret, timeout).members(peers)
