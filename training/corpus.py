"""The demo model's corpus: CPython standard library sources, a fixed sorted list, every 20th held out.

Which files are held out depends on the standard library's file list, so it differs between Python
versions: the files held out of a model's training are named in its `heldout.json`, and prompts said
to be held out are drawn from those files only (under another Python than the model's, a file by the
split's count could be one the model was trained on).

Kept free of torch so that benchmarks and tests can draw held-out prompts without the training extra.
"""

from __future__ import annotations

import json
import logging
import os
import sysconfig
from pathlib import Path

log = logging.getLogger(__name__)

HELD_OUT_EVERY = 20  # file i (in sorted order) is held out iff i % 20 == 19
MANIFEST = "heldout.json"  # in a model directory: {"python": version, "held": [paths relative to the stdlib]}
DEMO_MODEL = Path(__file__).resolve().parent.parent / "models" / "demo"  # (models/registry.py's DEMO_MODEL)
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
# Generated codec tables: long runs of predictable data that would inflate measured acceptance.
GENERATED_MARKER = "Python Character Mapping Codec"


def stdlib_files() -> list[Path]:
    """All stdlib *.py files outside test dirs and site-packages, sorted by relative path. (The walk
    never enters the excluded directories: site-packages alone can hold tens of thousands of files.)"""
    root = stdlib_root()
    files = []
    for top, dirs, names in os.walk(root):
        rel_top = Path(top).relative_to(root)
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS and not (top == str(root) and d.startswith("config-"))]
        for name in names:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):  # (build-machine specific)
                files.append(rel_top / name)
    return [root / rel for rel in sorted(files, key=lambda p: p.as_posix())]


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    train = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    held = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    return train, held


def read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def held_out_files(model_dir: Path = DEMO_MODEL) -> list[Path]:
    """This Python's files that `model_dir`'s model was not trained on: those its manifest names (the
    ones this Python has), else this Python's own split (a model trained here)."""
    files = stdlib_files()
    manifest = model_dir / MANIFEST
    if not manifest.is_file():
        log.warning("%s has no %s: its held-out files are taken to be this Python's split", model_dir, MANIFEST)
        return split_files(files)[1]
    held = set(json.loads(manifest.read_text())["held"])
    root = stdlib_root()
    return [f for f in files if f.relative_to(root).as_posix() in held]


def heldout_prompts(n: int, chars: int = 600, model_dir: Path = DEMO_MODEL) -> list[str]:
    """n prompts from files held out of `model_dir`'s training: a window of source from the middle of
    each (deterministic). Fewer such files than n is an error, not fewer prompts."""
    prompts = []
    for path in held_out_files(model_dir):
        text = read_text(path)
        if len(text) < 4 * chars or GENERATED_MARKER in text:
            continue
        start = text.find("\n", len(text) // 2) + 1
        prompts.append(text[start : start + chars])
        if len(prompts) == n:
            return prompts
    raise ValueError(f"only {len(prompts)} held-out files of {4 * chars} characters or more, for {n} prompts")
