"""The shard cache is listed and pruned least recently used first, and a fetch that lacks disk space
makes room by removing other entries (node/cache_admin.py)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from helpers import TINY_LAYERS

from mtpipe.coordinator.cli.main import main
from mtpipe.models.fingerprint import model_fingerprint, shard_names
from mtpipe.node import cache_admin, fetch
from mtpipe.node.server import NodeServer
from mtpipe.node.shards import ShardCache, ShardKey

SPECS = [(0, 1, False), (1, 3, False), (3, 4, True)]


def fetch_into(cache: ShardCache, ckpt: Path, holder: str, spec: tuple[int, int, bool]) -> Path:
    key = ShardKey(model_fingerprint(ckpt), spec[0], spec[1], TINY_LAYERS, spec[2])
    names = shard_names(ckpt, spec[0], spec[1], TINY_LAYERS, spec[2])
    asyncio.run(fetch.fetch_shard(cache, key, names, [holder], None, fetch.Transfer()))
    d = cache.lookup(key, names)
    assert d is not None
    return d


@pytest.fixture
def filled(dense_ckpt: Path, tmp_path: Path):
    """A cache with three shards of the model, used in the order 1, 0, 2 (0 least recently: oldest stamp)."""
    holder = NodeServer("127.0.0.1", 0, model_dirs=[dense_ckpt], shard_cache=tmp_path / "holder").start()
    try:
        cache = ShardCache(tmp_path / "cache")
        dirs = [fetch_into(cache, dense_ckpt, holder.address, s) for s in SPECS]
        for age, i in enumerate((1, 0, 2)):  # lookup marks use; set the stamps apart explicitly
            key = ShardKey(model_fingerprint(dense_ckpt), SPECS[i][0], SPECS[i][1], TINY_LAYERS, SPECS[i][2])
            assert cache.lookup(key) == dirs[i]
            manifest = dirs[i] / "mtpipe-shard.json"
            os.utime(manifest, (1_000_000 + age, 1_000_000 + age))
        yield cache, dirs, holder
    finally:
        holder.stop(0)


def test_entries_least_recently_used_first_and_prune(filled, capsys: pytest.CaptureFixture) -> None:
    cache, dirs, _ = filled
    listed = cache_admin.entries(cache.root)
    assert [e.path for e in listed] == [dirs[1], dirs[0], dirs[2]] and all(e.complete for e in listed)
    sizes = {e.path: e.bytes for e in listed}
    # Down to what the two most recently used hold: the least recently used goes.
    removed, busy = cache_admin.prune(cache.root, max_bytes=sizes[dirs[0]] + sizes[dirs[2]])
    assert [e.path for e in removed] == [dirs[1]] and busy == [] and not dirs[1].exists() and dirs[0].exists()
    # The CLI lists what is left, and prunes one model's entries.
    assert main(["cache", "list", "--json", "--shard-cache", str(cache.root)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [e["path"] for e in report["holds"]] == [str(dirs[0]), str(dirs[2])]
    assert main(["cache", "list", "--shard-cache", str(cache.root)]) == 0  # the table: layers as they are held
    table = capsys.readouterr().out
    assert "holds 2 entries" in table, table
    from mtpipe.node.cache_cli import _entries, _layers

    assert (_layers("3-4-1"), _layers("0-2-0"), _layers("odd"), _entries(1)) == ("3 + MTP", "0-1", "odd", "1 entry")
    assert main(["cache", "prune", "--shard-cache", str(cache.root)]) == 2  # which entries: not said
    assert main(["cache", "prune", "--model", "", "--shard-cache", str(cache.root)]) == 2  # "" is not a model
    fp = listed[0].fingerprint
    assert main(["cache", "prune", "--json", "--model", fp[:10].upper(), "--shard-cache", str(cache.root)]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert len(json.loads(out)["removed"]) == 2 and cache_admin.entries(cache.root) == []
    assert not (cache.root / fp).exists()


def test_a_fetch_short_of_disk_space_removes_the_least_recently_used(filled, dense_ckpt: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    cache, dirs, holder = filled
    monkeypatch.setattr(fetch, "DISK_MARGIN", 0)
    # A disk with no room at all: the fetch removes entries, least recently used first, until the new
    # shard (the same layers as the first entry removed, another entry for its MTP flag) fits.
    listing = cache_admin.entries
    full = sum(e.bytes for e in listing(cache.root))
    monkeypatch.setattr(fetch, "free_bytes", lambda path: full - sum(e.bytes for e in listing(cache.root)))
    new = (1, 3, True)
    d = fetch_into(cache, dense_ckpt, holder.address, new)
    assert d.exists() and not dirs[1].exists() and dirs[0].exists() and dirs[2].exists()  # no more removed
    # A shard that would not fit even with every other entry gone: none is removed for it.
    held = cache_admin.entries(cache.root)
    assert cache_admin.make_room(cache.root, full + 1, 0, measure=lambda path: 0) == 0
    assert cache_admin.entries(cache.root) == held
    # Nothing left to remove and still no room: the fetch says so, before it starts.
    monkeypatch.setattr(cache_admin, "entries", lambda root: [])
    key = ShardKey(model_fingerprint(dense_ckpt), 0, TINY_LAYERS, TINY_LAYERS, True)
    names = shard_names(dense_ckpt, 0, TINY_LAYERS, TINY_LAYERS, True)
    with pytest.raises(fetch.NoDiskSpace, match="not enough disk space"):
        asyncio.run(fetch.fetch_shard(cache, key, names, [holder.address], None, fetch.Transfer()))


def test_a_root_pointed_elsewhere_lists_and_removes_nothing(tmp_path: Path) -> None:
    """Only directories the cache writes count: a wrong root loses nothing to `prune --all`."""
    (tmp_path / "photos" / "2026").mkdir(parents=True)
    (tmp_path / "photos" / "2026" / "a.jpg").write_bytes(b"x")
    fake = tmp_path / ("a" * 64) / "0-4-1"
    fake.mkdir(parents=True)  # a cache-shaped directory holding no manifest nor part file
    (fake / "notes.txt").write_text("mine")
    assert cache_admin.entries(tmp_path) == []
    assert cache_admin.prune(tmp_path) == ([], []) and (tmp_path / "photos" / "2026" / "a.jpg").exists()
    assert (fake / "notes.txt").exists()


def test_a_source_that_stalls_is_given_up(dense_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A source whose stream stops (a hung disk read: its connection still answers) is given up after
    the idle time, as on the data plane, and the next source is tried."""
    import time

    from mtpipe.node import bulk, weights

    read = weights._read_stream
    monkeypatch.setattr(weights, "_read_stream", lambda *a: (time.sleep(2.0), read(*a))[1])
    monkeypatch.setattr(bulk, "IDLE_TIMEOUT_S", 0.3)
    holder = NodeServer("127.0.0.1", 0, model_dirs=[dense_ckpt], shard_cache=tmp_path / "holder").start()
    try:
        key = ShardKey(model_fingerprint(dense_ckpt), 0, 1, TINY_LAYERS, False)
        names = shard_names(dense_ckpt, 0, 1, TINY_LAYERS, False)
        cache = ShardCache(tmp_path / "cache")
        cache.dir(key).mkdir(parents=True)
        start = time.monotonic()
        with pytest.raises(fetch._SourceFailed, match="sent nothing for 0 s"):
            asyncio.run(fetch._fetch_from(holder.address, cache, key, names, None, fetch.Transfer(), raw=False))
        assert time.monotonic() - start < 1.9
    finally:
        holder.stop(0)


