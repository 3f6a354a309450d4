"""`mtpipe node` processes for benchmarks and fault tests: on 127.0.0.1, each can be frozen, killed
and started again on its address."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Self

from ...models import blas
from ...node.spawn import node_command
from ..pipeline.nodes import wait_for_nodes

BENCH_SECRET = "mtpipe-bench-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NodeProcesses:
    """n `mtpipe node` processes on 127.0.0.1, answering once constructed; each can be frozen, killed
    and started again on its address (bench faults, tests/test_faults.py). `model_dirs`: what they
    may load (`mtpipe node --model-dir`)."""

    def __init__(self, n: int, data_plane: str = "tcp", secret: str | None = None,
                 model_dirs: Sequence[Path | str] = ()):
        self.addresses = [f"127.0.0.1:{free_port()}" for _ in range(n)]
        self.data_plane = data_plane
        self.model_dirs = [str(d) for d in model_dirs]
        self.env = blas.child_env(n)  # the nodes share this machine's cores
        self.env.pop("MTPIPE_SECRET", None)
        if secret:
            self.env["MTPIPE_SECRET"] = secret
        self.procs: list[subprocess.Popen] = []
        try:
            for i in range(n):
                self.procs.append(self._spawn(i))
            wait_for_nodes(self.addresses, timeout=180, secret=secret)
        except BaseException:
            self.close()
            raise

    def _spawn(self, i: int) -> subprocess.Popen:
        port = self.addresses[i].rsplit(":", 1)[1]
        cmd = node_command("--host", "127.0.0.1", "--port", port, "--data-plane", self.data_plane,
                           *(a for d in self.model_dirs for a in ("--model-dir", d)))
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env)

    def start(self, i: int) -> None:
        """Node i again, on its address (after `kill`)."""
        self.procs[i] = self._spawn(i)

    def kill(self, i: int) -> None:
        self.procs[i].kill()
        self.procs[i].wait()

    def freeze(self, i: int, seconds: float) -> None:
        os.kill(self.procs[i].pid, signal.SIGSTOP)
        time.sleep(seconds)
        os.kill(self.procs[i].pid, signal.SIGCONT)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)  # a frozen process dies only once it runs
                p.kill()
            p.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def spawn_nodes(n: int, model: Path | str, data_plane: str = "tcp", secret: str | None = None) -> Iterator[list[str]]:
    """n `mtpipe node` processes on 127.0.0.1 that may load `model`; killed on exit."""
    with NodeProcesses(n, data_plane, secret, model_dirs=[model]) as nodes:
        yield nodes.addresses
