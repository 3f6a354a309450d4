"""A node reads models only under its model directories and its shard cache (node/model_dirs.py):
whoever drives it cannot make it read another part of its disk, and a refused Load leaves the node
as it was."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from helpers import TINY_LAYERS

from mtpipe.models.fingerprint import model_fingerprint, shard_names
from mtpipe.node.model_dirs import MODEL_DIRS_ENV, ModelDirs
from mtpipe.node.server import NodeServer
from mtpipe.node.wire import make_channel
from mtpipe.proto import mtpipe_pb2 as pb
from mtpipe.proto import mtpipe_pb2_grpc as pb_grpc


@pytest.fixture
def no_env_dirs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test session's own model directories (conftest) do not apply here."""
    monkeypatch.delenv(MODEL_DIRS_ENV, raising=False)


@pytest.fixture
def models(dense_ckpt: Path, tmp_path: Path) -> dict[str, Path]:
    """One model inside a model directory, one outside it, and ways out of the directory."""
    allowed, outside = tmp_path / "models", tmp_path / "elsewhere"
    allowed.mkdir()
    shutil.copytree(dense_ckpt, allowed / "tiny")
    shutil.copytree(dense_ckpt, outside)
    (allowed / "link").symlink_to(outside, target_is_directory=True)
    return {"allowed": allowed, "inside": allowed / "tiny", "outside": outside, "link": allowed / "link",
            "dotdot": allowed / ".." / "elsewhere"}


def load_request(path: Path, fingerprint: str, start: int = 0, end: int = TINY_LAYERS) -> pb.LoadRequest:
    return pb.LoadRequest(model_path=str(path), start=start, end=end, num_layers=TINY_LAYERS, mtp=True, dtype="float32",
                          fingerprint=fingerprint, tensors=shard_names(path, start, end, TINY_LAYERS, True))


def node(allowed: Path, tmp_path: Path) -> NodeServer:
    return NodeServer("127.0.0.1", 0, model_dirs=[allowed], shard_cache=tmp_path / "cache").start()


def test_model_dirs_resolve_links_and_dotdot(models: dict[str, Path], tmp_path: Path, no_env_dirs: None) -> None:
    dirs = ModelDirs([models["allowed"]], tmp_path / "cache")
    assert dirs.allows(models["inside"]) and dirs.allows(models["allowed"])
    assert dirs.allows(tmp_path / "cache" / "abc" / "0-8-of-8")
    for way_out in ("outside", "link", "dotdot"):
        assert not dirs.allows(models[way_out]), way_out
    assert not dirs.allows("/etc") and not dirs.allows(tmp_path)
    assert "--model-dir" in dirs.refusal(models["outside"])


def test_load_follows_a_path_only_under_the_model_dirs(models: dict[str, Path], tmp_path: Path,
                                                     no_env_dirs: None) -> None:
    fp = model_fingerprint(models["inside"])
    server = node(models["allowed"], tmp_path)
    try:
        with make_channel(server.address) as channel:
            stub = pb_grpc.NodeStub(channel)
            # The same model, by fingerprint, outside the model directories or out through a link or
            # "..": not read (the node has no cache entry and no source to fetch from).
            for way_out in ("outside", "link", "dotdot"):
                for fingerprint in (fp, ""):  # with and without naming the model
                    with pytest.raises(grpc.RpcError) as e:
                        stub.Load(load_request(models[way_out], fingerprint))
                    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert "not under this node's model directories" in e.value.details(), e.value.details()
                    assert server.service.worker is None
            reply = stub.Load(load_request(models["inside"], fp, 0, 2))
            assert reply.weights_source == "local" and Path(reply.weights_path) == models["inside"]
            key = server.service.key
            # A refused Load leaves the loaded shard as it was, and it still answers.
            with pytest.raises(grpc.RpcError) as e:
                stub.Load(load_request(models["outside"], "", 2, 4))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert server.service.key == key and server.service.worker is not None
            for junk in ("x" * 64, "../" + fp, fp.upper() + "0"):  # a fingerprint names a cache directory: refused
                with pytest.raises(grpc.RpcError) as e:
                    stub.Load(load_request(models["outside"], junk, 2, 4))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a model fingerprint" in e.value.details()
                assert server.service.key == key
            assert not [p for p in (tmp_path / "cache").glob("*") if p.name != ".locks"]
            # Named by fingerprint, the model is the copy the node now holds, wherever the hint points.
            reply = stub.Load(load_request(models["outside"], fp, 2, 4))
            assert reply.weights_source == "local" and Path(reply.weights_path) == models["inside"]
            assert stub.Load(load_request(models["outside"], fp, 2, 4)).reused
            assert stub.Health(pb.HealthRequest()).fingerprint == fp
    finally:
        server.stop(0)


def test_the_env_names_model_dirs(models: dict[str, Path], tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODEL_DIRS_ENV, str(models["outside"]))
    server = node(models["allowed"], tmp_path)
    try:
        with make_channel(server.address) as channel:
            reply = pb_grpc.NodeStub(channel).Load(load_request(models["outside"], model_fingerprint(models["outside"])))
        assert reply.weights_source == "local"
    finally:
        server.stop(0)


@pytest.fixture
def spawned(models: dict[str, Path], tmp_path: Path, no_env_dirs: None) -> Iterator[str]:
    """`mtpipe node --model-dir` as a user starts it."""
    from mtpipe.coordinator.bench.nodes import NodeProcesses

    with NodeProcesses(1, model_dirs=[models["allowed"]]) as nodes:
        yield nodes.addresses[0]


def test_mtpipe_node_model_dir_flag(models: dict[str, Path], spawned: str) -> None:
    fp = model_fingerprint(models["inside"])
    with make_channel(spawned) as channel:
        stub = pb_grpc.NodeStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.Load(load_request(models["outside"], fp))
        assert "--model-dir" in e.value.details()
        assert stub.Load(load_request(models["inside"], fp)).weights_source == "local"
