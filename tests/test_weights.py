"""Weights reach every node (issue 14), over loopback: nodes without the model fetch exactly their
shard's tensors from a node that holds it, verified by hash, into a shard cache of their own.

The in-process nodes share one file system, so each one ignores the path the coordinator sends
(`path_hint = False`) and has its own shard cache in a temporary directory: a node sees the model
only where it was given it (`model_dirs`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import mlx.core as mx
import pytest
from helpers import PROMPTS, TINY_LAYERS
from mlx.utils import tree_flatten

from mtpipe.coordinator.engine.build import local_engine, remote_engine
from mtpipe.coordinator.engine.engine import Engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.models import fingerprint as fpmod
from mtpipe.models.fingerprint import checkpoint_index, model_fingerprint, shard_names
from mtpipe.models.loading import load_shard
from mtpipe.models.shard import ShardSpec
from mtpipe.node import bulk, fetch, shards, weights
from mtpipe.node.server import NodeServer
from mtpipe.node.shards import PART, WEIGHTS, ShardCache, ShardKey
from mtpipe.node.wire import make_channel
from mtpipe.proto import mtpipe_pb2 as pb
from mtpipe.proto import mtpipe_pb2_grpc as pb_grpc

# The last shard is one full-attention layer and the MTP head: no conv1d tells its layout.
SPECS = [(0, 1), (1, 3), (3, 4)]
HALVES = [(0, 2), (2, 4)]
MAX_TOKENS = 16


@contextmanager
def nodes(root: Path, model_dirs: list[list[Path]], secret: str | None = None) -> Iterator[list[NodeServer]]:
    """One node per entry of `model_dirs` (its local copies), each with its own shard cache under `root`."""
    started: list[NodeServer] = []
    try:
        for i, dirs in enumerate(model_dirs):
            s = NodeServer("127.0.0.1", 0, model_dirs=dirs, shard_cache=root / f"cache{i}", secret=secret).start()
            s.service.weights.path_hint = False
            started.append(s)
        yield started
    finally:
        for s in started:
            s.stop(0)


@contextmanager
def engine_over(ckpt: Path, servers: list[NodeServer], specs=SPECS, **kw) -> Iterator[Engine]:
    specs = [ShardSpec(a, b, TINY_LAYERS) for a, b in specs]
    engine = remote_engine(ckpt, [s.address for s in servers], dtype="float32", specs=specs,
                           sources=[servers[0].address], **kw)
    try:
        yield engine
    finally:
        engine.pipeline.close()


def generate(engine: Engine, text: str) -> list[int]:
    prompt = engine.tokenizer.encode(text)
    return engine.complete(GenerationRequest(prompt, max_tokens=MAX_TOKENS, mtp_depth=2)).tokens


@pytest.fixture(scope="module")
def reference(dense_ckpt: Path) -> dict[str, list[int]]:
    single = local_engine(dense_ckpt, dtype=mx.float32)
    return {text: generate(single, text) for text in PROMPTS[:2]}


def shard_bytes(ckpt: Path, spec: tuple[int, int], mtp: bool = True) -> int:
    index = checkpoint_index(ckpt)
    return sum(index[n].size for n in shard_names(ckpt, spec[0], spec[1], TINY_LAYERS, mtp))


def same_weights(a: Path, b: Path, spec: ShardSpec, mtp: bool = True) -> bool:
    x = dict(tree_flatten(load_shard(a, spec, mtp=mtp, dtype=mx.float32).model.parameters()))
    y = dict(tree_flatten(load_shard(b, spec, mtp=mtp, dtype=mx.float32).model.parameters()))
    return x.keys() == y.keys() and all(mx.array_equal(x[k], y[k]).item() for k in x)


def perturbed_copy(src: Path, dst: Path, tensor: str) -> Path:
    """The same model, names and shapes, with one tensor changed a little."""
    shutil.copytree(src, dst)
    w = dict(mx.load(str(src / "model.safetensors")))
    w[tensor] = w[tensor] + 1e-3
    mx.save_safetensors(str(dst / "model.safetensors"), w, metadata={"format": "pt"})
    return dst


# -- the fingerprint --------------------------------------------------------------------------------


def test_fingerprint_names_the_content(dense_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fp = model_fingerprint(dense_ckpt)
    assert len(fp) == 64 and fp == model_fingerprint(dense_ckpt)
    # Per-tensor hashes (from the one pass over each file) are the hashes of the bytes at each offset.
    index = checkpoint_index(dense_ckpt)
    names = shard_names(dense_ckpt, *HALVES[1], TINY_LAYERS, True)
    for name, digest in fpmod.tensor_hashes(dense_ckpt, names).items():
        loc = index[name]
        assert digest == fpmod.hash_range(loc.file, loc.start, loc.size)
    # A copy is the same model; one weight changed (same names and shapes) or another tokenizer is not.
    copy = tmp_path / "copy"
    shutil.copytree(dense_ckpt, copy)
    assert model_fingerprint(copy) == fp
    other = perturbed_copy(dense_ckpt, tmp_path / "other", "model.language_model.layers.3.mlp.down_proj.weight")
    assert model_fingerprint(other) != fp
    tok = json.loads((copy / "tokenizer.json").read_text())
    tok["added_tokens"][0]["content"] += "x"
    (copy / "tokenizer.json").write_text(json.dumps(tok))
    assert model_fingerprint(copy) != fp
    # Hashes come from the sidecar (keyed by size and mtime) once computed: no file is read again...
    fresh = tmp_path / "fresh"
    shutil.copytree(dense_ckpt, fresh)
    (fresh / fpmod.SIDECAR).unlink(missing_ok=True)
    assert model_fingerprint(fresh) == fp and (fresh / fpmod.SIDECAR).exists()
    monkeypatch.setattr(fpmod, "_memo", {})

    def no_hashing(file: Path):
        raise AssertionError(f"{file} hashed again")

    monkeypatch.setattr(fpmod, "_hash_file", no_hashing)
    assert model_fingerprint(fresh) == fp
    # ...until a file changes.
    (fresh / "model.safetensors").touch()
    with pytest.raises(AssertionError, match="hashed again"):
        model_fingerprint(fresh)


@pytest.mark.parametrize("moe", [False, True])
def test_a_shard_cache_directory_loads_as_the_same_shard(moe: bool, dense_ckpt: Path, moe_ckpt: Path,
                                                         tmp_path: Path) -> None:
    """Exactly shard_names' tensors, bytes as stored, plus the manifest: load_shard gives the same weights."""
    import asyncio

    ckpt = moe_ckpt if moe else dense_ckpt
    with nodes(tmp_path, [[ckpt]]) as (holder,):
        for start, end, mtp in [(0, 1, True), (1, 3, True), (3, 4, True), (2, 4, False)]:
            key = ShardKey(model_fingerprint(ckpt), start, end, TINY_LAYERS, mtp)
            cache = ShardCache(tmp_path / "mine")
            names = shard_names(ckpt, start, end, TINY_LAYERS, mtp)
            got, source = asyncio.run(fetch.fetch_shard(cache, key, names, [holder.address], None, fetch.Transfer()))
            assert got == sum(checkpoint_index(ckpt)[n].size for n in names) and source == holder.address
            d = cache.lookup(key, names)
            assert d is not None and sorted(checkpoint_index(d)) == names
            assert same_weights(d, ckpt, ShardSpec(start, end, TINY_LAYERS), mtp), (start, end, mtp)


