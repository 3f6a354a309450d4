"""Finding the nodes of one cluster: browse `_mtpipe._tcp.local.`, resolve, track joins and leaves.

Advertisements of other clusters (another cluster-name hash) and malformed ones are ignored.
Everything runs on the asyncio loop that owns the AsyncZeroconf. Questions ask for multicast
answers (QM): several mtpipe processes on one host share port 5353, and a unicast answer would
reach only one of them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ...node.advertise import SERVICE_TYPE, NodeAdvert, decode_txt

log = logging.getLogger(__name__)

RESOLVE_TIMEOUT_MS = 3000


class Discovery:
    def __init__(
        self,
        azc,
        cluster_hash: str,
        *,
        on_change: Callable[[str, NodeAdvert], None] | None = None,
    ):
        self.azc = azc
        self.cluster_hash = cluster_hash
        self.on_change = on_change  # ("join" | "update" | "leave", advert)
        self.peers: dict[str, NodeAdvert] = {}  # node id -> advert
        self.ignored: dict[str, str] = {}  # service name -> why
        self.last_change = time.monotonic()
        self._names: dict[str, str] = {}  # service name -> node id
        self._tasks: set[asyncio.Task] = set()
        self._changed = asyncio.Condition()
        self._browser = None

    async def start(self) -> None:
        from zeroconf import DNSQuestionType
        from zeroconf.asyncio import AsyncServiceBrowser

        self._browser = AsyncServiceBrowser(self.azc.zeroconf, SERVICE_TYPE, handlers=[self._on_state_change],
                                            question_type=DNSQuestionType.QM)

    async def stop(self) -> None:
        if self._browser is not None:
            await self._browser.async_cancel()
            self._browser = None
        for task in list(self._tasks):
            task.cancel()

    # -- zeroconf callbacks (on the loop) -------------------------------------------------

    def _on_state_change(self, zeroconf, service_type: str, name: str, state_change) -> None:
        from zeroconf import ServiceStateChange

        if state_change is ServiceStateChange.Removed:
            task = asyncio.ensure_future(self._remove(name))
        else:
            task = asyncio.ensure_future(self._resolve(name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, name: str) -> None:
        from zeroconf import DNSQuestionType
        from zeroconf.asyncio import AsyncServiceInfo

        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(self.azc.zeroconf, RESOLVE_TIMEOUT_MS, question_type=DNSQuestionType.QM):
            log.debug("could not resolve %s", name)
            return
        try:
            ad = decode_txt(info.properties, tuple(info.parsed_scoped_addresses()))
        except ValueError as e:
            self.ignored[name] = str(e)
            log.warning("ignoring %s: %s", name, e)
            return
        if ad.cluster_hash != self.cluster_hash:
            if name not in self.ignored:
                log.info("ignoring node %s: it belongs to another cluster", ad.node_id)
            self.ignored[name] = "another cluster"
            return
        kind = "update" if ad.node_id in self.peers else "join"
        self.peers[ad.node_id] = ad
        self._names[name] = ad.node_id
        if kind == "join":
            log.info("node %s joined (%s, %.1f GiB available); %d node(s)", ad.node_id, ad.chip,
                     ad.mem_available / 2**30, len(self.peers))
        await self._notify(kind, ad)

    async def _remove(self, name: str) -> None:
        node = self._names.pop(name, None)
        self.ignored.pop(name, None)
        ad = self.peers.pop(node, None) if node else None
        if ad is not None:
            log.info("node %s left; %d node(s)", node, len(self.peers))
            await self._notify("leave", ad)

    async def _notify(self, kind: str, ad: NodeAdvert) -> None:
        self.last_change = time.monotonic()
        if self.on_change is not None:
            self.on_change(kind, ad)
        async with self._changed:
            self._changed.notify_all()

    # -- waiting ----------------------------------------------------------------------------

    async def wait_for(self, predicate: Callable[[dict[str, NodeAdvert]], bool], timeout: float) -> bool:
        """Wait until predicate(peers) holds; False on timeout."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: predicate(self.peers)), timeout)
                return True
            except TimeoutError:
                return False

    async def wait_count(self, count: int, timeout: float) -> bool:
        return await self.wait_for(lambda peers: len(peers) >= count, timeout)

    async def settle(self, quiet: float, timeout: float) -> None:
        """Wait until nothing joined or left for `quiet` seconds (at most `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            remaining = min(self.last_change + quiet, deadline) - now
            if remaining <= 0:
                return
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except TimeoutError:
                    pass


def elect_coordinator(me: str, peers: dict[str, NodeAdvert], forced: bool = False,
                      listed: dict[str, bool] | None = None, taking_over: bool = False) -> str:
    """The coordinator: this node if started with --coordinator; else a node that says it coordinates
    (the lowest such id); else the lowest id of a node that has the model (it serves the others their
    shards), else the lowest id. Every node that sees the same peers agrees. `listed`: cluster.yaml's
    nodes that answered, by id, each with whether it says it coordinates. ValueError for --coordinator
    where another node says it coordinates (a cluster has one), unless `taking_over` (--take-over)."""
    flags = {ad.node_id: ad.coordinator for ad in peers.values()} | (listed or {})
    flagged = sorted(node_id for node_id, flag in flags.items() if flag and node_id != me)
    if forced and flagged and not taking_over:
        raise ValueError(f"started with --coordinator, and node {', '.join(flagged)} coordinates this cluster too "
                         f"(started with --coordinator, or serving as its coordinator): a cluster has one; stop "
                         f"that one, start {me} without --coordinator, or with --take-over")
    if forced:
        return me
    if flagged:
        return flagged[0]
    ids = {me, *flags}
    with_model = [node_id for node_id in ids if node_id not in peers or peers[node_id].has_model]
    return min(with_model or ids)