def loaded_by_another_node(cache: ShardCache, entry: Path):
    """The lock another node on this machine holds on an entry from its lookup until its shard is loaded."""
    from mtpipe.node.cache_lock import EntryLock

    lock = EntryLock(cache.root, entry.parent.name, entry.name)
    assert lock.try_exclusive()
    lock.share()
    return lock


def test_entries_a_node_is_loading_are_not_removed(filled, capsys: pytest.CaptureFixture) -> None:
    """Another node on this machine, sharing the cache root, holds an entry's lock from its lookup until
    the shard is loaded: neither `prune` nor a fetch making room removes that entry."""
    cache, dirs, _ = filled
    loading = loaded_by_another_node(cache, dirs[1])
    try:
        # Room for one byte: the oldest entry is in use, so the next one goes.
        assert cache_admin.make_room(cache.root, 1, 0, measure=lambda path: 1) == 1
        assert dirs[1].exists() and not dirs[0].exists() and dirs[2].exists()
        assert main(["cache", "prune", "--all", "--json", "--shard-cache", str(cache.root)]) == 0
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert [e["path"] for e in report["in_use"]] == [str(dirs[1])] and dirs[1].exists()
        assert [e["path"] for e in report["removed"]] == [str(dirs[2])] and not dirs[2].exists()
    finally:
        loading.release()
    removed, busy = cache_admin.prune(cache.root)
    assert [e.path for e in removed] == [dirs[1]] and busy == []


