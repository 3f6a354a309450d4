"""Starting `mtpipe node` as a child process that never outlives its parent (benchmarks, tests, tools)."""

from __future__ import annotations

import sys

# Run in the child right after exec: on Linux the kernel kills it if its parent dies first
# (PR_SET_PDEATHSIG). Not a preexec_fn: that forces a plain fork(), which runs gRPC's fork handlers
# in the child while the parent has gRPC threads, and can abort the child before exec (SIGABRT).
_DIE_WITH_PARENT = (
    "import ctypes, runpy, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
    "runpy.run_module('mtpipe', run_name='__main__', alter_sys=True)\n"
)


def node_command(*args: str) -> list[str]:
    """The command line of an `mtpipe node` child process that does not outlive this one."""
    return [sys.executable, "-c", _DIE_WITH_PARENT, "node", *args]
