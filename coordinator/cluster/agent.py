"""Advertisement and discovery of a cluster's nodes, and which addresses they run on.

Zeroconf is bound to explicit addresses, never to every interface: by default the machine's
Ethernet and Wi-Fi addresses, else its Thunderbolt ones (multicast can loop around a ring of Macs
on one Thunderbolt Bridge). Each node offers the memory it has available, capped by its config.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ...node.advertise import Advertiser, NodeAdvert, cluster_hash, open_zeroconf
from ...node.links import Interface, LinkType, strip_scope
from .config import ClusterConfig
from .discovery import Discovery
from .placement import GiB

log = logging.getLogger(__name__)

PROOF_POLL_S = 0.5  # while waiting for peers: how often proofs that failed may be tried again
_DEFAULT_DISCOVERY = ((LinkType.ETHERNET, LinkType.WIFI), (LinkType.THUNDERBOLT,))  # the first kinds present


def discovery_addresses(wanted: list[str], interfaces: list[Interface]) -> list[str]:
    """Addresses to bind zeroconf to: each entry an address, or an interface name (its IPv4 addresses).

    With none given: the IPv4 addresses of this machine's Ethernet and Wi-Fi interfaces, or of its
    Thunderbolt ones when it has neither (multicast can loop around a ring of Macs on one Thunderbolt
    Bridge; Thunderbolt addresses are advertised for hops all the same). Never 'all interfaces'.
    """
    by_name = {i.name: i for i in interfaces}
    out: list[str] = []
    for entry in wanted:
        if entry in by_name:
            v4 = [str(n.ip) for n in by_name[entry].networks() if n.version == 4]
            if not v4:
                raise ValueError(f"interface {entry} has no IPv4 address to discover peers on")
            out += v4
        else:
            try:
                ipaddress.ip_address(strip_scope(entry)[0])
            except ValueError:
                raise ValueError(f"--interface {entry}: neither an address nor an interface of this machine "
                                 "that is up with an address") from None
            address = strip_scope(entry)[0]
            if interfaces and not any(n.ip == ipaddress.ip_address(address) for i in interfaces for n in i.networks()):
                raise ValueError(f"--interface {entry}: not an address of this machine (its interfaces have "
                                 f"{', '.join(str(n.ip) for i in interfaces for n in i.networks()) or 'none'})")
            out.append(address)  # (zeroconf takes addresses unscoped: it finds their interface)
    for links in ([] if wanted else _DEFAULT_DISCOVERY):
        out = [str(n.ip) for i in interfaces if i.link in links for n in i.networks() if n.version == 4]
        if out:
            break
    if not out:
        raise ValueError("no network interface to discover peers on; name one with --interface")
    return list(dict.fromkeys(out))


def advertised_interfaces(interfaces: list[Interface], bind: list[str]) -> tuple[Interface, ...]:
    """What peers may use to reach this node: every interface but loopback (unless discovery runs on it)."""
    on_loopback = any(ipaddress.ip_address(strip_scope(a)[0]).is_loopback for a in bind)
    return tuple(i for i in interfaces if i.link is not LinkType.LOOPBACK or on_loopback)


class ClusterAgent:
    """Zeroconf advertisement and browsing on a private event loop (uvicorn owns the main thread's)."""

    def __init__(self, bind: list[str], advert: NodeAdvert | None, cluster: str,
                 on_change: Callable[[str, NodeAdvert], None] | None = None,
                 memory_offered: Callable[[], int] | None = None):
        self.bind = bind
        self.advert = advert
        self.memory_offered = memory_offered
        self._refresh: asyncio.Task | None = None
        self.hash = cluster_hash(cluster)
        self.on_change = on_change
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="zeroconf", daemon=True)
        self.azc = self.advertiser = self.discovery = None

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> ClusterAgent:
        self.thread.start()
        self.run(self._start(), timeout=30)
        return self

    async def _start(self) -> None:
        self.azc = open_zeroconf(self.bind)
        self.discovery = Discovery(self.azc, self.hash, on_change=self.on_change)
        await self.discovery.start()
        if self.advert is not None:
            self.advertiser = Advertiser(self.azc, self.advert, self.bind)
            await self.advertiser.start()
            if self.memory_offered is not None:
                self._refresh = asyncio.get_running_loop().create_task(
                    self.advertiser.keep_memory_current(self.memory_offered))

    def peers(self) -> dict[str, NodeAdvert]:
        return self.run(self._snapshot())

    async def _snapshot(self) -> dict[str, NodeAdvert]:
        return dict(self.discovery.peers)

    def set_coordinator(self, coordinating: bool = True) -> None:
        if self.advertiser is not None:
            self.run(self.advertiser.update(coordinator=coordinating), timeout=10)

    def stop(self) -> None:
        if not self.thread.is_alive():
            return
        try:
            self.run(self._stop(), timeout=10)
        except Exception as e:  # shutting down: say so, never hang
            log.debug("zeroconf shutdown: %s", e)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def _stop(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
        if self.advertiser is not None:
            await self.advertiser.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        if self.azc is not None:
            await self.azc.async_close()
        # Zeroconf's own broadcasts (an update's, a goodbye's) may still be pending: ended here, they do
        # not outlive the loop (and are not reported destroyed while pending at exit).
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in rest:
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)


def offered_memory(available: int, max_memory_gib: float | None) -> int:
    """What this node offers a placement: the memory available, capped by `node.max_memory_gib`."""
    return available if max_memory_gib is None else min(available, int(max_memory_gib * GiB))


def wait_for_peers(agent: ClusterAgent, me: str, cfg: ClusterConfig, forced: bool,
                   members: Callable[[dict[str, NodeAdvert]], dict[str, NodeAdvert]],
                   listed: Callable[[], set[str]] = set) -> dict[str, NodeAdvert]:
    """The nodes that proved they belong (`members`, membership.py), this one included. With `expect`:
    wait for that many (or, unless coordinating, for a coordinator among them), at most `settle`
    seconds; cluster.yaml's nodes that answer (`listed`: their ids) count too. Without: wait until
    nothing joined or left for `settle` seconds. Adverts alone count for nothing, so a rogue one can
    neither end the wait early nor win the election."""
    expect, settle = cfg.discovery.expect, cfg.discovery.settle
    d = agent.discovery
    if expect is None:
        agent.run(d.settle(settle, settle * 6))
        return members(agent.peers())

    def enough(peers: dict[str, NodeAdvert], found: int) -> bool:
        return found >= expect or (not forced and any(a.coordinator and a.node_id != me for a in peers.values()))

    start = time.monotonic()
    deadline = start + settle
    while True:
        peers = agent.peers()
        proven = members(peers)
        found = len(set(proven) | listed() | {me})
        remaining = deadline - time.monotonic()
        if enough(proven, found) or remaining <= 0:
            break
        seen = len(peers)
        # Until the adverts change, or a little while: a proof that failed is tried again.
        agent.run(d.wait_for(lambda peers, seen=seen: len(peers) != seen, min(remaining, PROOF_POLL_S)))
    if found < expect and remaining > 0:  # (a coordinator among them: the cluster is formed, it is joined)
        log.info("found %d of %d expected node(s), a coordinator among them", found, expect)
    elif found < expect:
        log.warning("found %d of %d expected node(s) after %.0f s; going on with them", found, expect,
                    time.monotonic() - start)
    return proven
