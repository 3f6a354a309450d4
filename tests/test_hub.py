"""A node with --download takes from the hub only the files that hold its shard, after checking that
the repo is the model named by the fingerprint (node/hub.py).

No test talks to the hub: `LocalRepo` plays a hub repo from a model directory, answering what
huggingface_hub answers (file list, safetensors headers, LFS content hashes) and "downloading" by
copying into a snapshot directory laid out like the hub cache's."""

from __future__ import annotations

import hashlib
from pathlib import Path

import grpc
import pytest

from mtpipe.models.fingerprint import checkpoint_index, hash_range, model_fingerprint, read_header, shard_names
from mtpipe.models.registry import hub_origin
from mtpipe.models.tiny import build_tiny_checkpoint
from mtpipe.node import hub
from mtpipe.node.model_dirs import MODEL_DIRS_ENV
from mtpipe.node.server import NodeServer
from mtpipe.node.wire import make_channel
from mtpipe.proto import mtpipe_pb2 as pb
from mtpipe.proto import mtpipe_pb2_grpc as pb_grpc

REPO, REVISION = "tiny-org/tiny-model", "0123456789abcdef0123456789abcdef01234567"


class LocalRepo:
    """A hub repo at one commit, served from `source`; records what was downloaded."""

    def __init__(self, source: Path, cache: Path, tamper: str | None = None):
        self.source, self.tamper = source, tamper
        self.snapshot = cache / "models--tiny-org--tiny-model" / "snapshots" / REVISION
        self.downloaded: list[str] = []
        self.calls = 0

    def files(self) -> list[str]:
        self.calls += 1
        return sorted(p.name for p in self.source.iterdir() if p.is_file() and not p.name.startswith("."))

    def safetensors(self) -> dict[str, tuple[str, dict[str, tuple[str, list[int]]]]]:
        self.calls += 1
        out = {}
        for f in sorted(self.source.glob("*.safetensors")):
            header, _ = read_header(f)
            tensors = {n: (m["dtype"], m["shape"]) for n, m in header.items() if n != "__metadata__"}
            out[f.name] = (hashlib.sha256(f.read_bytes()).hexdigest(), tensors)
        return out

    def download(self, filename: str) -> Path:
        """As huggingface_hub lays a download out: a blob named by its hash, linked from the snapshot."""
        self.calls += 1
        blobs = self.snapshot.parent.parent / "blobs"
        blobs.mkdir(parents=True, exist_ok=True)
        self.snapshot.mkdir(parents=True, exist_ok=True)
        data = bytearray((self.source / filename).read_bytes())
        blob = blobs / hashlib.sha256(data).hexdigest()
        if filename == self.tamper:  # a transfer that went wrong: one byte differs
            data[-1] ^= 0x01
        blob.write_bytes(bytes(data))
        dst = self.snapshot / filename
        dst.unlink(missing_ok=True)
        dst.symlink_to(blob)
        self.downloaded.append(filename)
        return dst

    def local_dir(self) -> Path:
        return self.snapshot


@pytest.fixture(scope="module")
def sharded(tiny_root: Path) -> Path:
    return build_tiny_checkpoint(layout="sharded", root=tiny_root)


def holders(ckpt: Path, names: list[str]) -> set[str]:
    index = checkpoint_index(ckpt)
    return {index[n].file.name for n in names}


