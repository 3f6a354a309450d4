"""Which threads of this process call into MLX: `record_mlx_threads()`, a test helper.

MLX streams belong to threads, so a process must do all its MLX work on one thread. Tests check that
by recording, for every call into MLX, the thread that made it.

Why not a profile hook: `sys.setprofile` / `threading.setprofile` report 'c_call' only for CPython's
own builtin functions and method descriptors, and MLX's functions and methods are nanobind objects
(`nb_func`, `nb_method`) that raise no such event (checked on MLX 0.32). So, while recording, the
helper puts a thin recording wrapper in place of:

- every function of `mlx.core` and its submodules (`mx.eval`, `mx.fast.rms_norm`, `mx.random...`),
- every method of `mx.array` (operators included: `a + b`, `a.item()`, `a.tolist()`, `a.view()`) and
  its computing properties (`a.T`, `a.at`...); metadata (`shape`, `dtype`, `nbytes`) is not recorded,
- `mx.array` itself, by a stand-in class whose calls record and whose isinstance/issubclass checks
  answer for the real one (nanobind builds arrays without looking `__init__` up, so patching that
  would not see `mx.array(...)`).

Everything is restored on exit. Unlike a profile hook this sees every thread, also those started
before recording began. Not seen: calls through references taken before recording (`f = mx.eval` at
import time) and the inside of `mx.compile`d functions, which always come with other, seen calls.
A wrapped call costs a dict lookup and a counter increment on top of the call itself.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

_SUBMODULES = ("fast", "fft", "linalg", "random", "metal", "cuda", "distributed")
_METADATA = frozenset({"size", "ndim", "itemsize", "nbytes", "shape", "dtype"})
_lock = threading.Lock()
_active: MLXCalls | None = None


@dataclass
class MLXCalls:
    """What was recorded: per thread, how often each MLX function was called."""

    by_ident: dict[int, Counter[str]] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)  # thread ident -> its name at its first call

    def record(self, label: str) -> None:
        ident = threading.get_ident()
        calls = self.by_ident.get(ident)
        if calls is None:  # first call from this thread; only it ever writes its own counter
            self.names[ident] = threading.current_thread().name
            calls = self.by_ident.setdefault(ident, Counter())
        calls[label] += 1

    @property
    def threads(self) -> set[str]:
        """Names of the threads that called into MLX."""
        return set(self.names.values())

    @property
    def calls_by_thread(self) -> dict[str, Counter[str]]:
        """Calls per thread name (threads of the same name are merged)."""
        out: dict[str, Counter[str]] = {}
        for ident, calls in list(self.by_ident.items()):
            out.setdefault(self.names[ident], Counter()).update(calls)
        return out

    def idents(self, name: str) -> set[int]:
        """The distinct threads of that name that called into MLX."""
        return {i for i, n in self.names.items() if n == name}


def _wrap(fn: Callable, label: str, calls: MLXCalls) -> Callable:
    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.record(label)
        return fn(*args, **kwargs)

    recorded.__name__ = recorded.__qualname__ = label.rpartition(".")[2]
    recorded.__doc__ = getattr(fn, "__doc__", None)
    return recorded


def _array_stand_in(real: type, calls: MLXCalls) -> type:
    """A class that builds real arrays when called and is the real class to isinstance/issubclass."""

    class Meta(type):
        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            calls.record("array")
            return real(*args, **kwargs)

        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, real)

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, real)

        def __getattr__(cls, name: str) -> Any:  # mx.array.__add__, mx.array.shape...
            return getattr(real, name)

    return Meta("array", (), {"__module__": real.__module__, "__doc__": real.__doc__})


def _install(calls: MLXCalls, saved: list[tuple[Any, str, Any]]) -> None:
    """Put recording wrappers in place, each (owner, name, original) into `saved` to restore."""
    modules = [("", mx)] + [(f"{m}.", getattr(mx, m)) for m in _SUBMODULES if hasattr(mx, m)]
    for prefix, module in modules:
        for name, value in list(vars(module).items()):
            if type(value).__name__ == "nb_func":
                saved.append((module, name, value))
                setattr(module, name, _wrap(value, prefix + name, calls))
    real = mx.array
    for name, value in list(vars(real).items()):
        if type(value).__name__ == "nb_method" and name != "__init__":  # __init__ is never looked up
            wrapped: Any = _wrap(value, f"array.{name}", calls)
        elif isinstance(value, property) and name not in _METADATA:
            wrapped = property(_wrap(value.fget, f"array.{name}", calls))
        else:
            continue
        saved.append((real, name, value))
        setattr(real, name, wrapped)
    saved.append((mx, "array", real))
    mx.array = _array_stand_in(real, calls)


@contextmanager
def record_mlx_threads() -> Iterator[MLXCalls]:
    """Record, until the block ends, which threads call into MLX and what they call. Not nestable."""
    global _active
    calls = MLXCalls()
    with _lock:
        if _active is not None:
            raise RuntimeError("record_mlx_threads() is already recording")
        _active = calls
    saved: list[tuple[Any, str, Any]] = []
    try:
        _install(calls, saved)
        yield calls
    finally:
        with _lock:
            for owner, name, original in reversed(saved):
                setattr(owner, name, original)
            _active = None