def test_a_transfer_that_fails_leaves_no_entry_behind(dense_ckpt: Path, tmp_path: Path) -> None:
    """No source serves the shard: the entry the transfer began (its directory, the model's) is gone,
    unless a part file holds what a next transfer would resume from, which `mtpipe cache` lists."""
    import asyncio
    import socket

    from mtpipe.node.cache_admin import entries
    from mtpipe.node.shards import PART

    with socket.socket() as s:  # (a port nothing listens on)
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"
    key = ShardKey(model_fingerprint(dense_ckpt), 0, 2, TINY_LAYERS, False)
    names = shard_names(dense_ckpt, 0, 2, TINY_LAYERS, False)
    cache = ShardCache(tmp_path / "mine")
    with pytest.raises(FileNotFoundError, match="could not fetch"):
        asyncio.run(fetch.fetch_shard(cache, key, names, [nobody], None, fetch.Transfer()))
    assert not cache.dir(key).parent.exists() and entries(cache.root) == []
    cache.dir(key).mkdir(parents=True)
    (cache.dir(key) / PART).write_bytes(b"begun")  # (as a transfer cut off leaves it)
    fetch._leave_nothing(cache, key)
    assert [(e.path, e.complete) for e in entries(cache.root)] == [(cache.dir(key), False)]


# -- shards reach the nodes -------------------------------------------------------------------------


