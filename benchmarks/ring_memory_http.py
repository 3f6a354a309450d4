"""A check through the HTTP API, not a benchmark: `mtpipe serve --nodes` over 2 node processes on the demo
model, once with each node's default memory budget and once with `--memory-budget GB` too small for its rows
at their ends; 8 concurrent greedy streams (depth 2 and auto alternating, ignore_eos, MAX_TOKENS each) must
give the same text both times, and the tight run reports its preemptions (GET /v1/cluster, /metrics).

    python benchmarks/ring_memory_http.py [GB]
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import sys
import time
from typing import Any

import httpx

from mtpipe.coordinator.bench.nodes import spawn_nodes
from mtpipe.models.registry import DEMO_MODEL

PORT = 8731
STREAMS, MAX_TOKENS = 8, 600
URL = f"http://127.0.0.1:{PORT}"


def stream(i: int) -> str:
    body = {"model": "demo", "messages": [{"role": "user", "content": f"Tell me a story about the number {i}."}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "mtp_depth": "auto" if i % 2 else 2}
    text = ""
    with httpx.stream("POST", f"{URL}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += "".join(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
    return text


def serve(nodes: list[str], budget: float | None) -> tuple[list[str], float, dict[str, Any], list[str]]:
    cmd = [sys.executable, "-m", "mtpipe", "serve", "--model", str(DEMO_MODEL), "--nodes", ",".join(nodes),
           "--port", str(PORT), "--model-name", "demo", "--prefix-cache", "0"]
    cmd += ["--memory-budget", str(budget)] if budget else []
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{URL}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the server did not come up")
            time.sleep(0.5)
        start = time.perf_counter()
        with cf.ThreadPoolExecutor(STREAMS) as pool:
            texts = list(pool.map(stream, range(STREAMS)))
        wall = time.perf_counter() - start
        ring = httpx.get(f"{URL}/v1/cluster", timeout=10).json()["ring"]
        metric = [x for x in httpx.get(f"{URL}/metrics", timeout=10).text.splitlines()
                  if x.startswith("mtpipe_preemptions_total")]
        return texts, wall, ring, metric
    finally:
        proc.terminate()
        proc.wait(30)


def main(budget: float) -> None:
    with spawn_nodes(2, DEMO_MODEL) as nodes:
        free, free_wall, free_ring, _ = serve(nodes, None)
        tight, tight_wall, tight_ring, metric = serve(nodes, budget)
    print(f"default budgets {[round(b / 2**30, 1) for b in free_ring['budget_bytes']]} GB: {free_wall:.1f} s, "
          f"{free_ring['preemptions']} preemptions")
    print(f"--memory-budget {budget}: {tight_wall:.1f} s, {tight_ring['preemptions']} preemptions, {metric}")
    print("identical:", free == tight)


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 0.006)
