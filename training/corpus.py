"""The demo model's corpus: CPython standard library sources, a fixed sorted list, every 20th held out.

Kept free of torch so that benchmarks and tests can draw held-out prompts without the training extra.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

HELD_OUT_EVERY = 20  # file i (in sorted order) is held out iff i % 20 == 19
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
# Generated codec tables: long runs of predictable data that would inflate measured acceptance.
GENERATED_MARKER = "Python Character Mapping Codec"


def stdlib_files() -> list[Path]:
    """All stdlib *.py files outside test dirs and site-packages, sorted by relative path. (The walk
    never enters the excluded directories: site-packages alone can hold tens of thousands of files.)"""
    root = Path(sysconfig.get_paths()["stdlib"])
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


def heldout_prompts(n: int, chars: int = 600) -> list[str]:
    """n prompts from held-out files: a window of source from the middle of each (deterministic)."""
    _, held = split_files(stdlib_files())
    prompts = []
    for path in held:
        text = read_text(path)
        if len(text) < 4 * chars or GENERATED_MARKER in text:
            continue
        start = text.find("\n", len(text) // 2) + 1
        prompts.append(text[start : start + chars])
        if len(prompts) == n:
            break
    return prompts
