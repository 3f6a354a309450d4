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


def test_unknown_local_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        registry.resolve_model(str(tmp_path / "nope"))
