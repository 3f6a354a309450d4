"""A launched node that follows a coordinator, until that one is gone and the vote falls on this node.

A coordinator that stops (killed, its machine off) sends no goodbye discovery can hear, so a follower asks
it directly, once a second: a Ping, else whether its port takes a connection (its loop busy in a long step
answers no Ping, while its kernel still takes connections). Once it has not answered for `lost_after`
seconds (cluster.yaml's `placement.heal_after_s`, as for a node whose layers the others take; `null`:
never), the nodes left elect again among those that answer now: each sees the same members, so they agree,
as at launch. A follower the vote falls on coordinates (it places the model over the others, which follow
it); the others follow it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

CHECK_S = 1.0  # how often a follower asks its coordinator
WAKE_S = 0.25  # the longest the waiting main thread sleeps (a signal's handler runs when it wakes)
PROBE_S = 1.0  # how long a Ping, or a connection, may take to count


def follow(me: str, coordinator: str, answers: Callable[[str], bool], elect: Callable[[], str | None],
           on_new: Callable[[str], None], lost_after: float | None, check_s: float = CHECK_S,
           clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """Block while this node follows; return once the nodes left elect it to coordinate. `answers(id)`:
    whether that node is there and coordinates; `elect()`: whom the nodes there elect (None: none of them
    can, as none holds the model: the coordinator is waited for); `on_new(id)`: the vote fell on another
    node, followed from now on. `lost_after` None: it follows until the process ends."""
    silent_since: float | None = None
    next_check = clock()
    said = ""
    while True:
        sleep(WAKE_S)
        now = clock()
        if lost_after is None or now < next_check:
            continue
        next_check = now + check_s
        try:
            there = answers(coordinator)
        except Exception:  # noqa: BLE001 - a check that fails says nothing: no election for it
            log.warning("cannot ask the coordinator %s", coordinator, exc_info=True)
            there = True
        if there:
            silent_since, said = None, ""
            continue
        if silent_since is None:
            if said != coordinator:  # (once while it stays silent, not at every round of waiting)
                log.warning("the coordinator %s does not answer; the nodes left elect another after %g s",
                            coordinator, lost_after)
            silent_since = now
        if now - silent_since < lost_after:
            continue
        try:
            chosen = elect()
        except Exception:  # noqa: BLE001 - tried again at the next check
            log.warning("the election after coordinator %s failed", coordinator, exc_info=True)
            continue
        silent_since = None
        if chosen is None:
            if said != coordinator:
                log.warning("no node left holds the model to coordinate: waiting for %s", coordinator)
            said = coordinator
            continue
        said = ""
        if chosen == me:
            return
        if chosen != coordinator:
            coordinator = chosen
            on_new(chosen)


class Watch:
    """A follower's view of the others: whether a node is there and coordinates (a Ping, which says so;
    else its port taking a connection, its loop busy in a long step), and whom the nodes there elect."""

    def __init__(self, me: Any, agent: Any, membership: Any, interfaces: list[Any], nodes: Sequence[Any],
                 secret: str | None):
        from .formation import static_reached

        self.me, self.agent, self.membership = me, agent, membership
        self.interfaces, self.nodes, self.secret = interfaces, nodes, secret
        self.static: dict[str, list[str]] = {}  # cluster.yaml's nodes by id: where they answered as it began
        for r in static_reached(nodes, secret, 0.0):
            self.static.setdefault(r.node_id, []).append(r.target)

    def targets(self, node_id: str) -> list[str]:
        from .membership import advert_targets

        ad = self.agent.peers().get(node_id) if self.agent is not None else None
        return advert_targets(self.interfaces, ad) if ad is not None else self.static.get(node_id, [])

    def _probe(self, node_id: str) -> tuple[bool, Any]:
        """(Whether it is there, its Ping's answer or None: there without one is a node busy in a long
        step.) Briefly, every address at once: a check that takes long delays the election it leads to."""
        from concurrent.futures import ThreadPoolExecutor

        from .health import first_reachable

        targets = self.targets(node_id)
        if not targets:
            return False, None
        with ThreadPoolExecutor(min(len(targets), 8)) as pool:
            pinged = list(pool.map(lambda t: first_reachable([t], self.secret, node_id, timeout=PROBE_S), targets))
            reached = next((r for r in pinged if r is not None), None)
            if reached is not None:
                return True, reached
            return any(pool.map(lambda t: accepts(t, PROBE_S), targets)), None

    def coordinates(self, node_id: str) -> bool:
        """There and coordinating (one that only follows is no coordinator to wait for); busy counts."""
        there, reached = self._probe(node_id)
        return there and (reached is None or reached.coordinator)

    def members(self) -> dict[str, Any]:
        """The members there now, this node's own advert (`me`) among them."""
        seen = self.membership.members(self.agent.peers()) if self.agent is not None else {}
        return {**{i: ad for i, ad in seen.items() if i != self.me.node_id and self._probe(i)[0]},
                self.me.node_id: self.me}

    def elect(self) -> str | None:
        """Whom the members there elect, among those that hold the model (None: none does)."""
        from .discovery import elect_coordinator
        from .formation import static_flags

        members = {i: ad for i, ad in self.members().items() if ad.has_model}
        listed = static_flags(self.nodes, self.secret, 0.0) if self.nodes else {}
        if not members and not listed:
            return None
        chosen = elect_coordinator(self.me.node_id, members, listed=listed)
        return None if chosen == self.me.node_id and not self.me.has_model else chosen


def accepts(target: str, timeout: float = 2.0) -> bool:
    """Whether a process listens at `target` (host:port): the kernel completes the handshake, so a node
    whose loop is busy in a long step, which answers no Ping then, still counts as there."""
    import socket

    from ...node.links import split_host_port

    try:
        with socket.create_connection(split_host_port(target), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False

