"""Node identity, memory and chip parsing, and the zeroconf TXT record."""

from __future__ import annotations

import asyncio
import multiprocessing
from pathlib import Path

import pytest
from mtpipe.node.advertise import (
    MAX_TXT_ENTRY,
    Advertiser,
    NodeAdvert,
    cluster_hash,
    decode_txt,
    encode_txt,
    needs_republish,
)
from mtpipe.node.identity import node_id, state_dir
from mtpipe.node.links import Interface, LinkType
from mtpipe.node.sysinfo import parse_cpuinfo, parse_meminfo, parse_vm_stat

DATA = Path(__file__).parent / "data"


def test_node_id_is_persistent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MTPIPE_STATE_DIR", str(tmp_path / "state"))
    assert state_dir() == tmp_path / "state"
    first = node_id()
    assert first == node_id() == (tmp_path / "state" / "node_id").read_text().strip()
    assert node_id(tmp_path / "other") != first  # another state directory is another node


def _id(path: str) -> str:
    return node_id(path)


def test_node_id_race(tmp_path: Path) -> None:
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        ids = pool.map(_id, [str(tmp_path)] * 8)
    assert len(set(ids)) == 1


def test_node_id_rejects_garbage(tmp_path: Path) -> None:
    (tmp_path / "node_id").write_text("not an id!\n")
    with pytest.raises(ValueError, match="not a node id"):
        node_id(tmp_path)


def test_memory_parsers() -> None:
    mem = parse_meminfo((DATA / "linux_meminfo.txt").read_text())
    assert mem.total == 24684092 * 1024 and mem.available == 20864844 * 1024
    mac = parse_vm_stat((DATA / "macos_vm_stat.txt").read_text(), total=64 * 2**30)
    assert mac.available == (412345 + 1876543 + 23456) * 16384
    assert parse_cpuinfo("processor\t: 0\nmodel name\t: AMD EPYC 7B13\n") == "AMD EPYC 7B13"
    assert parse_cpuinfo("Hardware\t: BCM2835\nModel\t: Raspberry Pi 4\n") == "Raspberry Pi 4"
    with pytest.raises(ValueError):
        parse_vm_stat("Pages free: 1.\n", total=1)


def test_txt_round_trip_and_limits() -> None:
    many = tuple(f"fd00:{i:x}::1234:5678:9abc:def0/64" for i in range(20))
    ad = NodeAdvert(
        node_id="a1b2c3d4e5f6",
        cluster_hash=cluster_hash("lab"),
        port=52416,
        mem_total=192 * 2**30,
        mem_available=150 * 2**30,
        chip="Apple M2 Ultra",
        version="0.1.0",
        interfaces=(
            Interface("bridge0", LinkType.THUNDERBOLT, ("169.254.71.12/16", "fe80::34b3:8aff:fe5c:1000/64")),
            Interface("en0", LinkType.ETHERNET, many),
        ),
        coordinator=True,
    )
    txt = encode_txt(ad)
    assert all(len(f"{k}={v}".encode()) <= MAX_TXT_ENTRY for k, v in txt.items())
    assert "secret" not in " ".join(f"{k}={v}" for k, v in txt.items())
    back = decode_txt({k.encode(): v.encode() for k, v in txt.items()}, ("10.0.0.1",))
    assert back.interfaces[0] == ad.interfaces[0]
    assert back.interfaces[1].addresses == many[: len(back.interfaces[1].addresses)]  # what fits in 255 bytes
    assert 3 <= len(back.interfaces[1].addresses) < len(many)
    assert (back.node_id, back.mem_available, back.coordinator, back.addresses) == (ad.node_id, ad.mem_available, True, ("10.0.0.1",))
    assert cluster_hash("lab") != cluster_hash("lab2") and len(cluster_hash("lab")) == 16
    with pytest.raises(ValueError, match="malformed"):
        decode_txt({b"id": b"x"})


class _RecordingZeroconf:
    """Stands in for AsyncZeroconf: records the TXT records the advertiser publishes."""

    def __init__(self) -> None:
        self.published: list[dict] = []

    async def async_update_service(self, info) -> None:
        self.published.append(dict(info.properties))


def test_memory_offered_is_republished_when_it_moves() -> None:
    GiB = 2**30
    assert not needs_republish(8 * GiB, 8 * GiB + (100 << 20))  # noise: neither 5% nor 256 MiB
    assert needs_republish(8 * GiB, 6 * GiB) and needs_republish(2 * GiB, 2 * GiB + (300 << 20))
    azc = _RecordingZeroconf()
    ad = NodeAdvert("node-a", cluster_hash("lab"), 52700, 16 * GiB, 8 * GiB, "Apple M2 Max", "0.1.0")
    advertiser = Advertiser(azc, ad, ["127.0.0.1"])
    readings = [8 * GiB, 8 * GiB + (50 << 20), 5 * GiB, 5 * GiB]
    calls: list[int] = []

    def offered() -> int:
        calls.append(1)
        return readings[min(len(calls), len(readings)) - 1]

    async def run() -> None:
        task = asyncio.get_running_loop().create_task(advertiser.keep_memory_current(offered, 0.001))
        while len(calls) <= len(readings):  # a call past the last reading: every reading was handled
            await asyncio.sleep(0.001)
        task.cancel()

    asyncio.run(asyncio.wait_for(run(), 5))
    assert [decode_txt(p).mem_available for p in azc.published] == [5 * GiB]
    assert advertiser.advert.mem_available == 5 * GiB

