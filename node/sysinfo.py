"""Memory and chip of this machine, on macOS and Linux, without psutil.

Linux reads /proc/meminfo and /proc/cpuinfo; macOS asks `sysctl hw.memsize`, `vm_stat` and
`sysctl -n machdep.cpu.brand_string`. Parsers are plain functions over command output, so they are
tested on recorded output.
"""

from __future__ import annotations

import logging
import platform
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryInfo:
    total: int  # bytes
    available: int  # bytes a new process can take without swapping


def parse_meminfo(text: str) -> MemoryInfo:
    """/proc/meminfo: MemTotal and MemAvailable (kB)."""
    values = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+):\s+(\d+)\s*kB", line)
        if m:
            values[m.group(1)] = int(m.group(2)) * 1024
    if "MemTotal" not in values:
        raise ValueError("no MemTotal in /proc/meminfo")
    available = values.get("MemAvailable")
    if available is None:  # kernels before 3.14
        available = values.get("MemFree", 0) + values.get("Cached", 0) + values.get("Buffers", 0)
    return MemoryInfo(total=values["MemTotal"], available=available)


def parse_vm_stat(text: str, total: int) -> MemoryInfo:
    """macOS `vm_stat`: free, inactive and speculative pages are available (psutil counts free + inactive)."""
    m = re.search(r"page size of (\d+) bytes", text)
    if not m:
        raise ValueError("vm_stat output has no page size")
    page = int(m.group(1))
    pages = {k.strip().lower(): int(v) for k, v in re.findall(r"^([A-Za-z][\w \-\"]*?):\s+(\d+)\.?$", text, re.MULTILINE)}
    wanted = ("pages free", "pages inactive", "pages speculative")
    if "pages free" not in pages:
        raise ValueError("vm_stat output has no 'Pages free'")
    available = sum(pages.get(k, 0) for k in wanted) * page
    return MemoryInfo(total=total, available=min(available, total))


def parse_cpuinfo(text: str) -> str | None:
    """/proc/cpuinfo: the first 'model name' (x86) or 'Model'/'Hardware' (arm)."""
    for key in ("model name", "Model", "Hardware"):
        m = re.search(rf"^{key}\s*:\s*(.+)$", text, re.MULTILINE)
        if m:
            return m.group(1).strip()
    return None


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=10).stdout


def memory() -> MemoryInfo:
    if sys.platform == "darwin":
        total = int(_run("sysctl", "-n", "hw.memsize").strip())
        return parse_vm_stat(_run("vm_stat"), total)
    return parse_meminfo(Path("/proc/meminfo").read_text())


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
