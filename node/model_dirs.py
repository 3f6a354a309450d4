"""Where a node may read a model from: its model directories and its shard cache, nothing else.

A Load names the model by fingerprint and carries the coordinator's path as a hint. The node follows
that hint only when it lies under one of its model directories, so whoever drives a node cannot make
it read another part of its disk. The model directories are the ones it was given (`--model-dir`,
repeatable, and `$MTPIPE_MODEL_DIRS`, separated like PATH), the bundled demo model and the Hugging
Face hub cache. A directory counts by where it really is: symbolic links and ".." are resolved first.
Inside a model directory, loading reads `config.json` and the `*.safetensors` files and nothing else.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

MODEL_DIRS_ENV = "MTPIPE_MODEL_DIRS"


def hub_cache() -> Path:
    """The Hugging Face hub cache, where `huggingface-cli download` puts models."""
    from huggingface_hub.constants import HF_HUB_CACHE

    return Path(HF_HUB_CACHE)


def env_model_dirs() -> list[Path]:
    return [Path(p).expanduser() for p in os.environ.get(MODEL_DIRS_ENV, "").split(os.pathsep) if p.strip()]


def default_model_dirs() -> list[Path]:
    """Directories every node may load from without being told: the demo model and the hub cache."""
    from ..models.registry import DEMO_MODEL

    return [DEMO_MODEL, hub_cache()]


def _real(path: Path) -> Path | None:
    try:
        return path.expanduser().resolve()
    except (OSError, RuntimeError):  # a symbolic-link loop
        return None


class ModelDirs:
    """The directories a node's Load may read, by their real location."""

    def __init__(self, given: list[Path], cache_root: Path):
        self.given = given  # the node's own list, which grows as it is given copies (weights.py)
        self.cache_root = cache_root

    @property
    def roots(self) -> list[Path]:
        return [*self.given, *default_model_dirs(), self.cache_root]

    def allows(self, path: Path | str) -> bool:
        real = _real(Path(path))
        if real is None:
            return False
        return any(r is not None and real.is_relative_to(r) for r in map(_real, self.roots))

    def describe(self) -> str:
        return ", ".join(str(r) for r in self.roots)

    def refusal(self, path: Path | str) -> str:
        """Why `path` is not read, and what the node's operator can do about it."""
        return (f"{path} is not under this node's model directories ({self.describe()}): start the node with "
                f"--model-dir {path} (or ${MODEL_DIRS_ENV}), or let it fetch its shard from a node that holds the "
                "model (--weights-from)")
