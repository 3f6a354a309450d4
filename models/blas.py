"""MLX's matrix products on Linux go to an optimized BLAS when the machine has one.

The `mlx[cpu]` wheel for Linux links the reference BLAS it bundles, whose matmul cost grows with every
row: a verify over K+1 tokens then costs K+1 decode steps, and a batch of rows gains nothing. MLX calls
`cblas_sgemm` through the dynamic linker, which binds it to the first definition in the global symbol
scope, so an optimized BLAS loaded there (RTLD_GLOBAL) before `mlx.core` is imported takes its place.
`mtpipe` does that on import. macOS is left alone: MLX uses Accelerate there.

BLIS comes first where both are installed. A decode step multiplies a few rows by each weight matrix,
and OpenBLAS (as distributions ship it) packs the whole weight matrix into a buffer on every call, which
for one row costs several times the product itself; BLIS multiplies small products without packing.
OpenBLAS is the fallback: still far ahead of the reference BLAS for verifies and batches.

`MTPIPE_BLAS` names a library to load instead, or `reference` to keep the bundled one.
`MTPIPE_BLAS_THREADS` sets the BLAS threads. By default each of the `MTPIPE_LOCAL_WORKERS` processes
computing on the machine gets half its share of the cores: MLX runs its CPU work on a stream thread of
its own and Python builds the next graph meanwhile, and BLAS threads beyond that only contend with them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENV_LIBRARY = "MTPIPE_BLAS"
ENV_THREADS = "MTPIPE_BLAS_THREADS"
ENV_WORKERS = "MTPIPE_LOCAL_WORKERS"
FIX = ("install an optimized BLAS: `sudo apt-get install libblis4-pthread` (Debian, Ubuntu), "
       "`sudo dnf install blis-threads` (Fedora), or run ./install.sh in mtpipe's checkout")
# sonames of optimized BLAS libraries with the CBLAS interface, best first (BLIS: pthreads, serial, OpenMP)
_NAMES = ("libblisp.so.4", "libblis.so.4", "libbliso.so.4", "libopenblas.so.0", "libopenblasp.so.0",
          "libopenblas64_.so.0", "libmkl_rt.so.2")
_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "BLIS_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class BlasInfo:
    """Which BLAS MLX's matrix products run on in this process."""

    name: str  # "openblas", "reference", "accelerate", ...
    path: str | None
    optimized: bool
    threads: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        where = f" ({self.path})" if self.path else ""
        threads = f", {self.threads} thread(s)" if self.threads else ""
        return f"{self.name}{where}{threads}"


_loaded: tuple[str, ctypes.CDLL] | None = None
_warned = False
_SET_HERE: set[str] = set()  # the thread variables `preload` set (not the user's)


def _search_dirs() -> list[Path]:
    arch = sysconfig.get_config_var("MULTIARCH") or ""
    variants = [Path("/usr/lib") / arch / v for v in ("blis-pthread", "blis-openmp", "openblas-pthread")]
    dirs = [*variants, Path("/usr/lib") / arch, Path("/usr/lib64"), Path("/usr/lib"), Path("/usr/local/lib")]
    return [d for d in dirs if d.is_dir()]


def find_optimized() -> str | None:
    """The path of an optimized BLAS on this machine, or None."""
    for name in _NAMES:
        for d in _search_dirs():
            if (d / name).exists():
                return str((d / name).resolve())
    return ctypes.util.find_library("blis") or ctypes.util.find_library("openblas")


def is_preferred(path: str | None) -> bool:
    """Whether `path` is the BLAS mtpipe prefers (`install.sh` installs it when another one is found)."""
    return path is not None and "blis" in Path(path).name