def test_only_the_files_holding_the_shard(sharded: Path, tmp_path: Path) -> None:
    fp = model_fingerprint(sharded)
    specs = [(a, b, mtp) for a in range(8) for b in range(a + 1, 9) for mtp in (False, True)]
    one_file = next(s for s in specs if len(holders(sharded, shard_names(sharded, s[0], s[1], 8, s[2]))) == 1)
    names = shard_names(sharded, one_file[0], one_file[1], 8, one_file[2])
    repo = LocalRepo(sharded, tmp_path)
    snapshot = hub.download_shard(repo, fp, names)
    weights = [f for f in repo.downloaded if f.endswith(".safetensors")]
    assert weights == sorted(holders(sharded, names)) and len(weights) == 1
    assert "config.json" in repo.downloaded and "tokenizer.json" in repo.downloaded
    assert sorted(p.name for p in snapshot.glob("*.safetensors")) == weights
    # Everything that shard reads is there, as stored.
    index = checkpoint_index(snapshot)
    original = checkpoint_index(sharded)
    for n in names:
        loc, ref = index[n], original[n]
        with open(loc.file, "rb") as a, open(ref.file, "rb") as b:
            a.seek(loc.start)
            b.seek(ref.start)
            assert a.read(loc.size) == b.read(ref.size)
    # The same shard again: checked from the marker, without asking the repo anything.
    calls = repo.calls
    assert hub.download_shard(repo, fp, names) == snapshot and repo.calls == calls
    # A shard that needs the other file downloads only that one.
    everything = shard_names(sharded, 0, 8, 8, True)
    hub.download_shard(repo, fp, everything)
    assert sorted(f for f in repo.downloaded if f.endswith(".safetensors")) == sorted(holders(sharded, everything))


def test_another_model_or_a_bad_file_is_refused(sharded: Path, tmp_path: Path) -> None:
    names = shard_names(sharded, 0, 8, 8, True)
    repo = LocalRepo(sharded, tmp_path / "a")
    with pytest.raises(ValueError, match="the repo is model"):
        hub.download_shard(repo, "0" * 64, names)
    assert not [f for f in repo.downloaded if f.endswith(".safetensors")]  # refused before any weights
    weight_file = min(holders(sharded, names))
    repo = LocalRepo(sharded, tmp_path / "b", tamper=weight_file)
    with pytest.raises(ValueError, match=f"{weight_file} downloaded with sha256"):
        hub.download_shard(repo, model_fingerprint(sharded), names)
    assert not (repo.snapshot / hub.VERIFIED).exists()
    assert not (repo.snapshot / weight_file).exists()  # dropped, not handed back by the cache next time
    assert not any((repo.snapshot.parent.parent / "blobs").iterdir()) or all(
        hashlib.sha256(b.read_bytes()).hexdigest() == b.name for b in (repo.snapshot.parent.parent / "blobs").iterdir())


def test_a_file_damaged_in_the_hub_cache_is_downloaded_again(sharded: Path, tmp_path: Path) -> None:
    """A weight file of the snapshot cut short on disk (its header unreadable) goes and comes again: it
    never blocks every later download of the shard."""
    names = shard_names(sharded, 0, 2, 8, False)
    fp = model_fingerprint(sharded)
    repo = LocalRepo(sharded, tmp_path)
    snapshot = hub.download_shard(repo, fp, names)
    damaged = min(holders(sharded, names))
    blob = (snapshot / damaged).resolve()
    blob.write_bytes(blob.read_bytes()[:4])
    assert hub.download_shard(repo, fp, names) == snapshot and repo.downloaded[-1] == damaged
    index, original = checkpoint_index(snapshot), checkpoint_index(sharded)
    assert all(index[n].size == original[n].size for n in names)


def test_repo_names_are_checked_and_read_from_the_cache_layout() -> None:
    for repo, revision in [("../etc", REVISION), ("a/b/../../c", REVISION), ("org/name", "main"),
                           ("org/name", "../" + REVISION[3:])]:
        with pytest.raises(ValueError):
            hub.hub_repo(repo, revision)
    assert hub.hub_repo("Qwen/Qwen3.5-0.8B", REVISION).repo == "Qwen/Qwen3.5-0.8B"
    assert hub_origin(f"/h/models--Qwen--Qwen3.5-0.8B/snapshots/{REVISION}") == ("Qwen/Qwen3.5-0.8B", REVISION)
    assert hub_origin("/h/models/Qwen3.5") is None and hub_origin(f"/h/snapshots/{REVISION}") is None


