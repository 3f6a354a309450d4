"""`mtpipe bench transfer`: a shard transfer between two network namespaces against a raw TCP copy.

Two namespaces joined by a veth pair (10.79.0.1 <-> 10.79.0.2; nothing touches this machine's own
interfaces). Namespace A runs a node holding the model (`--model-dir`). Namespace B runs the
measuring worker (this module with `--worker`), which for every repeat:
  1. starts a node with an empty shard cache, in a mount namespace where the model directory is
     hidden under an empty tmpfs (the node cannot take the coordinator's path as a local copy), and
     loads the whole model on it with A as the source: a cold load, which fetches every tensor;
  2. starts a node again on the same cache and loads the same shard: a warm load, from the cache;
  3. copies the same number of bytes from A to B over the same link with plain sockets.
The transfer time is the median cold Load's time minus the median warm one's: both fingerprint,
verify every tensor hash once and build the stage; what the cold one does in addition is the
transfer itself (gRPC stream, writes into the part file). The whole cold Load's throughput is
reported too, and the raw copy's median time; and the raw copy again written into a new file beside
the shard cache, which is what the disk adds (a transfer writes the shard to disk; the raw copy does not).
Time to first token is from the Load request to the first generated token, cold and warm.
Needs root (`ip netns`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PREFIX = "mtpb"  # namespaces mtpb<pid>-a / -b
NET = "10.79.0"
RAW_PORT = 52799
START_TIMEOUT = 120.0
PROMPT = "The quick brown fox"

# The raw TCP sender (namespace A): for each connection, reads a byte count and sends that many bytes.
SENDER = r"""
import socket, struct, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])), reuse_port=False)
buf = memoryview(bytes(4 << 20))
print("ready", flush=True)
while True:
    conn, _ = srv.accept()
    with conn:
        n = struct.unpack("<Q", conn.recv(8, socket.MSG_WAITALL))[0]
        while n:
            k = min(n, len(buf))
            conn.sendall(buf[:k])
            n -= k
        conn.recv(1)
"""


def netns_problem() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    if os.geteuid() != 0:
        return "mtpipe bench transfer needs root (it creates network namespaces)"
    if shutil.which("ip") is None:
        return "mtpipe bench transfer needs iproute2 (`ip`)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` does not work here: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class VethPair:
    """Namespaces a and b joined by one veth link."""

    def __init__(self) -> None:
        tag = f"{PREFIX}{os.getpid()}"
        self.ns = {"a": f"{tag}-a", "b": f"{tag}-b"}
        self.created: list[str] = []

    def __enter__(self) -> VethPair:  # noqa: PYI034
        try:
            for ns in self.ns.values():
                _ip("netns", "add", ns)
                self.created.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.ns["a"], "link", "add", "veth0", "type", "veth", "peer", "name", "veth0",
                "netns", self.ns["b"])
            for i, ns in enumerate(self.ns.values(), 1):
                _ip("-n", ns, "addr", "add", f"{NET}.{i}/24", "dev", "veth0")
                _ip("-n", ns, "link", "set", "veth0", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in reversed(self.created):
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)
        self.created = []

    def argv(self, side: str, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side], *cmd]


def _start_node(argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, dict[str, Any]]:
    """A node process and its ready line (`--json`)."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    line = p.stdout.readline() if p.stdout else ""
    if not line.startswith("{"):
        p.kill()
        raise RuntimeError(f"node did not start ({' '.join(argv[-6:])}): exit {p.wait()}")
    return p, json.loads(line)


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _hidden(model: Path, argv: list[str]) -> list[str]:
    """`argv` in a mount namespace of its own where `model` is an empty directory."""
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"',
            str(model), *argv]


