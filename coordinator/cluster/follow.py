"""A launched node that follows a coordinator, until that one is gone and the vote falls on this node.

A coordinator that stops (killed, its machine off) sends no goodbye discovery can hear, so a follower asks
it directly, once a second: a Ping, else whether its port takes a connection (its loop busy in a long step
answers no Ping, while its kernel still takes connections). Once it has not answered for `lost_after` seconds (cluster.yaml's
`placement.heal_after_s`, as for a node whose layers the others take; `null`: never), the nodes left elect
again among those that answer now: each sees the same members, so they agree, as at launch. A follower the
vote falls on coordinates (it places the model over the others, which follow it); the others follow it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

CHECK_S = 1.0  # how often a follower asks its coordinator
WAKE_S = 0.25  # the longest the waiting main thread sleeps (a signal's handler runs when it wakes)


def follow(me: str, coordinator: str, answers: Callable[[str], bool], elect: Callable[[], str],
           on_new: Callable[[str], None], lost_after: float | None, check_s: float = CHECK_S,
           clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """Block while this node follows; return once the nodes left elect it to coordinate. `answers(id)`:
    whether that node answers now; `elect()`: whom the nodes answering now elect; `on_new(id)`: the vote
    fell on another node, followed from now on. `lost_after` None: it follows until the process ends."""
    silent_since: float | None = None
    next_check = clock()
    while True:
        sleep(WAKE_S)
        now = clock()
        if lost_after is None or now < next_check:
            continue
        next_check = now + check_s
        if answers(coordinator):
            silent_since = None
            continue
        if silent_since is None:
            log.warning("the coordinator %s does not answer; the nodes left elect another after %g s",
                        coordinator, lost_after)
            silent_since = now
        if now - silent_since < lost_after:
            continue
        chosen = elect()
        silent_since = None
        if chosen == me:
            return
        if chosen != coordinator:
            coordinator = chosen
            on_new(chosen)


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


def static_addresses(nodes: Sequence[Any], secret: str | None) -> dict[str, list[str]]:
    """cluster.yaml's nodes that answer now, by id: where each answered (a node discovery does not see)."""
    import grpc

    from .health import ping

    out: dict[str, list[str]] = {}
    for n in nodes:
        try:
            out.setdefault(ping(n.address, secret, timeout=2.0).node_id, []).append(n.address)
        except grpc.RpcError:
            continue
    return out