def default_threads() -> int:
    """Half of this process's share of the cores (the rest is MLX's stream thread and Python's)."""
    workers = _count(ENV_WORKERS) or 1
    return max(1, (os.cpu_count() or 1) // (2 * workers))


def _count(var: str) -> int | None:
    """A positive whole number from the environment; None (with a warning) for anything else, or unset."""
    value = os.environ.get(var, "").strip()
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        log.warning("%s=%r is not a positive whole number; left out", var, value)
        return None
    return n


def preload() -> None:
    """Load an optimized BLAS into the global scope, before MLX. Safe to call again; never raises."""
    global _loaded
    if _loaded is not None or not sys.platform.startswith("linux"):
        return
    wanted = os.environ.get(ENV_LIBRARY, "").strip()
    if wanted == "reference":
        return
    if "mlx.core" in sys.modules:
        log.debug("mlx.core was imported before mtpipe: its BLAS is already bound")
        return
    path = wanted or find_optimized()
    if not path:
        return
    threads = str(_count(ENV_THREADS) or default_threads())
    for var in _THREAD_VARS:
        if var not in os.environ:  # (read once, when the library initializes)
            os.environ[var] = threads
            _SET_HERE.add(var)
    try:
        _loaded = (path, ctypes.CDLL(path, mode=os.RTLD_GLOBAL))
    except OSError as e:
        log.warning("cannot load the BLAS %s: %s; MLX keeps its bundled reference BLAS", path, e)


def child_env(workers: int) -> dict[str, str]:
    """The environment for a process that runs MLX beside `workers - 1` others on this machine: its
    BLAS threads are its share of the cores, not the thread count this process set for itself (a
    count the user set is kept)."""
    env = {k: v for k, v in os.environ.items() if k not in _SET_HERE}
    env[ENV_WORKERS] = str(workers)
    return env


def _threads() -> int | None:
    if _loaded is None:
        return None
    for getter in ("openblas_get_num_threads", "bli_thread_get_num_threads"):
        fn = getattr(_loaded[1], getter, None)
        if fn is not None:
            n = int(fn())
            return n if n > 0 else None  # (BLIS: -1 when its default, one thread, holds)
    return None


def _library_of(symbol: str) -> str | None:
    """The file that defines `symbol` in the global scope, as the dynamic linker resolves it."""

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    try:
        libc = ctypes.CDLL(None)
        address = ctypes.cast(getattr(libc, symbol), ctypes.c_void_p)
    except (AttributeError, OSError):
        return None
    found = DlInfo()
    if not libc.dladdr(address, ctypes.byref(found)) or not found.dli_fname:
        return None
    return os.path.realpath(found.dli_fname.decode())


def _bundled() -> str | None:
    """The reference BLAS the mlx wheel ships, as mapped into this process."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if "mlx" in path and "/libblas" in path:
            return path
    return None


def info() -> BlasInfo:
    """Which BLAS MLX uses here. On Linux, the library that defines `cblas_sgemm` in the global scope
    (what MLX binds to), else the wheel's bundled reference BLAS."""
    if sys.platform == "darwin":
        return BlasInfo("accelerate", None, True)
    path = _library_of("cblas_sgemm")
    if path is None:
        return BlasInfo("reference", _bundled(), False)
    base = Path(path).name
    name = next((n for n in ("openblas", "blis", "mkl") if n in base), base.split(".so")[0].removeprefix("lib"))
    optimized = "mlx" not in path and name != "blas"
    return BlasInfo(name if optimized else "reference", path, optimized, _threads() if optimized else None)


def warn_if_reference() -> BlasInfo:
    """Log which BLAS MLX uses; warn once, with the fix, when it is the slow reference one."""
    global _warned
    current = info()
    if current.optimized or os.environ.get(ENV_LIBRARY, "").strip() == "reference":  # (asked for: no fix needed)
        log.info("BLAS: %s", current)
    elif not _warned:
        _warned = True
        log.warning("MLX runs on the reference BLAS (%s): verifying several tokens or rows costs as much as "
                    "that many steps. To fix: %s", current.path or "bundled", FIX)
    return current
