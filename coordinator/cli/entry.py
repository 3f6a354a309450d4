"""The `mtpipe` executable: the command line, in a process that never loads PyTorch and loads
transformers only when it needs a tokenizer."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any


def defer_package_init(name: str) -> None:
    """Make `name`'s submodules importable without running its `__init__`, which then runs on the
    first attribute asked of the package itself (`from name import x`, `name.x`).

    mlx-lm's `__init__` imports its converter and tokenizer utilities, hence transformers: over a
    second of a node's start, while a node only needs `mlx_lm.models`.
    """
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return
    package = importlib.util.module_from_spec(spec)
    pending = [True]

    def __getattr__(attr: str) -> Any:
        if not pending:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        pending.clear()
        del package.__dict__["__getattr__"]
        spec.loader.exec_module(package)  # type: ignore[union-attr]
        return getattr(package, attr)

    package.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules[name] = package


def main() -> int:
    """Run the command line, with torch marked absent and mlx-lm's package init deferred first.

    mtpipe computes with MLX only, but importing mlx-lm (its tokenizer utilities) makes transformers
    import torch whenever it is installed, as the `train` extra does: about 1.5 s and 180 MB in every
    process for nothing. A `None` entry in `sys.modules` makes transformers find no torch and take its
    torch-free paths. Deferring mlx-lm's init keeps transformers out of node processes altogether
    (they need no tokenizer). A library user's process is left alone.
    """
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # as mlx-lm's own init sets it
    defer_package_init("mlx_lm")
    from .main import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
