"""Zeroconf advertisement of a node: `_mtpipe._tcp.local.` with what placement needs in TXT.

TXT keys (each `key=value` at most 255 bytes; nothing secret, the cluster is named by a hash):
  id     persistent node id            ch   hash of the cluster name
  mt/ma  memory total/available bytes  chip chip or device name
  v      mtpipe version                port gRPC port
  co     "1" if started as coordinator i0, i1, ... one interface each: "link|name|cidr,cidr"

Zeroconf is always bound to an explicit list of interface addresses, never to all interfaces.
The memory a node offers is republished when it moves, so a coordinator started later places by
what is free now, not by what was free when the node started.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .identity import is_node_id
from .links import Interface, LinkType

log = logging.getLogger(__name__)

SERVICE_TYPE = "_mtpipe._tcp.local."
MEMORY_REFRESH_S = 30.0
MAX_TXT_ENTRY = 255
_LINK_CODES = {
    LinkType.THUNDERBOLT: "tb",
    LinkType.ETHERNET: "eth",
    LinkType.WIFI: "wifi",
    LinkType.LOOPBACK: "lo",
    LinkType.OTHER: "other",
}
_LINK_FROM_CODE = {v: k for k, v in _LINK_CODES.items()}


def cluster_hash(name: str) -> str:
    """What a node says about its cluster in public: a hash of the name (never the secret)."""
    return hashlib.sha256(f"mtpipe-cluster:{name}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class NodeAdvert:
    node_id: str
    cluster_hash: str
    port: int  # gRPC
    mem_total: int
    mem_available: int
    chip: str
    version: str
    interfaces: tuple[Interface, ...] = ()
    coordinator: bool = False
    has_model: bool = True  # the model is on this machine: it can coordinate without fetching it first
    # Filled in by discovery from the A/AAAA records: where the advertisement came from.
    addresses: tuple[str, ...] = field(default=(), compare=False)

    @property
    def service_name(self) -> str:
        return f"mtpipe-{self.node_id}.{SERVICE_TYPE}"


def _encode_interface(iface: Interface) -> str | None:
    value = f"{_LINK_CODES[iface.link]}|{iface.name}|"
    kept = []
    for addr in iface.addresses:
        candidate = value + ",".join(kept + [addr])
        if len(candidate.encode()) + 4 > MAX_TXT_ENTRY:  # room for "iNN="
            log.debug("TXT: dropping address %s of %s (entry full)", addr, iface.name)
            continue
        kept.append(addr)
    return value + ",".join(kept) if kept else None


def encode_txt(ad: NodeAdvert) -> dict[str, str]:
    txt = {
        "id": ad.node_id,
        "ch": ad.cluster_hash,
        "mt": str(ad.mem_total),
        "ma": str(ad.mem_available),
        "chip": ad.chip[:100],
        "v": ad.version,
        "port": str(ad.port),
        "co": "1" if ad.coordinator else "0",
        "mo": "1" if ad.has_model else "0",
    }
    n = 0
    for iface in ad.interfaces:
        value = _encode_interface(iface)
        if value is not None:
            txt[f"i{n}"] = value
            n += 1
    for k, v in txt.items():
        if len(f"{k}={v}".encode()) > MAX_TXT_ENTRY:
            raise ValueError(f"TXT entry {k} is longer than {MAX_TXT_ENTRY} bytes")
    return txt


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")


def decode_txt(properties: dict[bytes | str, bytes | str | None], addresses: tuple[str, ...] = ()) -> NodeAdvert:
    """The inverse of encode_txt; raises ValueError on a malformed or foreign record."""
    p = {_text(k): _text(v) for k, v in properties.items()}
    if not is_node_id(p.get("id", "")):
        raise ValueError(f"not a node id: {p.get('id', '')[:70]!r}")
    try:
        interfaces = []
        for i in range(64):
            value = p.get(f"i{i}")
            if value is None:
                break
            code, name, addrs = value.split("|", 2)
            cidrs = tuple(a for a in addrs.split(",") if a)
            for a in cidrs:
                ipaddress.ip_interface(a)
            interfaces.append(Interface(name, _LINK_FROM_CODE.get(code, LinkType.OTHER), cidrs))
        return NodeAdvert(
            node_id=p["id"],
            cluster_hash=p["ch"],
            port=int(p["port"]),
            mem_total=int(p["mt"]),
            mem_available=int(p["ma"]),
            chip=p.get("chip", ""),
            version=p.get("v", ""),
            interfaces=tuple(interfaces),
            coordinator=p.get("co") == "1",
            has_model=p.get("mo", "1") == "1",
            addresses=addresses,
        )
    except (KeyError, ValueError) as e:
        raise ValueError(f"malformed mtpipe TXT record: {e}") from e


def open_zeroconf(addresses: list[str]):
    """An AsyncZeroconf bound to exactly these interface addresses (never all interfaces)."""
    from zeroconf.asyncio import AsyncZeroconf

    if not addresses:
        raise ValueError("zeroconf needs at least one interface address to bind to")
    return AsyncZeroconf(interfaces=[str(ipaddress.ip_address(a)) for a in addresses])


def needs_republish(published: int, now: int) -> bool:
    """A TXT update goes to every peer by multicast: only for a real change (5%, and at least 256 MiB)."""
    return abs(now - published) > max(published // 20, 256 << 20)


class Advertiser:
    """Registers one node's service; `update` republishes the TXT record (e.g. memory changed)."""

    def __init__(self, azc, advert: NodeAdvert, addresses: list[str]):
        self.azc = azc
        self.advert = advert
        self.addresses = [str(ipaddress.ip_address(a)) for a in addresses]
        self.info = None
        self._announcing: Any = None  # zeroconf's task sending the last (re)announcements

    def _service_info(self):
        from zeroconf.asyncio import AsyncServiceInfo

        return AsyncServiceInfo(
            SERVICE_TYPE,
            self.advert.service_name,
            parsed_addresses=self.addresses,
            port=self.advert.port,
            properties=encode_txt(self.advert),
            server=f"mtpipe-{self.advert.node_id}.local.",
        )

    async def start(self) -> None:
        from zeroconf import NonUniqueNameException

        self.info = self._service_info()
        try:  # (the announcements go out meanwhile: `stop` waits for them, or ends them)
            self._announcing = await self.azc.async_register_service(self.info)
        except NonUniqueNameException:
            raise ValueError(f"another node on this network advertises the id {self.advert.node_id!r}: each needs "
                             "its own (a copied state directory? delete its node_id file for a new id)") from None
        log.info("advertising %s on %s port %d", self.advert.service_name, ", ".join(self.addresses), self.advert.port)

    async def update(self, **changes) -> None:
        self.advert = replace(self.advert, **changes)
        self.info = self._service_info()
        self._announcing = await self.azc.async_update_service(self.info)

    async def keep_memory_current(self, offered: Callable[[], int], interval: float = MEMORY_REFRESH_S) -> None:
        """Every `interval`, republish `mem_available` if what `offered()` says has moved (until cancelled)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            try:
                now = await loop.run_in_executor(None, offered)  # psutil and MLX device info block
            except (OSError, ValueError, subprocess.SubprocessError) as e:
                log.debug("cannot read memory: %s", e)
                continue
            if needs_republish(self.advert.mem_available, now):
                log.info("memory offered %.1f -> %.1f GiB; republishing", self.advert.mem_available / 2**30,
                         now / 2**30)
                await self.update(mem_available=now)

    async def stop(self) -> None:
        """Unregister, waiting until the goodbye is sent so peers see this node leave at once."""
        if self._announcing is not None and not self._announcing.done():
            self._announcing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._announcing
        if self.info is not None:
            await (await self.azc.async_unregister_service(self.info))
            self.info = None
