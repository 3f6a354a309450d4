"""This machine's network interfaces and what kind of link each one is.

Link types: thunderbolt, ethernet, wifi, loopback, other. On macOS `networksetup
-listallhardwareports` names the ports ("Thunderbolt Bridge", "Thunderbolt 1", "Wi-Fi", ...) and
`ifconfig` gives the addresses; on Linux `ip -j addr` gives the addresses and /sys/class/net the
driver (thunderbolt-net), wireless-ness and hardware type. Every parser is a pure function of the
command output so it is tested on recorded output.

Addresses are kept as CIDR strings without scope ("169.254.3.7/16", "fe80::1/64"): a scope id
names an interface of the machine that connects, so it is added only when a hop is chosen.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_PORT = 52700  # a node's gRPC port, where an address names none


class LinkType(str, Enum):
    THUNDERBOLT = "thunderbolt"
    ETHERNET = "ethernet"
    WIFI = "wifi"
    LOOPBACK = "loopback"
    OTHER = "other"


# Preference for a hop between two machines. Loopback is only ever shared by nodes on one host.
LINK_RANK = {
    LinkType.LOOPBACK: 4,
    LinkType.THUNDERBOLT: 3,
    LinkType.ETHERNET: 2,
    LinkType.WIFI: 1,
    LinkType.OTHER: 0,
}


@dataclass(frozen=True)
class Interface:
    name: str
    link: LinkType
    addresses: tuple[str, ...]  # CIDR, no scope id

    def networks(self) -> list[ipaddress.IPv4Interface | ipaddress.IPv6Interface]:
        return [ipaddress.ip_interface(a) for a in self.addresses]


def is_link_local(addr: ipaddress.IPv4Interface | ipaddress.IPv6Interface | ipaddress._BaseAddress) -> bool:
    """169.254/16 and fe80::/10: every such interface is 'on' the same prefix, so a prefix match proves nothing."""
    ip = addr.ip if hasattr(addr, "ip") else addr
    return ip.is_link_local


def strip_scope(address: str) -> tuple[str, str | None]:
    """'fe80::1%en0' -> ('fe80::1', 'en0')."""
    addr, _, scope = address.partition("%")
    return addr, scope or None


def bind_problem(host: str, port: int) -> str | None:
    """Why this machine cannot listen on host:port (in use, not one of its addresses, no such name), or
    None: asked of the OS before a server that would only say that it failed."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as the servers bind)
        try:
            sock.bind((strip_scope(host)[0] if family == socket.AF_INET6 else host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def format_host_port(host: str, port: int, scope: str | None = None) -> str:
    """A gRPC target: 'a.b.c.d:p', '[v6]:p', '[fe80::1%en0]:p' for a scoped link-local address, 'name:p'."""
    addr, own_scope = strip_scope(host)
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return f"{host}:{port}"  # a host name
    if ip.version == 4:
        return f"{ip}:{port}"
    scope = (scope or own_scope) if ip.is_link_local else None
    return f"[{ip}%{scope}]:{port}" if scope else f"[{ip}]:{port}"


_HOST_NAME = re.compile(r"(?=.{1,253}\.?$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                        r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")


def is_host(host: str) -> bool:
    """An IP address (IPv6 scoped or not) or a host name."""
    try:
        ipaddress.ip_address(strip_scope(host)[0])
    except ValueError:
        return _HOST_NAME.fullmatch(host) is not None
    return True


def split_host_port(target: str, default_port: int | None = None) -> tuple[str, int]:
    """'h:p', '[v6%scope]:p', 'v6', 'h' -> (host, port); the port defaults to `default_port`. The host is
    an IP address (IPv6 scoped or not) or a host name; anything else is a ValueError."""
    target = target.strip()
    if target.startswith("["):
        host, closed, rest = target[1:].partition("]")
        if not closed or rest and not rest.startswith(":"):
            raise ValueError(f"{target!r} is not [address]:port")
        port, has_port = rest[1:], bool(rest)
        if ":" not in host:
            raise ValueError(f"{target!r}: only an IPv6 address goes in brackets")
    elif target.count(":") == 1:
        host, _, port = target.partition(":")
        has_port = True
    else:
        host, port, has_port = target, "", False  # a host name, IPv4, or bare IPv6
    if not is_host(host):
        raise ValueError(f"{target!r}: {host!r} is neither an IP address nor a host name")
    if not has_port:
        if default_port is None:
            raise ValueError(f"{target!r} has no port")
        return host, default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{target!r}: {port!r} is not a TCP port")
    return host, int(port)


# -- macOS ------------------------------------------------------------------------------------


def classify_port(port: str) -> LinkType:
    """A `networksetup` hardware port name -> link type. macOS names some ports in the system's language
    (Wi-Fi is "WLAN" on a German Mac)."""
    p = port.strip().lower()
    if p == "thunderbolt bridge" or re.fullmatch(r"thunderbolt \d+", p):
        return LinkType.THUNDERBOLT
    if any(name in p for name in ("wi-fi", "wifi", "wlan", "airport", "wireless")):
        return LinkType.WIFI
    if "ethernet" in p or re.search(r"\blan\b", p):
        return LinkType.ETHERNET
    return LinkType.OTHER


def parse_networksetup(text: str) -> dict[str, LinkType]:
    """`networksetup -listallhardwareports` -> {device: link type}."""
    out: dict[str, LinkType] = {}
    port = None
    for line in text.splitlines():
        if line.startswith("Hardware Port:"):
            port = line.split(":", 1)[1].strip()
        elif line.startswith("Device:") and port is not None:
            device = line.split(":", 1)[1].strip()
            if device:
                out[device] = classify_port(port)
            port = None
    return out


def _mask_to_prefix(mask: str) -> int:
    value = int(mask, 16) if mask.startswith("0x") else int(ipaddress.IPv4Address(mask))
    return value.bit_count()


def parse_ifconfig(text: str) -> dict[str, dict]:
    """macOS `ifconfig` -> {name: {"addresses": [cidr...], "loopback": bool, "up": bool}}."""
    out: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"^([\w.\-]+): flags=\w+<([^>]*)>", line)
        if head:
            flags = head.group(2).split(",")
            current = {"addresses": [], "loopback": "LOOPBACK" in flags, "up": "UP" in flags, "active": True,
                       "members": []}
            out[head.group(1)] = current
            continue
        if current is None or not line[:1].isspace():
            continue
        fields = line.split()
        if fields[0] == "inet" and len(fields) >= 4 and fields[2] == "netmask":
            current["addresses"].append(f"{fields[1]}/{_mask_to_prefix(fields[3])}")
        elif fields[0] == "inet6" and "prefixlen" in fields:
            addr, _ = strip_scope(fields[1])
            current["addresses"].append(f"{addr}/{fields[fields.index('prefixlen') + 1]}")
        elif fields[0] == "status:":
            current["active"] = fields[1] == "active"
        elif fields[0] == "member:" and len(fields) > 1:  # a bridge's
            current["members"].append(fields[1])
    return out


def _bridge_link(members: list[str], ports: dict[str, LinkType]) -> LinkType:
    """A bridge `networksetup` does not list: a Thunderbolt link if every member is a Thunderbolt port."""
    if members and all(ports.get(m) is LinkType.THUNDERBOLT for m in members):
        return LinkType.THUNDERBOLT
    return LinkType.OTHER


def macos_interfaces(networksetup: str, ifconfig: str) -> list[Interface]:
    ports = parse_networksetup(networksetup)
    result = []
    for name, info in parse_ifconfig(ifconfig).items():
        if not info["up"] or not info["active"] or not info["addresses"]:
            continue
        link = LinkType.LOOPBACK if info["loopback"] else ports.get(name, _bridge_link(info["members"], ports))
        result.append(Interface(name, link, tuple(info["addresses"])))
    return result


BRIDGE_OFF = 'sudo networksetup -setnetworkserviceenabled "Thunderbolt Bridge" off'


def bridge_loops(networksetup: str, ifconfig: str) -> list[str]:
    """A warning for each bridge that joins two or more connected Thunderbolt ports. macOS bridges its
    Thunderbolt ports by default, without spanning tree; where the cables form a loop (a ring of three
    or more Macs, as exo warns, or two joined by two cables) the bridges pass each other's broadcasts
    round it without end and the links flood. A Mac in the middle of a chain bridges two ports without
    a loop, and one Mac sees only its own ports: a warning, not a refusal."""
    ports = parse_networksetup(networksetup)
    parsed = parse_ifconfig(ifconfig)
    out = []
    for name, info in parsed.items():
        connected = [m for m in info["members"] if ports.get(m) is LinkType.THUNDERBOLT
                     and parsed.get(m, {}).get("up") and parsed[m]["active"]]
        if info["up"] and len(connected) >= 2:
            out.append(f"{name} bridges {len(connected)} connected Thunderbolt ports ({', '.join(connected)}): if "
                       "the Macs' Thunderbolt cables form a loop (a ring of three or more, or two Macs joined twice), "
                       "bridges on it flood it (a chain is fine). Turn the Thunderbolt Bridge off on each Mac of the "
                       "loop: System Settings > Network, "
                       f"or {BRIDGE_OFF} (the service may have another name in the system's language)")
    return out


def warn_bridge_loops() -> None:
    """Log `bridge_loops` on this machine (a Mac; nothing elsewhere, or when the commands fail)."""
    if sys.platform != "darwin":
        return
    try:
        warnings = bridge_loops(_run("networksetup", "-listallhardwareports"), _run("ifconfig"))
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        log.debug("could not check the Thunderbolt bridge: %s", e)
        return
    for warning in warnings:
        log.warning("%s", warning)


# -- Linux ------------------------------------------------------------------------------------

ARPHRD_ETHER, ARPHRD_LOOPBACK = 1, 772


@dataclass(frozen=True)
class SysfsLink:
    """What /sys/class/net/<name> says about an interface."""

    driver: str | None  # basename of device/driver, None for virtual interfaces
    wireless: bool
    type: int  # ARPHRD_*


def read_sysfs(root: Path = Path("/sys/class/net")) -> dict[str, SysfsLink]:
    out = {}
    for entry in sorted(root.iterdir()) if root.exists() else []:
        driver_link = entry / "device" / "driver"
        driver = os.path.basename(os.readlink(driver_link)) if driver_link.is_symlink() else None
        try:
            kind = int((entry / "type").read_text().strip())
        except (OSError, ValueError):
            kind = 0
        wireless = (entry / "wireless").exists() or (entry / "phy80211").exists()
        out[entry.name] = SysfsLink(driver=driver, wireless=wireless, type=kind)
    return out


def classify_linux(name: str, link: SysfsLink | None) -> LinkType:
    if name == "lo" or (link and link.type == ARPHRD_LOOPBACK):
        return LinkType.LOOPBACK
    if (link and link.driver in ("thunderbolt-net", "thunderbolt_net")) or name.startswith("thunderbolt"):
        return LinkType.THUNDERBOLT
    if link is None:
        return LinkType.OTHER
    if link.wireless:
        return LinkType.WIFI
    if link.type == ARPHRD_ETHER and link.driver is not None:
        return LinkType.ETHERNET
    return LinkType.OTHER  # veth, bridges, tunnels


def parse_ip_addr_json(text: str) -> dict[str, dict]:
    """`ip -j addr` -> {name: {"addresses": [cidr...], "up": bool}}."""
    out = {}
    for entry in json.loads(text or "[]"):
        addresses = [
            f"{a['local']}/{a['prefixlen']}"
            for a in entry.get("addr_info", [])
            if a.get("family") in ("inet", "inet6") and "local" in a
        ]
        out[entry["ifname"]] = {"addresses": addresses, "up": "UP" in entry.get("flags", [])}
    return out


def linux_interfaces(ip_json: str, sysfs: dict[str, SysfsLink]) -> list[Interface]:
    result = []
    for name, info in parse_ip_addr_json(ip_json).items():
        if info["up"] and info["addresses"]:
            result.append(Interface(name, classify_linux(name, sysfs.get(name)), tuple(info["addresses"])))
    return result


# -- this machine -----------------------------------------------------------------------------


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=10).stdout


def local_interfaces() -> list[Interface]:
    """This machine's interfaces with addresses, up, each with its link type."""
    try:
        if sys.platform == "darwin":
            return macos_interfaces(_run("networksetup", "-listallhardwareports"), _run("ifconfig"))
        return linux_interfaces(_run("ip", "-j", "addr"), read_sysfs())
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        log.warning("could not list network interfaces: %s", e)
        return []


def interfaces_for(addresses: list[str], interfaces: list[Interface]) -> list[Interface]:
    """The interfaces that hold any of `addresses` (plain IPs)."""
    wanted = {ipaddress.ip_address(strip_scope(a)[0]) for a in addresses}
    return [i for i in interfaces if any(n.ip in wanted for n in i.networks())]
