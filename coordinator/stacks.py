"""Every thread's stack on stderr when a process of mtpipe's gets SIGUSR1 (`kill -USR1 <pid>`): what a
process that seems stuck is doing, without a debugger."""

from __future__ import annotations

import faulthandler
import signal


def dump_stacks_on_sigusr1() -> None:
    """Where there is a SIGUSR1 and a stderr with a file descriptor (else nothing: a process embedded
    elsewhere keeps its own)."""
    if not hasattr(signal, "SIGUSR1"):
        return
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (AttributeError, ValueError, OSError, RuntimeError):  # (no usable sys.stderr, or not the main thread)
        pass
