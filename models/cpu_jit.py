"""MLX's CPU kernels for compiled functions, built for today's x86-64 vector units on Linux.

On the CPU, MLX turns each compiled function's fused elementwise graph into C++ and builds it at run
time with `g++ -O3` (the first `g++` on PATH), for the baseline x86-64: no AVX and no FMA, so its loops
run one float at a time and each `fma` is a call into libm. Where this CPU has them (x86-64-v3: AVX2,
FMA), mtpipe puts a `g++` of its own first on PATH that builds MLX's kernels, and only those (their
sources are under `$TMPDIR/mlx/.../cpu/`), with `-march=x86-64-v3 -ffp-contract=off`; every other
build goes to the real compiler as it was asked. The second flag keeps every result bit for bit as it
was (the compiler fuses no multiply and add the source does not), so a compiled layer still equals the
uncompiled one. A level, not `-march=native`: MLX reuses a kernel it finds built, so a kernel cache
that moves to another machine (an image, a shared TMPDIR) still runs on any x86-64-v3 CPU.

The wrapper lives in this user's cache directory, every directory above it checked to be this user's
(or root's) and writable by no one else: whoever could write there could run code as this user. Node
processes this one starts find it again (they inherit PATH). Kernels built before stay as built until
`$TMPDIR/mlx` is cleared. `MTPIPE_CPU_JIT=plain` leaves MLX's own build alone. Only on x86-64 Linux:
elsewhere (macOS computes on the GPU; aarch64 compilers fuse multiply-adds by default, so bit identity
would need checking there first) nothing changes.
"""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

ENV = "MTPIPE_CPU_JIT"
FLAGS = ("-march=x86-64-v3", "-ffp-contract=off")
NEEDS = {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "xsave"}  # x86-64-v3's, as /proc/cpuinfo names them
COMPILER = "g++"  # what MLX's CPU backend runs (mlx/backend/cpu/jit_compiler.cpp)
LAUNCHERS = {"ccache", "sccache", "distcc", "icecc"}  # a `g++` that runs the next `g++` on PATH: ours, again

_state: str | None = None  # "x86-64-v3", "plain", or "plain (why)"


def wrapper_dir() -> Path | None:
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # (unset, or relative: ignored, as the XDG spec says)
        home = os.environ.get("HOME", "")
        if not os.path.isabs(home):
            return None
        base = os.path.join(home, ".cache")
    return Path(base) / "mtpipe" / "cpu-jit"


def setup() -> str:
    """Put the wrapper first on PATH, before MLX builds any kernel; safe to call again, never raises.
    Returns what MLX's kernels are built for: "x86-64-v3", or "plain" (with why, where it could not be)."""
    global _state
    if _state is None:
        try:
            _state = _setup()
        except Exception as e:  # noqa: BLE001 - `import mtpipe` must not fail for this
            _state = f"plain ({type(e).__name__}: {e})"
    return _state


def info() -> str:
    return _state or "plain"


def _setup() -> str:
    directory = wrapper_dir()
    if os.environ.get(ENV, "native").strip().lower() == "plain":
        if directory is not None:  # (a process started by one that set it up: its PATH has it)
            os.environ["PATH"] = os.pathsep.join(p for p in _path() if p != str(directory))
        return "plain"
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return "plain"
    if not NEEDS <= _cpu_flags():
        return "plain (this CPU is not x86-64-v3)"
    if directory is None:
        return "plain (no home directory)"
    compiler = _real_compiler(directory)
    if compiler is None:
        return f"plain (no {COMPILER} on PATH)"
    for d in reversed([directory, *directory.parents]):  # (each level made private: not only the last)
        if not d.exists():
            d.mkdir(mode=0o700)
    if not _private(directory):
        return f"plain ({directory} or a directory above it may be written by others)"
    if not _write_wrapper(directory, compiler):
        return f"plain ({compiler} does not take {' '.join(FLAGS)})"
    os.environ["PATH"] = os.pathsep.join([str(directory), *(p for p in _path() if p != str(directory))])
    return "x86-64-v3"


def _path() -> list[str]:
    return os.environ.get("PATH", "").split(os.pathsep)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _real_compiler(skip: Path) -> str | None:
    """The first `g++` on PATH that is a compiler: not ours (a process started by one that set this up
    has ours first), not a launcher that would run ours in turn, not in a relative directory."""
    for entry in _path():
        if not os.path.isabs(entry) or os.path.realpath(entry) == os.path.realpath(skip):
            continue
        found = shutil.which(COMPILER, path=entry)
        if found and Path(os.path.realpath(found)).name not in LAUNCHERS:
            return found
    return None


def _private(directory: Path) -> bool:
    """`directory` and every one above it are this user's or root's, and no one else may write to them
    (a sticky directory such as /tmp aside, for those above)."""
    me = os.getuid()
    for i, d in enumerate([directory, *directory.parents]):
        info = d.stat()
        if info.st_uid not in (me, 0):
            return False
        shared = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if shared and (i == 0 or not info.st_mode & stat.S_ISVTX):
            return False
    return True


def _write_wrapper(directory: Path, compiler: str) -> bool:
    """The wrapper (MLX's kernels with FLAGS, anything else as asked), written once: a compiler that
    refuses the flags gets none."""
    real, flags = shlex.quote(compiler), " ".join(FLAGS)
    script = (f"#!/bin/sh\n# mtpipe (models/cpu_jit.py): MLX's CPU kernels for x86-64-v3, bit for bit\n"
              f"case \"$*\" in */mlx/*/cpu/*) exec {real} {flags} \"$@\" ;; esac\nexec {real} \"$@\"\n")
    target = directory / COMPILER
    if target.is_file() and target.read_text() == script:
        return True
    probe = subprocess.run([compiler, *FLAGS, "-x", "c++", "-fsyntax-only", os.devnull], capture_output=True,
                           timeout=60, check=False)
    if probe.returncode != 0:
        return False
    tmp = directory / f".{COMPILER}.{os.getpid()}.{os.urandom(4).hex()}"
    tmp.write_text(script)
    tmp.chmod(0o700)
    tmp.replace(target)  # (atomic: a process starting beside this one never runs half a script)
    return True
