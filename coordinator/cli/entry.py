"""The `mtpipe` executable: the command line, in a process that never loads PyTorch, and node
processes that never load transformers."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from typing import Any


def defer_package_init(name: str) -> None:
    """Make `name`'s submodules importable without running its `__init__`, which then runs on the
    first attribute asked of the package itself (`from name import x`, `name.x`).

    mlx-lm's `__init__` imports its converter and tokenizer utilities, hence transformers: over a
    second of a node's start, while a node only needs `mlx_lm.models`. If the deferred init fails,
    the error is raised and the next attribute asked runs it again.
    """
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return
    package = importlib.util.module_from_spec(spec)
    lock = threading.Lock()
    state: dict[str, Any] = {"done": False, "running": None}  # running: the thread running the init

    def __getattr__(attr: str) -> Any:
        if state["running"] != threading.get_ident():  # (the init's own lookups must not wait for it)
            with lock:  # another thread waits for the init this one runs
                if not state["done"]:
                    state["running"] = threading.get_ident()
                    try:
                        spec.loader.exec_module(package)  # type: ignore[union-attr]
                        state["done"] = True
                    finally:
                        state["running"] = None
            if attr in package.__dict__:
                return package.__dict__[attr]
        raise AttributeError(f"module {name!r} has no attribute {attr!r}")

    package.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules[name] = package


DEFERRING = ("node", "launch", "health", "cache")  # commands that may never need mlx-lm's tokenizer utilities


def main() -> int:
    """Run the command line, with torch marked absent first, and for the commands that may need no
    tokenizer (`DEFERRING`) mlx-lm's package init deferred.

    mtpipe computes with MLX only, but importing mlx-lm (its tokenizer utilities) makes transformers
    import torch whenever it is installed, as the `train` extra does: about 1.5 s and 180 MB in every
    process for nothing. A `None` entry in `sys.modules` makes transformers find no torch and take its
    torch-free paths. A node needs no tokenizer: deferring mlx-lm's init keeps transformers out of it
    altogether. A launch needs one only where it ends up coordinating, so it loads transformers then,
    and a launch that ends up a node never does; `health` and `cache` read nodes and files only
    (other commands load a tokenizer at once anyway). A library user's process is left alone.
    """
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
    if next((a for a in sys.argv[1:] if not a.startswith("-")), None) in DEFERRING:
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # as mlx-lm's own init sets it
        defer_package_init("mlx_lm")
    from .main import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
