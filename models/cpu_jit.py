"""MLX's CPU kernels for compiled functions, built for this machine's vector units on Linux.

On the CPU, MLX turns each compiled function's fused elementwise graph into C++ and builds it at run
time with `g++ -O3`, the first `g++` on PATH, for the baseline target: on x86-64 no AVX and no FMA, so
its loops run one float at a time and each `fma` is a call into libm. mtpipe puts a `g++` of its own
first on PATH that runs the real one with `-march=native`: the same source then uses this CPU's
vector instructions. `-ffp-contract=off` keeps every result bit for bit as it was (the compiler fuses
no multiply and add the source does not), so a compiled layer still equals the uncompiled one.

The wrapper lives in this user's cache directory (never a shared temporary one: whoever could write
there could run code as this user), made once, and found again by the node processes this one starts
(they inherit PATH). MLX keeps kernels it built under `$TMPDIR/mlx` and builds each only once, so
kernels built before (without it) stay as they were until that directory is cleared.
`MTPIPE_CPU_JIT=plain` leaves MLX's own build alone. macOS is left alone: MLX computes on the GPU there.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import stat
import sys
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "MTPIPE_CPU_JIT"
FLAGS = ("-march=native", "-ffp-contract=off")
COMPILER = "g++"  # what MLX's CPU backend runs (mlx/backend/cpu/jit_compiler.cpp)

_state: str | None = None  # "native", "plain", or why not


def wrapper_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mtpipe" / "cpu-jit"


def _real_compiler(skip: Path) -> str | None:
    """The first `g++` on PATH that is not ours (a process started by one that set this up has ours first)."""
    dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and Path(d).resolve() != skip.resolve()]
    return shutil.which(COMPILER, path=os.pathsep.join(dirs))


def _owned_by_me(path: Path) -> bool:
    info = path.stat()
    return info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _write_wrapper(directory: Path, compiler: str) -> None:
    script = f"#!/bin/sh\nexec {shlex.quote(compiler)} {' '.join(FLAGS)} \"$@\"\n"
    target = directory / COMPILER
    if target.is_file() and target.read_text() == script and _owned_by_me(target):
        return
    tmp = directory / f".{COMPILER}.{os.getpid()}"
    tmp.write_text(script)
    tmp.chmod(0o755)
    tmp.replace(target)  # (atomic: a process starting beside this one never runs half a script)


def setup() -> str:
    """Put the wrapper first on PATH, before MLX builds any kernel; safe to call again, never raises.
    Returns what MLX's kernels are built for: "native", "plain", or why not."""
    global _state
    if _state is not None:
        return _state
    if not sys.platform.startswith("linux"):
        _state = "plain"
    elif os.environ.get(ENV, "native").strip().lower() == "plain":
        _state = "plain"
    else:
        _state = _install()
    return _state


def _install() -> str:
    directory = wrapper_dir()
    compiler = _real_compiler(directory)
    if compiler is None:
        return f"plain (no {COMPILER} on PATH)"
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not _owned_by_me(directory):
            return f"plain ({directory} is writable by others)"
        _write_wrapper(directory, compiler)
    except OSError as e:
        log.debug("cannot set up the CPU kernels' compiler wrapper in %s: %s", directory, e)
        return f"plain ({e.strerror or e})"
    entries = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and d != str(directory)]
    os.environ["PATH"] = os.pathsep.join([str(directory), *entries])
    return "native"


def info() -> str:
    return _state or "plain"
