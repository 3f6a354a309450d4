"""Where models come from: a missing demo model is an error that says how to get one, never a stand-in."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtpipe.models import registry


def test_missing_demo_model_is_an_error_naming_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "DEMO_MODEL", tmp_path / "demo")
    with pytest.raises(FileNotFoundError) as e:
        registry.resolve_model(None)
    message = str(e.value)
    assert str(tmp_path / "demo") in message
    assert "config.json" in message and "--model PATH" in message and "pip install -e ." in message


def test_bundled_demo_model_resolves_to_its_directory() -> None:
    assert registry.resolve_model(None) == registry.DEMO_MODEL
    assert (registry.DEMO_MODEL / "model.safetensors").exists()


def test_local_directory_is_taken_as_is(tmp_path: Path) -> None:
    assert registry.resolve_model(str(tmp_path)) == tmp_path
    for empty in ("", "  "):  # (not the working directory)
        with pytest.raises(ValueError, match="the model is empty"):
            registry.resolve_model(empty)


def test_unknown_local_path_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A path that is not there: refused naming it, and sent to the hub only if it could be a repo id
    (where the hub's answer is named beside the missing directory)."""
    import huggingface_hub

    asked: list[str] = []

    def no_such_repo(repo: str, **kw: object) -> str:
        asked.append(repo)
        raise huggingface_hub.errors.LocalEntryNotFoundError("not in the cache, and offline (test)")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_such_repo)
    for model in (str(tmp_path / "nope"), "~/no-such-models/x", "./models/x", "a/b/c", "Qwen/Qwen3.5-27B/"):
        with pytest.raises(FileNotFoundError, match="not a Hugging Face repo id") as e:
            registry.resolve_model(model)
        assert str(Path(model).expanduser().absolute()) in str(e.value)
    assert asked == []
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as e:  # a relative directory mistyped looks like owner/name
        registry.resolve_model("models/Qwen3.5-27b")
    assert asked == ["models/Qwen3.5-27b"]
    assert str(tmp_path / "models" / "Qwen3.5-27b") in str(e.value) and "LocalEntryNotFoundError" in str(e.value)
    assert [registry.hub_repo_id(m) for m in ("Qwen/Qwen3.5-27B", "mlx-community/Qwen3.5-0.8B-4bit")] == [
        "Qwen/Qwen3.5-27B", "mlx-community/Qwen3.5-0.8B-4bit"]


def test_a_hub_snapshot_counts_as_here_only_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A download that stopped halfway leaves a snapshot without some weight files: not the model here
    (the machine would advertise it, and serve another fingerprint). Asked with the files a model needs
    only, as `resolve_model` downloads them."""
    import json

    import huggingface_hub

    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "config.json").write_text("{}")
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": files[0], "b": files[1]}}))
    (snapshot / files[0]).write_bytes(b"x")
    asked: list[dict] = []

    def cached(repo: str, **kw: object) -> str:
        asked.append(kw)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", cached)
    assert registry.local_model("org/model") is None
    (snapshot / files[1]).write_bytes(b"x")
    assert registry.local_model("org/model") == snapshot
    assert asked[-1] == {"revision": None, "local_files_only": True, "allow_patterns": registry.HUB_FILES}


def test_a_revision_reaches_the_hub_and_nothing_else_takes_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--revision` picks a hub repo's branch, tag or commit, for the download and for the copy looked up
    in the cache; with a local directory or the demo model it would mean nothing, so it is refused."""
    import huggingface_hub

    asked: list[tuple[str, dict]] = []

    def snapshot(repo: str, **kw: object) -> str:
        asked.append((repo, kw))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    assert registry.resolve_model("org/model", "v1.0") == tmp_path
    assert asked[-1] == ("org/model", {"revision": "v1.0", "allow_patterns": registry.HUB_FILES})
    assert registry.local_model("org/model", "abc123") == tmp_path
    assert asked[-1][1]["revision"] == "abc123" and asked[-1][1]["local_files_only"] is True
    asked.clear()
    for model in (None, str(tmp_path), "a/b/c"):
        for find in (registry.resolve_model, registry.local_model):
            with pytest.raises(ValueError, match="applies only to a Hugging Face repo id"):
                find(model, "main")
    with pytest.raises(ValueError, match="empty"):
        registry.resolve_model("org/model", " ")
    assert asked == []


def test_the_cli_and_cluster_yaml_take_a_revision(tmp_path: Path) -> None:
    import argparse

    from mtpipe.coordinator.cli.cluster import resolve_config
    from mtpipe.coordinator.cli.main import build_parser
    from mtpipe.coordinator.cluster.config import load_cluster_config

    parser = build_parser()
    for command in (["generate"], ["serve"], ["bench", "engine"], ["launch"]):
        args = parser.parse_args([*command, "--model", "org/model", "--revision", "v2"])
        assert (args.model, args.revision) == ("org/model", "v2")
    config = tmp_path / "cluster.yaml"
    config.write_text("model: org/model\nrevision: v1\n")
    assert load_cluster_config(config).revision == "v1"
    args = parser.parse_args(["launch", "--config", str(config)])
    assert isinstance(args, argparse.Namespace) and resolve_config(args).revision == "v1"
    args = parser.parse_args(["launch", "--config", str(config), "--revision", "v3"])
    assert resolve_config(args).revision == "v3"