def test_a_node_loads_its_shard_from_the_hub(sharded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Load names a path the node may not read, no source, and the hub repo: a node with --download
    takes its shard from there; one without says how to allow it."""
    monkeypatch.delenv(MODEL_DIRS_ENV, raising=False)
    fp = model_fingerprint(sharded)
    names = shard_names(sharded, 4, 8, 8, True)
    request = pb.LoadRequest(model_path=str(sharded), start=4, end=8, num_layers=8, mtp=True, dtype="float32",
                             fingerprint=fp, tensors=names, hub_repo=REPO, hub_revision=REVISION)
    repos: list[LocalRepo] = []

    def local_repo(repo: str, revision: str) -> LocalRepo:
        assert (repo, revision) == (REPO, REVISION)
        repos.append(LocalRepo(sharded, tmp_path / "hub"))
        return repos[-1]

    for download in (False, True):
        server = NodeServer("127.0.0.1", 0, shard_cache=tmp_path / "cache", download=download).start()
        server.service.weights.hub_repo = local_repo
        server.service.weights.readable.given.append(tmp_path / "hub")  # the node's hub cache
        try:
            with make_channel(server.address) as channel:
                stub = pb_grpc.NodeStub(channel)
                if not download:
                    with pytest.raises(grpc.RpcError) as e:
                        stub.Load(request)
                    assert "--download" in e.value.details() and not repos
                    continue
                reply = stub.Load(request)
                assert reply.weights_source == f"hub {REPO}@{REVISION[:12]}"
                assert Path(reply.weights_path) == repos[0].snapshot and reply.has_mtp
        finally:
            server.stop(0)


def test_a_downloaded_file_is_read_once(sharded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checking a download hashes its tensors too: the next check and the fingerprint read none again."""
    from mtpipe.models import fingerprint

    reads: list[str] = []
    hash_file = fingerprint._hash_file
    monkeypatch.setattr(fingerprint, "_hash_file", lambda f: reads.append(f.name) or hash_file(f))
    monkeypatch.setattr(hub, "_sha256", lambda p: reads.append(p.name) or hash_range(p, 0, p.stat().st_size))
    fp = model_fingerprint(sharded)
    reads.clear()
    names = shard_names(sharded, 0, 8, 8, True)
    repo = LocalRepo(sharded, tmp_path)
    snapshot = hub.download_shard(repo, fp, names)
    weights = sorted(f for f in repo.downloaded if f.endswith(".safetensors"))
    assert sorted(r for r in reads if r.endswith(".safetensors")) == weights
    reads.clear()
    fingerprint._memo.clear()  # a new process: only the sidecar is left
    assert hub.download_shard(repo, fp, names) == snapshot
    assert model_fingerprint(snapshot) == fp
    assert not [r for r in reads if r.endswith(".safetensors")]


def test_no_room_for_the_files_is_refused_before_downloading(sharded: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from mtpipe.node.shards import NoDiskSpace

    names = shard_names(sharded, 0, 8, 8, True)
    repo = LocalRepo(sharded, tmp_path)
    monkeypatch.setattr(hub, "free_bytes", lambda path: 1 << 20)
    with pytest.raises(NoDiskSpace, match="not enough disk space for the shard's hub files"):
        hub.download_shard(repo, model_fingerprint(sharded), names)
    assert not [f for f in repo.downloaded if f.endswith(".safetensors")]
    assert not (repo.snapshot / hub.VERIFIED).exists()


def test_the_hubs_own_errors_about_a_repo_refuse_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub's errors about a repo's safetensors (not OSError or ValueError) reach the Load as a
    refusal naming the repo, not as gRPC UNKNOWN."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import SafetensorsParsingError

    from mtpipe.node.hub import HfHubRepo

    def unparsable(self, repo_id: str, filename: str, **kw: object) -> None:
        raise SafetensorsParsingError(f"{filename}: the header is not JSON (test)")

    monkeypatch.setattr(HfApi, "list_repo_files", lambda self, repo_id, **kw: ["config.json", "model.safetensors"])
    monkeypatch.setattr(HfApi, "parse_safetensors_file_metadata", unparsable)
    with pytest.raises(ValueError, match=r"org/model@abc: the hub's safetensors headers could not be read "
                                         r"\(SafetensorsParsingError"):
        HfHubRepo("org/model", "abc").safetensors()
    monkeypatch.setattr(HfApi, "list_repo_files", lambda self, repo_id, **kw: ["config.json"])
    with pytest.raises(ValueError, match="no safetensors files"):
        HfHubRepo("org/model", "abc").safetensors()


def test_the_hubs_headers_cover_every_safetensors_file_of_the_repo(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A repo with an `mtp.safetensors` beside `model.safetensors` (the README's way to keep the MTP head):
    the node reads the headers of both, as the coordinator's fingerprint takes both (huggingface_hub's
    own metadata reads model.safetensors alone, and the node refused the repo as another model).
    huggingface_hub's requests are answered from a local directory here."""
    from types import SimpleNamespace

    from huggingface_hub import HfApi
    from huggingface_hub.utils._safetensors import SafetensorsFileMetadata, TensorInfo

    from mtpipe.node.hub import HfHubRepo

    source = build_tiny_checkpoint(layout="separate_mtp", num_layers=4, root=tmp_path / "src")
    (source / "sub").mkdir()
    (source / "sub" / "other.safetensors").write_bytes((source / "mtp.safetensors").read_bytes())  # (not the model's)

    def parse(self, repo_id: str, filename: str, revision: str | None = None, **kw: object):
        header, _ = read_header(source / filename)
        return SafetensorsFileMetadata(metadata=header.get("__metadata__", {}), tensors={
            n: TensorInfo(dtype=m["dtype"], shape=m["shape"], data_offsets=tuple(m["data_offsets"]))
            for n, m in header.items() if n != "__metadata__"})

    def paths_info(self, repo_id: str, paths: list[str], revision: str | None = None, **kw: object):
        return [SimpleNamespace(path=p, lfs=SimpleNamespace(sha256=hashlib.sha256((source / p).read_bytes())
                                                            .hexdigest())) for p in paths]

    monkeypatch.setattr(HfApi, "list_repo_files", lambda self, repo_id, revision=None, **kw: sorted(
        str(p.relative_to(source)) for p in source.rglob("*") if p.is_file()))
    monkeypatch.setattr(HfApi, "parse_safetensors_file_metadata", parse)
    monkeypatch.setattr(HfApi, "get_paths_info", paths_info)
    got = HfHubRepo(REPO, REVISION).safetensors()
    assert sorted(got) == ["model.safetensors", "mtp.safetensors"]
    assert got == LocalRepo(source, tmp_path / "cache").safetensors()


def test_nodes_noting_their_checked_files_at_once_keep_each_others(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Two nodes sharing a hub cache, loading other shards of one model, note their checked files at
    the same moment: the marker keeps both (the last writer dropped the other's files, whose next Load
    went back to the network, and offline failed)."""
    import json
    import os
    import threading
    import time

    real_replace = os.replace

    def slow_replace(a: object, b: object) -> None:  # the window between reading the marker and writing it
        time.sleep(0.3)
        real_replace(a, b)

    monkeypatch.setattr(hub.os, "replace", slow_replace)
    marks = [threading.Thread(target=hub._mark, args=(tmp_path, "fp", {"t": "f"}, {name: "sha"}))
             for name in ("model-00001.safetensors", "model-00002.safetensors")]
    for t in marks:
        t.start()
    for t in marks:
        t.join()
    marker = json.loads((tmp_path / hub.VERIFIED).read_text())
    assert sorted(marker["fp"]["files"]) == ["model-00001.safetensors", "model-00002.safetensors"]