def test_shards_reach_nodes_without_the_model(dense_ckpt: Path, tmp_path: Path, reference) -> None:
    totals = [shard_bytes(dense_ckpt, s) for s in SPECS]
    with nodes(tmp_path, [[dense_ckpt], [], []]) as servers:
        with engine_over(dense_ckpt, servers) as engine:
            replies = engine.pipeline.load_replies
            assert [r.weights_source for r in replies] == ["local"] + [f"peer {servers[0].address}"] * 2
            assert [r.fetched_bytes for r in replies] == [0, totals[1], totals[2]]
            for text, tokens in reference.items():
                assert generate(engine, text) == tokens
            health = engine.pipeline.health()
            fp = model_fingerprint(dense_ckpt)
            assert all(h.fingerprint == fp for h in health)
            assert [(h.transfer_state, h.transfer_done, h.transfer_total) for h in health[1:]] == [
                ("done", totals[1], totals[1]), ("done", totals[2], totals[2])]
            assert health[0].served_bytes == totals[1] + totals[2]
            # The last shard came with the model's tokenizer files: its node holds output to grammars.
            assert [r.constrains for r in replies] == [False, False, True] and engine.constrains
        # Exactly the shard's tensors arrived, and load as the same shard; the last one's tokenizer beside it.
        for i in (1, 2):
            d = Path(replies[i].weights_path)
            assert d.is_relative_to(tmp_path / f"cache{i}")
            assert sorted(checkpoint_index(d)) == shard_names(dense_ckpt, *SPECS[i], TINY_LAYERS, True)
            assert same_weights(d, dense_ckpt, ShardSpec(*SPECS[i], TINY_LAYERS))
            assert (d / "tokenizer.json").is_file() == (i == 2)
        assert (Path(replies[2].weights_path) / "tokenizer.json").read_bytes() == \
            (dense_ckpt / "tokenizer.json").read_bytes()
        # A node serves what its cache holds too: the bytes of the original's tensors.
        names = shard_names(dense_ckpt, *SPECS[2], TINY_LAYERS, True)
        with make_channel(servers[2].address) as channel:
            chunks = list(pb_grpc.NodeStub(channel).FetchTensors(pb.FetchRequest(fingerprint=fp, names=names)))
        index = checkpoint_index(dense_ckpt)
        expected = b"".join(_read(index[n]) for n in names)
        assert b"".join(c.data for c in chunks[1:]) == expected

    # Started again on the same caches (a second launch): nothing crosses the network.
    with nodes(tmp_path, [[dense_ckpt], [], []]) as servers, engine_over(dense_ckpt, servers) as engine:
        replies = engine.pipeline.load_replies
        assert [r.weights_source for r in replies] == ["local", "cache", "cache"]
        assert [r.fetched_bytes for r in replies] == [0, 0, 0]
        assert replies[2].constrains
        assert [h.fetched_bytes for h in engine.pipeline.health()] == [0, 0, 0]
        assert engine.pipeline.health()[0].served_bytes == 0
        text = PROMPTS[0]
        assert generate(engine, text) == reference[text]
        # Loaded: the nodes hold their entries' locks no longer (cache_lock.py), so a prune may remove them.
        from mtpipe.node import cache_admin

        assert [len(cache_admin.prune(tmp_path / f"cache{i}")[0]) for i in (1, 2)] == [1, 1]


def test_a_local_copy_with_other_weights_is_refused(dense_ckpt: Path, tmp_path: Path, reference) -> None:
    other = perturbed_copy(dense_ckpt, tmp_path / "other", "model.language_model.layers.3.mlp.down_proj.weight")
    with nodes(tmp_path, [[dense_ckpt], [other]]) as servers, engine_over(dense_ckpt, servers, specs=HALVES) as engine:
        last = engine.pipeline.load_replies[1]
        assert last.weights_source == f"peer {servers[0].address}"
        assert last.fetched_bytes == shard_bytes(dense_ckpt, HALVES[1])
        text = PROMPTS[0]
        assert generate(engine, text) == reference[text]
    # The same copy with the right weights is taken as it is.
    good = tmp_path / "good"
    shutil.copytree(dense_ckpt, good)
    with nodes(tmp_path, [[dense_ckpt], [good]]) as servers, engine_over(dense_ckpt, servers, specs=HALVES) as engine:
        last = engine.pipeline.load_replies[1]
        assert (last.weights_source, last.weights_path, last.fetched_bytes) == ("local", str(good), 0)


def test_a_corrupted_cache_entry_is_fetched_again(dense_ckpt: Path, tmp_path: Path, reference) -> None:
    specs = HALVES
    with nodes(tmp_path, [[dense_ckpt], []]) as servers, engine_over(dense_ckpt, servers, specs=specs) as engine:
        cached = Path(engine.pipeline.load_replies[1].weights_path) / WEIGHTS
    data = bytearray(cached.read_bytes())
    data[-100] ^= 0xFF  # one byte of a tensor
    cached.write_bytes(bytes(data))
    with nodes(tmp_path, [[dense_ckpt], []]) as servers, engine_over(dense_ckpt, servers, specs=specs) as engine:
        last = engine.pipeline.load_replies[1]
        assert last.weights_source.startswith("peer ")
        assert last.fetched_bytes == shard_bytes(dense_ckpt, HALVES[1])
        assert servers[1].service.weights.transfer.transport == "tcp"
        text = PROMPTS[1]
        assert generate(engine, text) == reference[text]


def test_an_interrupted_transfer_resumes(dense_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         reference) -> None:
    monkeypatch.setattr(weights, "CHUNK_BYTES", 64 << 10)
    monkeypatch.setattr(bulk, "RECV_BYTES", 64 << 10)
    total = shard_bytes(dense_ckpt, HALVES[1])
    stop_after = total // 3
    with nodes(tmp_path, [[dense_ckpt], []]) as servers:
        receiver = servers[1].service.weights
        receiver.transfer.interrupt_after = stop_after  # as if the node were killed there
        with pytest.raises(ValueError, match="transfer stopped"), engine_over(dense_ckpt, servers, specs=HALVES):
            pass
        key = ShardKey(model_fingerprint(dense_ckpt), *HALVES[1], TINY_LAYERS, True)
        part = receiver.cache.dir(key) / PART
        _, data_start = fpmod.read_header(part)
        kept = part.stat().st_size - data_start
        assert stop_after <= kept < total
        health = servers[1].service.weights.health()
        assert (health.transfer_state, health.transfer_done, health.transfer_total) == ("failed", kept, total)
        assert receiver.transfer.transport == "tcp"
        receiver.transfer.interrupt_after = None
        with engine_over(dense_ckpt, servers, specs=HALVES) as engine:
            last = engine.pipeline.load_replies[1]
            assert last.weights_source.startswith("peer ")
            assert last.fetched_bytes == total - kept < total  # only what was missing
            assert receiver.transfer.transport == "tcp"
            assert not part.exists()
            text = PROMPTS[0]
            assert generate(engine, text) == reference[text]


