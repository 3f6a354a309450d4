"""Node identity, memory and chip parsing, and the zeroconf TXT record."""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import psutil
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
from mtpipe.node.sysinfo import (
    WORKING_SET_KEY,
    gpu_limit,
    memory,
    parse_cpuinfo,
    placement_memory,
    working_set_limit,
)

GiB = 2**30


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


def test_cpuinfo_parser() -> None:
    assert parse_cpuinfo("processor\t: 0\nmodel name\t: AMD EPYC 7B13\n") == "AMD EPYC 7B13"
    assert parse_cpuinfo("Hardware\t: BCM2835\nModel\t: Raspberry Pi 4\n") == "Raspberry Pi 4"
    assert parse_cpuinfo("processor\t: 0\n") is None


def test_memory_agrees_with_psutil() -> None:
    before = psutil.virtual_memory()
    mem = memory()
    after = psutil.virtual_memory()
    assert mem.total == before.total == after.total
    slack = 64 << 20  # memory moves between the readings on a shared machine
    low, high = sorted((before.available, after.available))
    assert low - slack <= mem.available <= high + slack
    assert 0 < mem.available <= mem.total


def test_placement_memory_is_capped_by_the_gpu_limit() -> None:
    assert placement_memory(100 * GiB, 75 * GiB) == 75 * GiB  # limit below available: the limit
    assert placement_memory(20 * GiB, 75 * GiB) == 20 * GiB  # limit above available: what is available
    assert placement_memory(20 * GiB, None) == 20 * GiB  # no Metal: no cap
    assert working_set_limit({WORKING_SET_KEY: 48 * GiB, "device_name": "Apple M2 Max"}) == 48 * GiB
    assert working_set_limit({"architecture": "x86_64", "device_name": "AMD EPYC"}) is None
    assert working_set_limit({WORKING_SET_KEY: 0}) is None


def test_room_left_with_metal_counts_the_weights_against_the_gpu_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Mac with a 96 GiB working-set limit and 94 GiB of weights loaded: RAM still shows 16 GiB free,
    but the GPU keeps only 2 GiB more resident within its limit, so that is the room for KV and prefixes."""
    from mtpipe.node import sysinfo

    gib = 2**30
    monkeypatch.setattr(sysinfo, "memory", lambda: sysinfo.MemoryInfo(128 * gib, 16 * gib, gpu_limit=96 * gib))
    monkeypatch.setattr(sysinfo, "mlx_active_memory", lambda: 94 * gib)
    assert sysinfo.system_memory() == (112 * gib, 2 * gib)
    assert sysinfo.system_memory(active=90 * gib) == (112 * gib, 6 * gib)  # (asked on the MLX thread, given)
    monkeypatch.setattr(sysinfo, "mlx_active_memory", lambda: 100 * gib)  # (past the limit: no room, not less)
    assert sysinfo.system_memory()[1] == 0
    monkeypatch.setattr(sysinfo, "memory", lambda: sysinfo.MemoryInfo(128 * gib, 16 * gib))
    assert sysinfo.system_memory() == (112 * gib, 16 * gib)  # without Metal: RAM alone


def test_a_mlx_thread_wires_the_working_set_as_mlx_lm_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """On Metal, weights not wired may be paged out between requests: each process's MLX thread sets
    the wired limit to the recommended working set, as mlx-lm's server does (a no-op without such a
    size, as on this machine)."""
    import threading

    from mtpipe.models.mlx_thread import MLXThread, wire_working_set
    from mtpipe.node.server import NodeServer

    called: list[tuple[str, int]] = []
    monkeypatch.setattr(mx, "set_wired_limit", lambda size: called.append((threading.current_thread().name, size)))
    monkeypatch.setattr(mx, "device_info", lambda: {"architecture": "x86_64"})  # (as a CPU reports itself)
    wire_working_set.cache_clear()
    thread = MLXThread(name="cpu")
    thread.call(lambda: None)
    thread.close()
    assert called == []  # no recommended size: nothing set
    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": 3 << 30})
    wire_working_set.cache_clear()
    thread = MLXThread(name="wired-test")
    thread.call(lambda: None)
    thread.close()
    MLXThread(name="another").close()  # (once per process)
    assert called == [("wired-test", 3 << 30)]
    wire_working_set.cache_clear()
    server = NodeServer("127.0.0.1", 0).start()
    server.stop(0)
    assert len(called) == 2  # a node's loop thread, in a process of its own


def test_memory_on_this_machine() -> None:
    mem = memory()
    if sys.platform == "darwin" and mx.metal.is_available():
        assert mem.gpu_limit is not None and 0 < mem.gpu_limit <= mem.total
    else:
        assert mem.gpu_limit is None
        assert placement_memory(mem.available, mem.gpu_limit) == mem.available


@pytest.fixture
def fresh_gpu_limit() -> Iterator[None]:
    gpu_limit.cache_clear()
    yield
    gpu_limit.cache_clear()


def test_gpu_limit_read_from_mlx(fresh_gpu_limit: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Apple-silicon path on any machine: MLX is made to report a Metal device."""
    from mtpipe.node.sysinfo import system_memory

    asked: list[object] = []

    def device_info(d: object = None) -> dict:
        asked.append(d)
        return {WORKING_SET_KEY: 1 * GiB, "device_name": "Apple M2 Max"}

    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "device_info", device_info)
    mem = memory()
    assert mem.gpu_limit == 1 * GiB and asked == [mx.gpu]
    monkeypatch.setattr("mtpipe.node.sysinfo.mlx_active_memory", lambda: 0)  # (nothing on the GPU yet)
    used, available = system_memory()
    assert available == min(psutil.virtual_memory().available, 1 * GiB) and used > 0
    memory()
    assert len(asked) == 1  # asked once: the limit is fixed for the process

    gpu_limit.cache_clear()  # an older MLX: device info only under mx.metal
    monkeypatch.delattr(mx, "device_info")
    monkeypatch.setattr(mx.metal, "device_info", lambda: {WORKING_SET_KEY: 3 * GiB})
    assert memory().gpu_limit == 3 * GiB

    gpu_limit.cache_clear()  # a Metal device without the key: no cap, no error
    monkeypatch.setattr(mx.metal, "device_info", lambda: {})
    assert memory().gpu_limit is None


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
    assert back.has_model and not decode_txt(encode_txt(replace(ad, has_model=False))).has_model
    with pytest.raises(ValueError, match="malformed"):
        decode_txt({b"id": b"node-x"})
    for bad in ("", "x", "Node-A", "../a", "a" * 64, "node a"):  # not a node id: never a member, never "me"
        with pytest.raises(ValueError, match="not a node id"):
            decode_txt({k.encode(): v.encode() for k, v in {**txt, "id": bad}.items()})


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



