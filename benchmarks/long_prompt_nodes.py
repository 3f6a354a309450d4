"""Diagnostic: a long prompt over a pipeline of nodes, against a running `mtpipe serve --nodes ...`.

Two nodes and the API, on this machine:

    mtpipe node --port 53711 --node-id A &
    mtpipe node --port 53712 --node-id B &
    mtpipe serve --nodes 127.0.0.1:53711,127.0.0.1:53712 --port 18751 &

then `python benchmarks/long_prompt_nodes.py TOKENS [URL]`: one greedy completion of TOKENS prompt tokens
(Python's standard library sources, as the demo model tokenizes them) and 4 generated, with GET /health
polled every 1.5 s meanwhile. Prints the seconds it took (or the error it ended with), and how many
/health answers were 503.
"""

from __future__ import annotations

import glob
import json
import sys
import sysconfig
import threading
import time
from pathlib import Path

import httpx


def source_text(chars: int = 400_000) -> str:
    text = ""
    for f in sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py"))):
        text += Path(f).read_text(encoding="utf-8", errors="replace")
        if len(text) > chars:
            break
    return text


def main() -> None:
    n = int(sys.argv[1])
    url = sys.argv[2] if len(sys.argv) > 2 else "http://127.0.0.1:18751"
    client = httpx.Client(timeout=600)
    tokens = client.post(url + "/tokenize", json={"prompt": source_text()}).json()["tokens"][:n]
    assert len(tokens) == n, f"only {len(tokens)} tokens of text"
    result: dict[str, object] = {}

    def complete() -> None:
        start = time.perf_counter()
        r = client.post(url + "/v1/completions", json={"prompt": tokens, "max_tokens": 4, "temperature": 0})
        result.update(status=r.status_code, seconds=round(time.perf_counter() - start, 1),
                      error=r.json().get("error", {}).get("message") if r.status_code != 200 else None)

    worker = threading.Thread(target=complete)
    worker.start()
    polled = unready = 0
    while worker.is_alive():
        time.sleep(1.5)
        try:
            unready += httpx.get(url + "/health", timeout=10).status_code == 503
        except httpx.HTTPError:
            unready += 1
        polled += 1
    print(json.dumps({"prompt_tokens": n, **result, "health_polls": polled, "health_503": unready}))


if __name__ == "__main__":
    main()