class CountingVerifier(shards.StreamVerifier):
    """The verifier, counting what each transfer fed it."""

    made: list["CountingVerifier"] = []

    def __init__(self, tensors: list) -> None:
        super().__init__(tensors)
        self.fed = 0
        CountingVerifier.made.append(self)

    def feed(self, data, done=None) -> None:
        self.fed += len(data)
        super().feed(data, done)


def flip_a_byte_in_place(ckpt: Path, name: str) -> None:
    """One byte of tensor `name` changed, the file's size and time kept (its stored hashes still believed)."""
    import os

    loc = checkpoint_index(ckpt)[name]
    st = loc.file.stat()
    with open(loc.file, "r+b") as f:
        f.seek(loc.start)
        byte = f.read(1)
        f.seek(loc.start)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(loc.file, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_a_source_whose_bytes_fail_their_hash_is_left_at_that_tensor(transport: str, dense_ckpt: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch, reference) -> None:
    """A source that believes its changed file (same size and time): the transfer from it stops at the
    first tensor that fails its hash, not after the whole shard, and the next source serves."""
    monkeypatch.setattr(weights, "CHUNK_BYTES", 16 << 10)
    monkeypatch.setattr(bulk, "RECV_BYTES", 16 << 10)
    monkeypatch.setattr(CountingVerifier, "made", [])
    monkeypatch.setattr(fetch, "StreamVerifier", CountingVerifier)
    if transport == "grpc":
        monkeypatch.setattr(bulk, "connect", lambda *a: (_ for _ in ()).throw(ConnectionRefusedError("test")))
    model_fingerprint(dense_ckpt)  # (its stored hashes, copied along)
    changed = tmp_path / "changed"
    shutil.copytree(dense_ckpt, changed)
    first = shard_names(dense_ckpt, *HALVES[1], TINY_LAYERS, True)[0]
    flip_a_byte_in_place(changed, first)
    total = shard_bytes(dense_ckpt, HALVES[1])
    with nodes(tmp_path, [[dense_ckpt], [changed], []]) as (holder, bad, fetcher):
        specs = [ShardSpec(a, b, TINY_LAYERS) for a, b in HALVES]
        engine = remote_engine(dense_ckpt, [holder.address, fetcher.address], dtype="float32", specs=specs,
                               sources=[bad.address, holder.address])
        try:
            assert engine.pipeline.load_replies[1].weights_source == f"peer {holder.address}"
            assert fetcher.service.weights.transfer.transport == transport
            from_bad, from_holder = [v for v in CountingVerifier.made if v.fed]  # (not those of the tries over TCP)
            assert from_bad.problem == f"{first}: content hash differs"
            assert from_bad.fed < total / 2, (from_bad.fed, total)  # (8 pieces of 16 KiB at most past it)
            assert from_holder.fed == total and from_holder.problem is None
            assert generate(engine, PROMPTS[0]) == reference[PROMPTS[0]]
        finally:
            engine.pipeline.close()


@pytest.mark.parametrize("where", ["first tensor", "last byte"])  # (the last: of a tensor the source completes)
def test_a_part_file_that_fails_its_hashes_is_fetched_again_from_its_start(
        where: str, dense_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, reference) -> None:
    """A part file changed on the disk is not resumed, nor its source blamed: the same source sends it whole."""
    monkeypatch.setattr(bulk, "RECV_BYTES", 64 << 10)
    total = shard_bytes(dense_ckpt, HALVES[1])
    with nodes(tmp_path, [[dense_ckpt], []]) as servers:
        receiver = servers[1].service.weights
        receiver.transfer.interrupt_after = total // 2
        with pytest.raises(ValueError, match="transfer stopped"), engine_over(dense_ckpt, servers, specs=HALVES):
            pass
        receiver.transfer.interrupt_after = None
        key = ShardKey(model_fingerprint(dense_ckpt), *HALVES[1], TINY_LAYERS, True)
        part = receiver.cache.dir(key) / PART
        _, data_start = fpmod.read_header(part)
        data = bytearray(part.read_bytes())
        data[data_start + 10 if where == "first tensor" else -1] ^= 0x01
        part.write_bytes(bytes(data))
        caplog.clear()
        with engine_over(dense_ckpt, servers, specs=HALVES) as engine:
            last = engine.pipeline.load_replies[1]
            assert last.weights_source == f"peer {servers[0].address}"
            assert last.fetched_bytes == total
            assert not [r for r in caplog.records if r.name == fetch.__name__ and r.levelname == "WARNING"]
            assert generate(engine, PROMPTS[0]) == reference[PROMPTS[0]]


def test_tensor_bytes_travel_on_the_data_plane(dense_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               reference) -> None:
    total = shard_bytes(dense_ckpt, HALVES[1])
    with nodes(tmp_path, [[dense_ckpt], []]) as servers, engine_over(dense_ckpt, servers, specs=HALVES) as engine:
        assert engine.pipeline.load_replies[1].fetched_bytes == total
        assert servers[1].service.weights.transfer.transport == "tcp"
        assert servers[0].service.weights.transfer.served_bytes == total
        assert not servers[0].service.weights.grants._grants  # the token was used up
        text = PROMPTS[0]
        assert generate(engine, text) == reference[text]

    # A data plane that cannot be reached: the same transfer arrives as FetchTensors chunks.
    def unreachable(*args: object) -> None:
        raise ConnectionRefusedError("test: no route")

    monkeypatch.setattr(bulk, "connect", unreachable)
    with nodes(tmp_path / "again", [[dense_ckpt], []]) as servers, \
            engine_over(dense_ckpt, servers, specs=HALVES) as engine:
        assert engine.pipeline.load_replies[1].fetched_bytes == total
        assert servers[1].service.weights.transfer.transport == "grpc"
        text = PROMPTS[0]
        assert generate(engine, text) == reference[text]


def the_next_source_serves(ckpt: Path, holder: NodeServer, fetcher: NodeServer, refused: NodeServer,
                           reference: dict[str, list[int]]) -> None:
    """`fetcher`'s half of the model, with `refused` asked first and `holder` next: `refused` sends no
    byte of it, and the pipeline decodes as one node does."""
    specs = [ShardSpec(a, b, TINY_LAYERS) for a, b in HALVES]
    engine = remote_engine(ckpt, [holder.address, fetcher.address], dtype="float32", specs=specs,
                           sources=[refused.address, holder.address])
    try:
        assert engine.pipeline.load_replies[1].weights_source == f"peer {holder.address}"
        assert refused.service.weights.transfer.served_bytes == 0  # refused before the bytes
        assert generate(engine, PROMPTS[0]) == reference[PROMPTS[0]]
    finally:
        engine.pipeline.close()


def test_a_source_serving_another_copy_is_not_taken(dense_ckpt: Path, tmp_path: Path, reference) -> None:
    """A source whose cached shard was changed, its manifest's hashes with it (so the bytes match what it
    says), is refused by the coordinator's hashes: the next source serves. The changed entry is no
    longer taken from its own cache either."""
    import dataclasses
    import hashlib

    from mtpipe.node.shards import Manifest

    with nodes(tmp_path, [[dense_ckpt], []]) as servers, engine_over(dense_ckpt, servers, specs=HALVES) as engine:
        entry = Path(engine.pipeline.load_replies[1].weights_path)
    manifest = Manifest.read(entry / fpmod.SHARD_MANIFEST)
    changed = manifest.tensors[-1]
    loc = fpmod.file_tensors(entry / WEIGHTS)[changed.name]
    data = bytearray((entry / WEIGHTS).read_bytes())
    data[loc.start] ^= 0x01
    (entry / WEIGHTS).write_bytes(bytes(data))
    sha = hashlib.sha256(data[loc.start : loc.start + loc.size]).hexdigest()
    manifest.tensors[-1] = dataclasses.replace(changed, sha256=sha)
    ShardCache(tmp_path / "cache1")._write_manifest(entry, manifest)  # consistent with the changed bytes

    with nodes(tmp_path, [[dense_ckpt], [], []]) as (holder, changed_source, fetcher):
        specs = [ShardSpec(a, b, TINY_LAYERS) for a, b in HALVES]
        the_next_source_serves(dense_ckpt, holder, fetcher, changed_source, reference)
        # The changed entry itself: dropped when its node is asked for that shard, and fetched again.
        engine = remote_engine(dense_ckpt, [holder.address, changed_source.address], dtype="float32", specs=specs,
                               sources=[holder.address])
        try:
            assert engine.pipeline.load_replies[1].weights_source == f"peer {holder.address}"
            assert generate(engine, PROMPTS[0]) == reference[PROMPTS[0]]
        finally:
            engine.pipeline.close()


@pytest.mark.parametrize("lie", ["dtype", "layout", "size"])  # (a shape is checked as a dtype is)
def test_a_source_that_misdescribes_its_tensors_is_not_taken(lie: str, dense_ckpt: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch, reference) -> None:
    """The same bytes under another dtype or shape, read as another layout, or sizes that would make
    the node clear its disk for them: refused before any byte comes, and the next source serves."""
    serve = weights.WeightStore.serve
    liar: list[weights.WeightStore] = []

    async def misdescribing(self: weights.WeightStore, request: pb.FetchRequest, context: object, node: str):
        first = True
        async for chunk in serve(self, request, context, node):
            if first and self is liar[0]:
                t = chunk.tensors[0]
                if lie == "dtype":
                    t.dtype = "I32" if t.dtype != "I32" else "F32"
                elif lie == "layout":
                    chunk.raw_hf = not chunk.raw_hf
                else:
                    t.size += 3 << 20
                    chunk.total_bytes += 3 << 20
            first = False
            yield chunk

    monkeypatch.setattr(weights.WeightStore, "serve", misdescribing)
    with nodes(tmp_path, [[dense_ckpt], [dense_ckpt], []]) as (lying, holder, fetcher):
        liar.append(lying.service.weights)
        the_next_source_serves(dense_ckpt, holder, fetcher, lying, reference)


def test_a_token_that_aged_while_room_was_made_is_asked_for_again(dense_ckpt: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Making room (pruning other shards) can outlast the data-plane token: the node asks for a fresh one
    instead of taking the transfer to the slower gRPC path."""
    import time

    room = {"made": False}

    def free_bytes(path: Path) -> int:
        return 1 << 40 if room["made"] else 0

    def slow_make_room(*args: object) -> int:
        time.sleep(0.4)
        room["made"] = True
        return 1 << 40

    monkeypatch.setattr(bulk, "TOKEN_TTL_S", 0.3)
    monkeypatch.setattr(fetch, "free_bytes", free_bytes)
    monkeypatch.setattr(fetch, "make_room", slow_make_room)
    total = shard_bytes(dense_ckpt, HALVES[1])
    with nodes(tmp_path, [[dense_ckpt], []]) as servers, engine_over(dense_ckpt, servers, specs=HALVES) as engine:
        assert engine.pipeline.load_replies[1].fetched_bytes == total
        assert servers[1].service.weights.transfer.transport == "tcp"


def test_a_bulk_token_is_good_once(dense_ckpt: Path, tmp_path: Path) -> None:
    fp = model_fingerprint(dense_ckpt)
    index = checkpoint_index(dense_ckpt)
    names = sorted(index)[:3]
    with nodes(tmp_path, [[dense_ckpt]], secret="s3cret") as (node,), \
            make_channel(node.address, "s3cret") as channel:
        stub = pb_grpc.NodeStub(channel)
        chunks = list(stub.FetchTensors(pb.FetchRequest(fingerprint=fp, names=names, raw=True), timeout=10))
        assert len(chunks) == 1 and chunks[0].token and chunks[0].data_port == node.service.data_port
        sock = bulk.connect("127.0.0.1", chunks[0].data_port, chunks[0].token)
        got = bytearray()
        while chunk := sock.recv(1 << 16):
            got += chunk
        sock.close()
        assert bytes(got) == b"".join(_read(index[n]) for n in names)
        with pytest.raises(bulk.BulkRefused):
            bulk.connect("127.0.0.1", chunks[0].data_port, chunks[0].token)


def test_a_fetcher_that_stops_taking_bytes_is_let_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fetcher stopped (or cut off) whose kernel still answers: the holder's send gives up once a
    piece has not gone out within the idle timeout, and its stream and file are closed."""
    import asyncio
    import socket
    import time

    monkeypatch.setattr(bulk, "IDLE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(bulk, "SEND_PIECE", 8 << 20)
    big = tmp_path / "big.bin"
    size = 64 << 20  # far more than the loopback's socket buffers hold
    with open(big, "wb") as f:
        f.truncate(size)
    grants = bulk.BulkGrants()
    token = grants.issue([fpmod.TensorLoc("t", big, 0, size, "uint8", (size,))], 0)
    outcome: list[BaseException | None] = []

    async def scenario() -> float:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await bulk.serve_bulk(grants, reader, writer, lambda n: None)
                outcome.append(None)
            except BaseException as e:  # noqa: BLE001 - what the test looks at
                outcome.append(e)
            finally:
                writer.close()

        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        client.sendall(token)
        start = time.monotonic()
        while not outcome and time.monotonic() - start < 20:
            await asyncio.sleep(0.05)  # the client reads nothing after connecting
        client.close()
        server.close()
        return time.monotonic() - start

    took = asyncio.run(scenario())
    assert outcome and isinstance(outcome[0], TimeoutError) and took < 10, (outcome, took)


def test_no_disk_space_refuses_before_the_transfer(dense_ckpt: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch, "free_bytes", lambda path: 10 << 20)
    with nodes(tmp_path, [[dense_ckpt], []]) as servers:
        with pytest.raises(ValueError, match="not enough disk space for the shard"), \
                engine_over(dense_ckpt, servers, specs=HALVES):
            pass
        assert servers[1].service.weights.transfer.fetched_bytes == 0
        assert servers[0].service.weights.transfer.served_bytes == 0
        assert not list((tmp_path / "cache1").rglob(PART))


def test_without_a_source_the_node_says_what_is_missing(dense_ckpt: Path, tmp_path: Path) -> None:
    with nodes(tmp_path, [[dense_ckpt], []]) as servers:
        specs = [ShardSpec(a, b, TINY_LAYERS) for a, b in HALVES]
        with pytest.raises(ValueError, match="no node to fetch it from"):
            remote_engine(dense_ckpt, [s.address for s in servers], dtype="float32", specs=specs)


def test_a_load_of_layers_the_model_does_not_have_is_refused_before_any_fetch(tmp_path: Path) -> None:
    import asyncio

    store = weights.WeightStore([], shard_cache=tmp_path / "cache")
    for start, end in ((-2, 4), (3, 3), (0, TINY_LAYERS + 1)):
        request = pb.LoadRequest(fingerprint="ab" * 32, start=start, end=end, num_layers=TINY_LAYERS, mtp=True)
        refused = rf"invalid layer range \[{start}, {end}\) for a model of {TINY_LAYERS} layers"
        with pytest.raises(ValueError, match=refused):
            asyncio.run(store.resolve(request))
    assert not any((tmp_path / "cache").rglob("*"))


# -- serving tensors --------------------------------------------------------------------------------


def _read(loc: fpmod.TensorLoc) -> bytes:
    with open(loc.file, "rb") as f:
        f.seek(loc.start)
        return f.read(loc.size)


def test_fetch_tensors_serves_only_tensors_of_a_model_it_holds(dense_ckpt: Path, tmp_path: Path) -> None:
    fp = model_fingerprint(dense_ckpt)
    index = checkpoint_index(dense_ckpt)
    names = sorted(index)[:5]
    with nodes(tmp_path, [[dense_ckpt]], secret="s3cret") as (node,), \
            make_channel(node.address, "s3cret") as channel:
        stub = pb_grpc.NodeStub(channel)

        def fetch_all(req: pb.FetchRequest, secret: str = "s3cret") -> list[pb.TensorChunk]:
            if secret == "s3cret":
                return list(stub.FetchTensors(req, timeout=10))
            with make_channel(node.address, secret) as other:
                return list(pb_grpc.NodeStub(other).FetchTensors(req, timeout=10))

        chunks = fetch_all(pb.FetchRequest(fingerprint=fp, names=names))
        head = chunks[0]
        assert [t.name for t in head.tensors] == names and head.total_bytes == sum(index[n].size for n in names)
        assert [t.sha256 for t in head.tensors] == [fpmod.hash_range(index[n].file, index[n].start, index[n].size)
                                                    for n in names]
        assert json.loads(head.config_json) == json.loads((dense_ckpt / "config.json").read_text())
        whole = b"".join(_read(index[n]) for n in names)
        assert b"".join(c.data for c in chunks[1:]) == whole
        # Resumed from an offset: the rest, at that offset.
        tail = fetch_all(pb.FetchRequest(fingerprint=fp, names=names, offset=1000))
        assert tail[1].offset == 1000 and b"".join(c.data for c in tail[1:]) == whole[1000:]

        refused = [
            (pb.FetchRequest(fingerprint="0" * 64, names=names), grpc.StatusCode.NOT_FOUND),
            (pb.FetchRequest(fingerprint="../" + fp, names=names), grpc.StatusCode.INVALID_ARGUMENT),
            (pb.FetchRequest(fingerprint="f" * 300, names=names), grpc.StatusCode.INVALID_ARGUMENT),
            (pb.FetchRequest(fingerprint=fp, names=[names[0]] * 10_000), grpc.StatusCode.INVALID_ARGUMENT),
            (pb.FetchRequest(fingerprint=fp, names=["config.json"]), grpc.StatusCode.NOT_FOUND),
            (pb.FetchRequest(fingerprint=fp, names=["tokenizer.json"]), grpc.StatusCode.NOT_FOUND),
            (pb.FetchRequest(fingerprint=fp, names=["../../../../etc/passwd"]), grpc.StatusCode.NOT_FOUND),
            (pb.FetchRequest(fingerprint=fp, names=[fpmod.SIDECAR]), grpc.StatusCode.NOT_FOUND),
            (pb.FetchRequest(fingerprint=fp, names=[]), grpc.StatusCode.INVALID_ARGUMENT),
            (pb.FetchRequest(fingerprint=fp, names=names, offset=len(whole) + 1), grpc.StatusCode.OUT_OF_RANGE),
        ]
        for req, code in refused:
            with pytest.raises(grpc.RpcError) as err:
                fetch_all(req)
            assert err.value.code() == code, req
        with pytest.raises(grpc.RpcError) as err:
            fetch_all(pb.FetchRequest(fingerprint=fp, names=names), secret="wrong")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the TLS handshake fails: nothing reaches the node
        assert node.service.weights.transfer.served_bytes == 2 * len(whole) - 1000


def test_the_coordinators_hashes_and_config_decide() -> None:
    from dataclasses import replace

    from mtpipe.node.shards import Expected, TensorInfo

    config = json.dumps({"model_type": "qwen3_5", "hidden_size": 64})
    t = TensorInfo("a.weight", "F32", (2,), 8, "11" * 32)
    want = Expected({"a.weight": "11" * 32}, fpmod.config_sha256(config))
    reordered = json.dumps({"hidden_size": 64, "model_type": "qwen3_5"}, indent=2)
    assert want.mismatch([t], reordered) is None  # the content counts, not its layout
    assert "not the coordinator's" in want.mismatch([t], json.dumps({"model_type": "qwen3_5", "hidden_size": 65}))
    assert "not the coordinator's" in want.mismatch([t], "{not json")
    other = TensorInfo("a.weight", "F32", (2,), 8, "22" * 32)
    assert "a.weight is not the coordinator's" in want.mismatch([other], config)
    # The same bytes under another dtype or shape, or read as another layout, are other weights.
    want = Expected({"a.weight": "11" * 32}, fpmod.config_sha256(config), {"a.weight": ("F32", (2,))}, False)
    assert want.mismatch([t], config, False) is None and want.mismatch([t], config) is None
    assert "a.weight is I32 [2], the coordinator's F32 [2]" in want.mismatch([replace(t, dtype="I32")], config)
    assert "a.weight is F32 [1, 2]" in want.mismatch([replace(t, shape=(1, 2))], config)
    assert "laid out as raw Hugging Face ones" in want.mismatch([t], config, True)


def test_stream_verifier_checks_every_tensor_as_bytes_arrive() -> None:
    """Hashes over pieces of any size, empty tensors included; a flipped byte, a short or a long stream fail."""
    import hashlib
    import os

    from mtpipe.node.shards import StreamVerifier, TensorInfo

    blobs = [os.urandom(1000), b"", os.urandom(5000), os.urandom(7)]
    tensors = [TensorInfo(f"t{i}", "F32", (len(b),), len(b), hashlib.sha256(b).hexdigest()) for i, b in enumerate(blobs)]
    data = b"".join(blobs)
    v = StreamVerifier(tensors)
    for i in range(0, len(data), 333):
        v.feed(memoryview(data)[i : i + 333])
    assert v.finish() is None
    for bad, why in [(data[:-1], "t3: truncated"), (data[:500] + bytes([data[500] ^ 1]) + data[501:], "t0: content hash differs"),
                     (data + b"y", "more bytes than the tensors hold")]:
        v = StreamVerifier(tensors)
        v.feed(bad)
        assert v.finish() == why


def test_an_unchanged_cache_entry_is_not_hashed_again(dense_ckpt: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached shard verified once is trusted while its file keeps its size and time; touched, it is hashed."""
    from mtpipe.node import shards

    with nodes(tmp_path, [[dense_ckpt], []]) as servers, engine_over(dense_ckpt, servers, specs=HALVES) as engine:
        entry = Path(engine.pipeline.load_replies[1].weights_path)
    cache = ShardCache(entry.parents[1])
    key = ShardKey(entry.parent.name, *HALVES[1], TINY_LAYERS, True)
    hashed: list[Path] = []
    real = shards.verify_file
    monkeypatch.setattr(shards, "verify_file", lambda f, t: hashed.append(f) or real(f, t))
    assert cache.lookup(key) == entry and hashed == []
    (entry / WEIGHTS).touch()
    assert cache.lookup(key) == entry and hashed == [entry / WEIGHTS]
    assert cache.lookup(key) == entry and len(hashed) == 1  # verified again, trusted again


def test_a_damaged_checkpoint_is_a_clear_error(dense_ckpt: Path, tmp_path: Path) -> None:
    """A truncated weights file, a config that is not an object, a header whose entries are malformed:
    each a ValueError naming the file (a node answers INVALID_ARGUMENT, or skips that copy), never an
    error of MLX's or Python's own from deep inside."""
    import struct

    from mtpipe.models.config import load_config
    from mtpipe.models.loading import read_checkpoint

    bad = tmp_path / "bad"
    shutil.copytree(dense_ckpt, bad)
    weights_file = next(bad.glob("*.safetensors"))
    weights_file.write_bytes(weights_file.read_bytes()[: weights_file.stat().st_size // 2])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        read_checkpoint(bad)
    (bad / "config.json").write_text("[]")
    with pytest.raises(ValueError, match="config.json: not a JSON object"):
        load_config(bad)
    header = json.dumps({"x": {"dtype": "F32", "shape": [1], "data_offsets": 5}}).encode()
    weights_file.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    with pytest.raises(ValueError, match="the header's entry for 'x' is malformed"):
        fpmod.file_tensors(weights_file)


def test_a_write_that_fails_on_the_data_plane_is_this_nodes_fault() -> None:
    """A full disk while a shard streams in on the data plane is this node's failure (final, as over
    gRPC), never taken for a broken stream from the source (which would try every other source)."""
    import errno
    import socket
    import threading

    class FullDisk:
        def write(self, data: object) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    sender, receiver = socket.socketpair()
    threading.Thread(target=lambda: (sender.sendall(bytes(1 << 20)), sender.close()), daemon=True).start()
    try:
        with pytest.raises(bulk.WriteFailed) as err:
            bulk.receive(receiver, FullDisk(), 1 << 20, lambda view, done: done(), lambda n: None)
        assert err.value.errno == errno.ENOSPC
    finally:
        receiver.close()


def test_a_cache_entry_damaged_since_it_was_written_is_served_as_data_loss(dense_ckpt: Path, tmp_path: Path) -> None:
    """A shard cache entry whose weights file went bad on disk (its manifest still names it): FetchTensors
    answers DATA_LOSS, which tells the asker to try another source, and the node serves on."""
    with nodes(tmp_path, [[dense_ckpt], []]) as servers, engine_over(dense_ckpt, servers, specs=HALVES) as engine:
        cached = Path(engine.pipeline.load_replies[1].weights_path) / WEIGHTS
    data = bytearray(cached.read_bytes())
    data[8] = ord("]")  # the header's JSON no longer parses
    cached.write_bytes(bytes(data))
    fp = model_fingerprint(dense_ckpt)
    names = shard_names(str(dense_ckpt), *HALVES[1], TINY_LAYERS, True)[:3]
    with nodes(tmp_path, [[], []]) as (_, holder), make_channel(holder.address, None) as channel:
        stub = pb_grpc.NodeStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.FetchTensors(pb.FetchRequest(fingerprint=fp, names=names), timeout=10))
        assert err.value.code() == grpc.StatusCode.DATA_LOSS and "damaged" in err.value.details()
        assert stub.Ping(pb.PingRequest(), timeout=10).node_id
