"""A package whose `__init__` runs only when something asks the package itself for a name.

The `mtpipe` command and the API's own process use it for mlx-lm, whose init imports its generation
and conversion code (and transformers): seconds and memory for processes that need only its model
files or its tokenizer utilities.
"""

from __future__ import annotations

import importlib.util
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
