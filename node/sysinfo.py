"""Memory and chip of this machine, on macOS and Linux.

On Apple silicon a model's weights live in GPU memory, which Metal caps at a recommended working-set
size below the machine's RAM, so what a node offers a placement is bounded by that limit as well as by
the memory available. psutil cannot name the CPU, so `chip()` asks sysctl or /proc/cpuinfo.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)

WORKING_SET_KEY = "max_recommended_working_set_size"


@dataclass(frozen=True)
class MemoryInfo:
    total: int  # bytes
    available: int  # bytes a new process can take without swapping
    gpu_limit: int | None = None  # bytes Metal recommends the GPU keep resident; None without Metal


def placement_memory(available: int, gpu_limit: int | None) -> int:
    """What a placement may use: the memory available, capped by the GPU working-set limit if there is one."""
    return available if gpu_limit is None else min(available, gpu_limit)


def working_set_limit(info: Mapping[str, Any]) -> int | None:
    """The GPU working-set limit in an MLX device-info dict; None if it has none (CPU, CUDA)."""
    value = info.get(WORKING_SET_KEY)
    return int(value) if isinstance(value, int) and value > 0 else None


def parse_cpuinfo(text: str) -> str | None:
    """/proc/cpuinfo: the first 'model name' (x86) or 'Model'/'Hardware' (arm)."""
    for key in ("model name", "Model", "Hardware"):
        m = re.search(rf"^{key}\s*:\s*(.+)$", text, re.MULTILINE)
        if m:
            return m.group(1).strip()
    return None


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=10).stdout


@functools.cache
def gpu_limit() -> int | None:
    """Metal's recommended working-set size, asked of MLX once (it is fixed for the process).

    `device_info` only queries the device and evaluates no array, so any thread may call this.
    """
    try:
        import mlx.core as mx

        if not mx.metal.is_available():
            return None
        if hasattr(mx, "device_info"):
            info = mx.device_info(mx.gpu)
        else:  # MLX before device_info moved out of mx.metal
            info = mx.metal.device_info()
    except Exception as e:  # no MLX, no Metal, or an MLX without device info: no cap
        log.debug("GPU working-set limit unavailable: %s", e)
        return None
    return working_set_limit(info)


def memory() -> MemoryInfo:
    vm = psutil.virtual_memory()
    return MemoryInfo(total=vm.total, available=vm.available, gpu_limit=gpu_limit())


def chip() -> str:
    """'Apple M2 Ultra', 'AMD EPYC 7B13', ...; the machine architecture if nothing better is known."""
    try:
        if sys.platform == "darwin":
            name = _run("sysctl", "-n", "machdep.cpu.brand_string").strip()
        else:
            name = parse_cpuinfo(Path("/proc/cpuinfo").read_text()) or ""
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("chip name unavailable: %s", e)
        name = ""
    return name or platform.machine()


def system_memory(active: int | None = None) -> tuple[int, int]:
    """(used, available) bytes for the whole machine; with Metal, available is also capped by what the
    GPU working-set limit leaves: it bounds everything resident on the GPU (`active`, MLX's active
    memory, asked here when not given: a caller off the MLX thread asks it there), the weights loaded
    included, which RAM's own figure has already paid for. (0, 0) when it cannot be read."""
    try:
        info = memory()
    except (OSError, ValueError, IndexError, KeyError, subprocess.SubprocessError):
        log.debug("cannot read system memory", exc_info=True)
        return 0, 0
    if info.gpu_limit is None:
        return info.total - info.available, info.available
    resident = mlx_active_memory() if active is None else active
    gpu_room = max(0, info.gpu_limit - resident)
    return info.total - info.available, placement_memory(info.available, gpu_room)


@functools.cache
def machine_id() -> str:
    """This machine in this boot, the same for every process on it (network namespaces and containers
    share its kernel, so they share it too). Asked once, when a node starts (macOS answers by a command)."""
    return machine_of(sys.platform)


def machine_of(system: str) -> str:
    """`machine_id` on `system` (sys.platform): Linux's boot id, macOS's boot session, else the host's name
    and the second it booted."""
    seed = ""
    try:
        if system == "darwin":
            seed = _run("/usr/sbin/sysctl", "-n", "kern.bootsessionuuid").strip()
        else:
            seed = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("no boot id: %s", e)
    if not seed:
        seed = f"{platform.node()}|{int(psutil.boot_time())}"
    return hashlib.sha256(seed.encode()).hexdigest()[:16]


def sharing(machines: list[str]) -> list[int]:
    """For each node's `machine_id` (as Health says it), how many of these nodes run on that machine and
    share what it has free (1 for a node that does not say)."""
    counts: dict[str, int] = {}
    for m in machines:
        counts[m] = counts.get(m, 0) + 1
    return [counts[m] if m else 1 for m in machines]


def memory_offered(h: Any, sharing: int = 1) -> int:
    """What a node's Health (`h`) says it offers for its weights and caches: its share of what its machine
    has free (shared with the `sharing` nodes on it) and its own shard (a new one replaces it), within
    what a launched node offers (its cap)."""
    share = h.memory_available // sharing + h.parameter_bytes
    return min(share, h.memory_offered) if h.memory_offered else share


def mlx_active_memory() -> int:
    try:
        import mlx.core as mx

        return int(mx.get_active_memory())
    except Exception:
        return 0