def test_two_nodes_sharing_a_cache_fetch_a_shard_once(dense_ckpt: Path, tmp_path: Path) -> None:
    """Two nodes with one cache root asked for the same shard at once: one fetches it, the other waits
    for its lock and loads what the first completed (never two writers on one part file)."""
    from mtpipe.node.weights import WeightStore
    from mtpipe.proto import mtpipe_pb2 as pb

    holder = NodeServer("127.0.0.1", 0, model_dirs=[dense_ckpt], shard_cache=tmp_path / "holder").start()
    try:
        spec = (1, 3, False)
        names = shard_names(dense_ckpt, spec[0], spec[1], TINY_LAYERS, spec[2])
        request = pb.LoadRequest(fingerprint=model_fingerprint(dense_ckpt), start=spec[0], end=spec[1],
                                 num_layers=TINY_LAYERS, mtp=spec[2], tensors=names, sources=[holder.address])
        stores = [WeightStore(shard_cache=tmp_path / "shared") for _ in range(2)]

        async def both() -> list:
            return list(await asyncio.gather(*(s.resolve(request) for s in stores)))

        found = asyncio.run(both())
        assert sorted(f.source.split()[0] for f in found) == ["cache", "peer"]
        assert found[0].path == found[1].path
        assert sum(s.transfer.fetched_bytes for s in stores) == holder.service.weights.transfer.served_bytes > 0
        # Both hold the entry shared until their shards are loaded; then it may go.
        assert cache_admin.prune(tmp_path / "shared")[0] == []
        for f in found:
            f.release()
        assert len(cache_admin.prune(tmp_path / "shared")[0]) == 1
    finally:
        holder.stop(0)


def test_a_root_without_room_for_lock_files_is_used_unlocked(tmp_path: Path) -> None:
    """A cache root where no lock file can be made (read-only; here a file stands where the lock directory
    would be) still serves its entries, unlocked, rather than failing every Load."""
    from mtpipe.node.cache_lock import LOCKS, EntryLock

    (tmp_path / LOCKS).write_text("not a directory")
    lock = EntryLock(tmp_path, "ab" * 32, "0-4-1")
    assert lock.unlocked and lock.try_shared() and lock.try_exclusive()
    lock.share()
    lock.release()


def test_prune_to_a_size_counts_only_what_it_could_remove(filled) -> None:
    """The least recently used entry is in use: it frees nothing, so the next ones go until the cache
    holds what was asked."""
    cache, dirs, _ = filled
    loading = loaded_by_another_node(cache, dirs[1])
    try:
        sizes = {e.path: e.bytes for e in cache_admin.entries(cache.root)}
        assert sizes[dirs[1]] >= sizes[dirs[0]]  # (so that counting the busy one as freed would stop at it)
        removed, busy = cache_admin.prune(cache.root, max_bytes=sum(sizes.values()) - sizes[dirs[0]])
        assert [e.path for e in busy] == [dirs[1]]
        assert [e.path for e in removed] == [dirs[0]] and dirs[1].exists() and dirs[2].exists()
    finally:
        loading.release()


def test_what_an_entry_holds_beside_its_weights_and_how_it_is_written(filled, dense_ckpt: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A loader reads every .safetensors of a directory: an entry holding another one is not used (it is
    fetched again). A read-only cache is used as it is. An entry whose weights changed since they were
    verified is not served to peers. A manifest that cannot be written leaves a part file (the next
    fetch resumes it), never weights no manifest vouches for."""
    import errno

    from mtpipe.node.shards import PART, SHARD_MANIFEST, WEIGHTS

    cache, dirs, holder = filled
    fp = model_fingerprint(dense_ckpt)
    keys = [ShardKey(fp, s[0], s[1], TINY_LAYERS, s[2]) for s in SPECS]
    (dirs[0] / "zz-extra.safetensors").write_bytes(b"")
    assert cache.lookup(keys[0]) is None and not (dirs[0] / "zz-extra.safetensors").exists()

    def read_only(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    with monkeypatch.context() as m:
        m.setattr(os, "utime", read_only)
        assert cache.lookup(keys[1]) == dirs[1]

    names = shard_names(dense_ckpt, SPECS[2][0], SPECS[2][1], TINY_LAYERS, SPECS[2][2])
    assert cache.holding(fp, names)[0] == dirs[2]
    os.utime(dirs[2] / WEIGHTS, (1, 1))  # (touched, copied, or changed: verified again before any use)
    with pytest.raises(ValueError, match="changed since it was verified"):  # (DATA_LOSS to the asker)
        cache.holding(fp, names)

    cache.discard(keys[2])

    def disk_full(d: Path, manifest: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache, "_write_manifest", disk_full)
    with pytest.raises(OSError):
        fetch_into(cache, dense_ckpt, holder.address, SPECS[2])
    assert (dirs[2] / PART).exists() and not (dirs[2] / WEIGHTS).exists() and not (dirs[2] / SHARD_MANIFEST).exists()