def test_an_id_another_node_advertises_is_a_clear_error() -> None:
    from zeroconf import NonUniqueNameException

    class Taken(_RecordingZeroconf):
        async def async_register_service(self, info) -> None:
            raise NonUniqueNameException

    ad = NodeAdvert("node-a", cluster_hash("lab"), 52700, 2**34, 2**33, "Apple M2 Max", "0.1.0")
    with pytest.raises(ValueError, match="another node on this network advertises the id 'node-a'.*node_id file"):
        asyncio.run(Advertiser(Taken(), ad, ["127.0.0.1"]).start())


def test_health_answers_the_last_memory_reading_and_takes_a_new_one_beside_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading memory blocks, so it runs on the executor: after the first, Health answers the last
    reading at once (one turn of a loop busy with steps), and a stale one is renewed in the background."""
    import asyncio

    from mtpipe.node import health

    reads = iter(range(100))
    monkeypatch.setattr(health, "system_memory", lambda active: (next(reads), 7))
    readings = health.MemoryReadings(lambda: 5)

    async def run() -> list[tuple[int, int, int]]:
        got = [await readings.get(0), await readings.get(0)]  # (the first waits for its reading)
        readings._last = (readings._last[0] - health.MEMORY_FRESH_S - 1, readings._last[1])  # (gone stale)
        got.append(await readings.get(0))  # (answered as it is, renewed beside)
        await readings._task
        got.append(await readings.get(0))
        return got

    assert asyncio.run(run()) == [(0, 7, 5), (0, 7, 5), (0, 7, 5), (1, 7, 5)]


def test_one_machine_is_named_alike_by_every_process_on_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes on one machine share its memory: Health names the machine by its boot (Linux's boot id, macOS's
    boot session), the same in every process (a child process here), and `sharing` counts them."""
    import mtpipe.node.sysinfo as sysinfo

    here = sysinfo.machine_id()
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(sysinfo.machine_id) == here
    asked: list[tuple[str, ...]] = []
    monkeypatch.setattr(sysinfo, "_run", lambda *cmd: asked.append(cmd) or "5E1D-SESSION\n")
    mac = sysinfo.machine_of("darwin")
    assert asked == [("/usr/sbin/sysctl", "-n", "kern.bootsessionuuid")] and mac not in ("", here) and len(mac) == 16
    monkeypatch.setattr(sysinfo, "_run", lambda *cmd: "")  # (none: the host and the second it booted)
    assert sysinfo.machine_of("darwin") not in (mac, here)
    assert sysinfo.sharing(["a", "b", "a", "", ""]) == [2, 1, 2, 1, 1]
