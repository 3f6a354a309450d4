"""Shared fixtures: tiny random checkpoints in the raw HF layout, built once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test reaches the Hugging Face hub, by mistake or otherwise
# Bytecode is cached (beside the sources, in __pycache__, as Python does by default) even where the
# environment says not to (PYTHONDONTWRITEBYTECODE): each xdist worker rewrites the asserts of every
# test module, and each node process the tests spawn compiles mtpipe, from source every time otherwise.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

import mtpipe  # noqa: F401,E402  (first: the tests run on the BLAS users get, loaded before mlx.core; models/blas.py)

# isort: split
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from mtpipe.coordinator.engine.engine import Engine

# MLX, mlx-lm and transformers (with torch, which the `train` extra installs) are imported by the fixtures
# that use them, not here: xdist's controller process loads this file too, before it starts the workers,
# and runs no test.

# The files that take longest, longest first (measured with --junitxml and a start/end timeline per
# worker): each xdist worker takes whole files (--dist loadfile) in this order (--no-loadscope-reorder:
# else xdist orders files by their number of tests), and a long file handed out last keeps one worker
# busy while the others have nothing left.
LONGEST_FIRST = ("test_discovery_netns.py", "test_terms_netns.py", "test_faults.py", "test_pipeline_grpc.py",
                 "test_api_front.py", "test_ring.py", "test_sampling.py", "test_batch.py", "test_weights_netns.py", "test_ring_prefixes.py",
                 "test_prefix_cache.py", "test_identity.py", "test_bench_serve.py", "test_processors.py", "test_api.py",
                 "test_weights.py", "test_draft_vocab.py", "test_take_over.py", "test_engine.py", "test_demo_model.py",
                 "test_heal.py", "test_api_faults.py", "test_tls.py", "test_mtp_entries.py", "test_depth.py",
                 "test_mtp_window.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: each file keeps its order)


@pytest.fixture(scope="session", autouse=True)
def model_dirs_for_nodes(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Nodes read models only under their model directories (node/model_dirs.py): the tests' nodes,
    in this process or spawned, may read what the tests build in their temporary directories."""
    from mtpipe.node.model_dirs import MODEL_DIRS_ENV

    dirs = [str(tmp_path_factory.getbasetemp()), os.environ.get("MTPIPE_TEST_CACHE", "")]
    os.environ[MODEL_DIRS_ENV] = os.pathsep.join(d for d in dirs if d)


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = os.environ.get("MTPIPE_TEST_CACHE")
    return Path(root) if root else tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def dense_ckpt(tiny_root: Path) -> Path:
    from helpers import tiny_checkpoint

    return tiny_checkpoint(tiny_root, moe=False)


@pytest.fixture(scope="session")
def moe_ckpt(tiny_root: Path) -> Path:
    from helpers import tiny_checkpoint

    return tiny_checkpoint(tiny_root, moe=True)


@pytest.fixture(scope="session", params=["dense", "moe"])
def ckpt(request: pytest.FixtureRequest, dense_ckpt: Path, moe_ckpt: Path) -> Path:
    return dense_ckpt if request.param == "dense" else moe_ckpt


@pytest.fixture(scope="session")
def dense_engine(dense_ckpt: Path) -> Engine:
    import mlx.core as mx

    from mtpipe.coordinator.engine.build import local_engine

    return local_engine(dense_ckpt, dtype=mx.float32)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What exists once the tests are collected (modules, mlx-lm, transformers and torch, the items) lives
    until the end: moved out of the collector's sight, so that neither its full collections during the
    run nor pytest's at the end walk it again."""
    import gc

    gc.collect()
    gc.freeze()
