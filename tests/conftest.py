"""Shared fixtures: tiny random checkpoints in the raw HF layout, built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import pytest

from mtpipe.coordinator.engine.build import local_engine
from mtpipe.coordinator.engine.engine import Engine
from mtpipe.models.tiny import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = os.environ.get("MTPIPE_TEST_CACHE")
    return Path(root) if root else tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def dense_ckpt(tiny_root: Path) -> Path:
    return build_tiny_checkpoint(moe=False, root=tiny_root)


@pytest.fixture(scope="session")
def moe_ckpt(tiny_root: Path) -> Path:
    return build_tiny_checkpoint(moe=True, root=tiny_root)


@pytest.fixture(scope="session", params=["dense", "moe"])
def ckpt(request: pytest.FixtureRequest, dense_ckpt: Path, moe_ckpt: Path) -> Path:
    return dense_ckpt if request.param == "dense" else moe_ckpt


@pytest.fixture(scope="session")
def dense_engine(dense_ckpt: Path) -> Engine:
    return local_engine(dense_ckpt, dtype=mx.float32)
