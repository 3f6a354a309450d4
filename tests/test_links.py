"""Interface discovery and link types, on recorded `networksetup`, `ifconfig`, `ip -j addr` and sysfs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mtpipe.node.links import (
    Interface,
    LinkType,
    SysfsLink,
    classify_port,
    format_host_port,
    linux_interfaces,
    macos_interfaces,
    parse_ifconfig,
    parse_networksetup,
    read_sysfs,
    split_host_port,
)

DATA = Path(__file__).parent / "data"


def test_networksetup_ports() -> None:
    ports = parse_networksetup((DATA / "macos_networksetup.txt").read_text())
    assert ports == {
        "en0": LinkType.ETHERNET,
        "en1": LinkType.WIFI,
        "en2": LinkType.THUNDERBOLT,
        "en3": LinkType.THUNDERBOLT,
        "en4": LinkType.THUNDERBOLT,
        "en7": LinkType.ETHERNET,  # USB 10/100/1000 LAN
        "en9": LinkType.ETHERNET,  # a Thunderbolt-to-Ethernet adapter is Ethernet, not a Thunderbolt link
        "en8": LinkType.OTHER,  # iPhone USB
        "bridge0": LinkType.THUNDERBOLT,
    }


@pytest.mark.parametrize(
    "port, link",
    [("Thunderbolt Bridge", "thunderbolt"), ("Thunderbolt 12", "thunderbolt"), ("Wi-Fi", "wifi"),
     ("AirPort", "wifi"), ("WLAN", "wifi"), ("WiFi", "wifi"), ("Ethernet Adapter (en5)", "ethernet"),
     ("Bluetooth PAN", "other")],
)
def test_classify_port(port: str, link: str) -> None:
    assert classify_port(port) is LinkType(link)


def test_ifconfig_addresses() -> None:
    parsed = parse_ifconfig((DATA / "macos_ifconfig.txt").read_text())
    assert parsed["en0"]["addresses"] == ["fe80::10c2:7a5f:3e2b:91d4/64", "192.168.1.20/24", "fd7a:2b1c:9d4e:1::20/64"]
    assert parsed["bridge0"]["addresses"] == ["fe80::34b3:8aff:fe5c:1000/64", "169.254.71.12/16"]
    assert parsed["lo0"]["loopback"] and parsed["lo0"]["addresses"][0] == "127.0.0.1/8"
    assert not parsed["en7"]["up"] and not parsed["anpi0"]["active"]
    assert "member:" not in json.dumps(parsed)  # bridge member lines are not addresses
    assert parsed["bridge0"]["members"] == ["en2", "en3"]


def test_macos_interfaces() -> None:
    ifaces = macos_interfaces((DATA / "macos_networksetup.txt").read_text(), (DATA / "macos_ifconfig.txt").read_text())
    by_name = {i.name: i for i in ifaces}
    assert set(by_name) == {"lo0", "en0", "en1", "bridge0", "utun0"}  # up, active, with addresses
    assert by_name["bridge0"].link is LinkType.THUNDERBOLT
    assert by_name["en0"].link is LinkType.ETHERNET
    assert by_name["en1"].link is LinkType.WIFI
    assert by_name["lo0"].link is LinkType.LOOPBACK
    assert by_name["utun0"].link is LinkType.OTHER
    # Some Macs leave the bridge out of the hardware ports: its Thunderbolt members tell what it is.
    listed = (DATA / "macos_networksetup.txt").read_text().replace("Hardware Port: Thunderbolt Bridge\nDevice: bridge0",
                                                                  "")
    assert "bridge0" not in listed
    by_name = {i.name: i for i in macos_interfaces(listed, (DATA / "macos_ifconfig.txt").read_text())}
    assert by_name["bridge0"].link is LinkType.THUNDERBOLT


def _fake_sysfs(root: Path) -> None:
    """Rebuild the recorded /sys/class/net state: device/driver symlinks, type files, wireless dirs."""
    for name, info in json.loads((DATA / "linux_sysfs.json").read_text()).items():
        entry = root / name
        entry.mkdir(parents=True)
        (entry / "type").write_text(f"{info['type']}\n")
        if info["driver"]:
            target = root / "_drivers" / info["driver"]
            target.mkdir(parents=True, exist_ok=True)
            (entry / "device").mkdir()
            os.symlink(target, entry / "device" / "driver")
        if info["wireless"]:
            (entry / "wireless").mkdir()


def test_sysfs_and_ip_json(tmp_path: Path) -> None:
    root = tmp_path / "net"
    _fake_sysfs(root)
    sysfs = read_sysfs(root)
    assert sysfs["thunderbolt0"] == SysfsLink(driver="thunderbolt-net", wireless=False, type=1)
    assert sysfs["docker0"].driver is None
    ifaces = {i.name: i for i in linux_interfaces((DATA / "linux_ip_addr.json").read_text(), sysfs)}
    assert {n: i.link.value for n, i in ifaces.items()} == {
        "lo": "loopback",
        "enp3s0": "ethernet",
        "wlp2s0": "wifi",
        "thunderbolt0": "thunderbolt",
        "docker0": "other",  # a bridge: virtual
        "veth3f2a1b0": "other",
    }  # enp4s0 is down and has no address
    assert ifaces["thunderbolt0"].addresses == ("169.254.18.40/16", "fe80::5f:d2ff:fe11:2201/64")


def test_thunderbolt_by_name_without_sysfs() -> None:
    text = json.dumps([{"ifname": "thunderbolt1", "flags": ["UP"], "addr_info": [
        {"family": "inet", "local": "10.9.0.1", "prefixlen": 30}]}])
    assert linux_interfaces(text, {}) == [Interface("thunderbolt1", LinkType.THUNDERBOLT, ("10.9.0.1/30",))]


def test_addresses_for_grpc() -> None:
    assert format_host_port("10.0.0.2", 52416) == "10.0.0.2:52416"
    assert format_host_port("fd00::2", 1) == "[fd00::2]:1"
    assert format_host_port("fe80::1%bridge0", 1) == "[fe80::1%bridge0]:1"
    assert format_host_port("fe80::1", 1, scope="en2") == "[fe80::1%en2]:1"
    assert format_host_port("fd00::2", 1, scope="en2") == "[fd00::2]:1"  # scopes only for link-local
    assert format_host_port("studio.local", 7) == "studio.local:7"
    assert split_host_port("[fe80::1%en0]:5") == ("fe80::1%en0", 5)
    assert split_host_port("10.0.0.2", 9) == ("10.0.0.2", 9)
    assert split_host_port("fd00::2", 9) == ("fd00::2", 9)
    assert split_host_port("studio.local:80") == ("studio.local", 80)
    with pytest.raises(ValueError, match="no port"):
        split_host_port("10.0.0.2")
    with pytest.raises(ValueError, match="not a TCP port"):
        split_host_port("h:99999")


def test_a_bridge_of_two_connected_thunderbolt_ports_is_warned_about(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """macOS bridges its Thunderbolt ports: two connected ones (a ring of three Macs, or two cables)
    may close a loop that floods the links, as exo warns; the warning names the command that turns the
    bridge off. One connected port (the recording: en3 has no cable) is no loop."""
    import logging
    import re

    from mtpipe.node import links

    networksetup = (DATA / "macos_networksetup.txt").read_text()
    ifconfig = (DATA / "macos_ifconfig.txt").read_text()
    assert links.bridge_loops(networksetup, ifconfig) == []
    # en3 cabled too: its status block says active
    both = re.sub(r"(en3: flags[^\n]*\n(?:\t[^\n]*\n)*?\tstatus: )inactive", r"\1active", ifconfig)
    assert both != ifconfig
    warnings = links.bridge_loops(networksetup, both)
    assert len(warnings) == 1 and warnings[0].startswith("bridge0 bridges 2 connected Thunderbolt ports (en2, en3)")
    assert links.BRIDGE_OFF in warnings[0]
    down = both.replace("bridge0: flags=8863<UP,", "bridge0: flags=8862<")
    assert links.bridge_loops(networksetup, down) == []  # (a bridge that is down forwards nothing)
    # Only a Mac asks: elsewhere neither command runs.
    monkeypatch.setattr(links, "_run", lambda *cmd: networksetup if cmd[0] == "networksetup" else both)
    with caplog.at_level(logging.WARNING, logger="mtpipe.node.links"):
        links.warn_bridge_loops()
        assert caplog.records == []
        monkeypatch.setattr(links.sys, "platform", "darwin")
        links.warn_bridge_loops()
    assert [r.getMessage() for r in caplog.records] == warnings
