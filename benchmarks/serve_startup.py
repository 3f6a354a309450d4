"""Seconds from starting `mtpipe serve` to its first `/health` 200, for one or more copies of the code.

usage: python benchmarks/serve_startup.py MODEL REPS [PYTHONPATH ...]

Each PYTHONPATH entry ("" for the installed package) is run in turn, REPS rounds, alternating, so that
the machine's noise falls on each alike. A copy of the code before a change: `git worktree add --detach
/tmp/old REV`, then a directory holding a link `mtpipe -> /tmp/old`, given here as its PYTHONPATH.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def startup_seconds(model: str, pythonpath: str) -> float:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else dict(os.environ)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "mtpipe", "serve", "--model", model, "--port", str(port),
                             "--dtype", "float32"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        while proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - start
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"mtpipe serve ended with {proc.returncode} before it served")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)


def main() -> None:
    model, reps, paths = sys.argv[1], int(sys.argv[2]), sys.argv[3:] or [""]
    times: dict[str, list[float]] = {p: [] for p in paths}
    for _ in range(reps):
        for p in paths:
            times[p].append(startup_seconds(model, p))
    for p, ts in times.items():
        print(f"{p or 'installed'}: " + " ".join(f"{t:.2f}" for t in ts) + f"  (median {statistics.median(ts):.2f} s)")


if __name__ == "__main__":
    main()