def bench_transfer(model: Path, repeat: int = 3) -> dict[str, Any]:
    problem = netns_problem()
    if problem:
        raise RuntimeError(problem)
    from ...node.spawn import node_command

    model = Path(model).resolve()
    secret = secrets.token_hex(8)
    env = {**os.environ, "MTPIPE_SECRET": secret}
    env.pop("MTPIPE_SHARD_CACHE", None)
    with VethPair() as link, tempfile.TemporaryDirectory(prefix="mtpipe-bench-transfer-") as tmp:
        holder, ready = _start_node(link.argv("a", *node_command(
            "--host", f"{NET}.1", "--port", "0", "--model-dir", str(model), "--shard-cache", f"{tmp}/holder",
            "--json")), env)
        sender = subprocess.Popen(link.argv("a", sys.executable, "-c", SENDER, f"{NET}.1", str(RAW_PORT)),
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            if not sender.stdout or sender.stdout.readline().strip() != "ready":
                raise RuntimeError("the raw TCP sender did not start")
            spec = {"model": str(model), "source": ready["address"], "raw": f"{NET}.1:{RAW_PORT}",
                    "repeat": repeat, "tmp": tmp, "secret": secret}
            r = subprocess.run(link.argv("b", sys.executable, "-m", __name__, "--worker", json.dumps(spec)), check=False,
                               capture_output=True, text=True, env=env, timeout=START_TIMEOUT * 4 * repeat)
            if r.returncode != 0 or not r.stdout.strip():
                raise RuntimeError(f"the worker in namespace b failed ({r.returncode}):\n{r.stderr[-3000:]}")
            result = json.loads(r.stdout.strip().splitlines()[-1])
        finally:
            _stop(sender)
            _stop(holder)
    result["model"] = str(model)
    result["link"] = "veth between two network namespaces"
    return result


# -- the worker, in namespace b ---------------------------------------------------------------------


def _load(model: Path, address: str, source: str, secret: str) -> dict[str, Any]:
    """Load the whole model on the node at `address` (fetching from `source` if it must) and generate
    one token: Load seconds, time to first token, fetched bytes, where the weights came from."""
    from ...models.config import load_config
    from ...models.shard import ShardSpec
    from ..engine.build import remote_engine
    from ..engine.request import GenerationRequest

    n = load_config(model).num_layers
    t0 = time.perf_counter()
    engine = remote_engine(model, [address], True, secret, specs=[ShardSpec(0, n, n)], sources=[source])
    try:
        load_s = time.perf_counter() - t0
        reply = engine.pipeline.load_replies[0]
        engine.complete(GenerationRequest(engine.tokenizer.encode(PROMPT), max_tokens=1))
        ttft_s = time.perf_counter() - t0
    finally:
        engine.close()
    return {"load_s": load_s, "ttft_s": ttft_s, "fetched_bytes": reply.fetched_bytes, "source": reply.weights_source}


def _raw_tcp(target: str, n: int, into: Path | None = None) -> float:
    """Seconds to receive `n` bytes from the sender at `target` (and write them to a new file `into`)."""
    host, port = target.rsplit(":", 1)
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    with socket.create_connection((host, int(port)), timeout=60) as s, \
            (open(into, "wb") if into else open(os.devnull, "wb")) as out:
        t0 = time.perf_counter()
        s.sendall(struct.pack("<Q", n))
        got = 0
        while got < n:
            k = s.recv_into(view, min(len(buf), n - got))
            if not k:
                raise ConnectionError(f"raw TCP copy ended at {got} of {n} bytes")
            if into:
                out.write(view[:k])
            got += k
        seconds = time.perf_counter() - t0
        s.sendall(b"x")
    if into:
        into.unlink()
    return seconds


def warm_up(model: Path, source: str, secret: str) -> None:
    """One untimed fetch of the whole shard before the runs: the holder's first answers pay for reading
    the model's index and hashes and its files into the page cache (once per process)."""
    import asyncio

    from ...models.config import load_config
    from ...models.fingerprint import model_fingerprint, shard_names
    from ...node.fetch import Transfer, fetch_shard
    from ...node.shards import ShardCache, ShardKey

    n = load_config(model).num_layers
    with tempfile.TemporaryDirectory() as d:
        asyncio.run(fetch_shard(ShardCache(d), ShardKey(model_fingerprint(model), 0, n, n, True),
                                shard_names(model, 0, n, n, True), [source], secret, Transfer()))


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    from ...node.spawn import node_command

    model, tmp = Path(spec["model"]), Path(spec["tmp"])
    env = {**os.environ, "MTPIPE_SECRET": spec["secret"]}
    warm_up(model, spec["source"], spec["secret"])
    runs = []
    for i in range(spec["repeat"]):
        argv = _hidden(model, node_command("--host", "127.0.0.1", "--port", "0", "--shard-cache",
                                           str(tmp / f"cache{i}"), "--json"))
        run: dict[str, Any] = {}
        for kind in ("cold", "warm"):
            node, ready = _start_node(argv, env)
            try:
                run[kind] = _load(model, ready["address"], spec["source"], spec["secret"])
            finally:
                _stop(node)
        n = run["cold"]["fetched_bytes"]
        if n <= 0 or run["warm"]["fetched_bytes"] != 0:
            raise RuntimeError(f"expected a fetching cold load and a cached warm one, got {run}")
        run["raw_tcp_s"] = _raw_tcp(spec["raw"], n)
        # the same bytes into a new file where the shard cache is: what the disk adds to a transfer
        run["raw_tcp_to_file_s"] = _raw_tcp(spec["raw"], n, tmp / f"raw{i}.bin")
        runs.append(run)
    return summarize(runs)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the runs (one slow warm Load must not make a transfer look free)."""
    from statistics import median

    n = runs[0]["cold"]["fetched_bytes"]
    cold, warm = median(r["cold"]["load_s"] for r in runs), median(r["warm"]["load_s"] for r in runs)
    raw_s = median(r["raw_tcp_s"] for r in runs)
    to_file = n / median(r["raw_tcp_to_file_s"] for r in runs)
    transfer, load, raw = n / max(cold - warm, 1e-9), n / cold, n / raw_s
    return {
        "repeat": len(runs),
        "shard_bytes": n,
        "transfer_bytes_per_s": round(transfer),
        "cold_load_bytes_per_s": round(load),
        "raw_tcp_bytes_per_s": round(raw),
        "raw_tcp_to_file_bytes_per_s": round(to_file),
        "ratios": {"transfer_vs_raw_tcp": round(transfer / raw, 3), "cold_load_vs_raw_tcp": round(load / raw, 3),
                   "transfer_vs_raw_tcp_to_file": round(transfer / to_file, 3)},
        "cold_load_s": round(cold, 4),
        "warm_load_s": round(warm, 4),
        "raw_tcp_s": round(raw_s, 4),
        "ttft_cold_s": round(median(r["cold"]["ttft_s"] for r in runs), 4),
        "ttft_warm_s": round(median(r["warm"]["ttft_s"] for r in runs), 4),
        "sources": sorted({r["cold"]["source"].split()[0] for r in runs} | {r["warm"]["source"] for r in runs}),
        "runs": [{"raw_tcp_s": round(r["raw_tcp_s"], 4), "raw_tcp_to_file_s": round(r["raw_tcp_to_file_s"], 4),
                  "cold_load_s": round(r["cold"]["load_s"], 4),
                  "warm_load_s": round(r["warm"]["load_s"], 4), "cold_ttft_s": round(r["cold"]["ttft_s"], 4),
                  "warm_ttft_s": round(r["warm"]["ttft_s"], 4)} for r in runs],
    }


def print_report(result: dict[str, Any], console: Any) -> None:
    mib = 2**20
    r = result["ratios"]
    console.print(f"[bold]shard transfer[/bold] over a veth link, {result['shard_bytes'] / mib:.1f} MiB x "
                  f"{result['repeat']}")
    console.print(f"  transfer (cold - warm Load) {result['transfer_bytes_per_s'] / mib:8.1f} MiB/s  "
                  f"({r['transfer_vs_raw_tcp']:.2f}x raw TCP)")
    console.print(f"  whole cold Load             {result['cold_load_bytes_per_s'] / mib:8.1f} MiB/s  "
                  f"({r['cold_load_vs_raw_tcp']:.2f}x raw TCP)")
    console.print(f"  raw TCP copy                {result['raw_tcp_bytes_per_s'] / mib:8.1f} MiB/s")
    console.print(f"  raw TCP copy into a file    {result['raw_tcp_to_file_bytes_per_s'] / mib:8.1f} MiB/s  "
                  f"(transfer: {r['transfer_vs_raw_tcp_to_file']:.2f}x of it)")
    console.print(f"  time to first token: cold {result['ttft_cold_s']:.2f} s, warm {result['ttft_warm_s']:.2f} s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(worker(json.loads(sys.argv[2]))), flush=True)
