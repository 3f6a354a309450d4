"""Diagnostic, not a benchmark: N replies to one long prompt, as one request with `n` and as N requests.

One batch engine on the demo model behind the API as `mtpipe serve` runs it (its own process). Each
rep sends a prompt of about PROMPT_TOKENS tokens that no earlier rep sent, N replies of 32 tokens
(greedy, no MTP), once as one request with n=N and once as N requests at the same moment, in turn.
Prints each way's wall time, the tokens taken from kept prefixes, and their ratio.

    python benchmarks/choices_prefill.py [REPS] [N] [PROMPT_TOKENS]
"""

from __future__ import annotations

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from mtpipe.coordinator.bench.engine import bench_prompts
from mtpipe.coordinator.bench.serve_api import MODEL_NAME, LiveServer
from mtpipe.coordinator.engine.build import batch_engine
from mtpipe.models.registry import DEMO_MODEL


def main(reps: int, n: int, size: int) -> None:
    engine = batch_engine(DEMO_MODEL, mtp=False)
    server = LiveServer(engine, DEMO_MODEL)
    url = server.start() + "/v1/completions"
    text = "\n".join(bench_prompts(24))
    tokens = engine.tokenizer.encode(text)
    assert len(tokens) >= size + reps * 2, "the held-out prompts are too short for this size"
    body = {"model": MODEL_NAME, "max_tokens": 32, "temperature": 0, "mtp_depth": 0, "ignore_eos": True}
    times: dict[str, list[float]] = {"n": [], "separate": []}
    try:
        with httpx.Client(timeout=600) as http, ThreadPoolExecutor(n) as pool:
            http.post(url, json={**body, "prompt": tokens[:64], "n": n}).raise_for_status()  # (warm-up)
            for rep in range(reps):
                for way in ("n", "separate") if rep % 2 == 0 else ("separate", "n"):
                    prompt = tokens[2 * rep + (way == "n") :][:size]  # (never sent before: nothing kept of it)
                    t = time.perf_counter()
                    if way == "n":
                        out = [http.post(url, json={**body, "prompt": prompt, "n": n})]
                    else:
                        out = list(pool.map(lambda _: http.post(url, json={**body, "prompt": prompt}), range(n)))
                    wall = time.perf_counter() - t
                    for r in out:
                        r.raise_for_status()
                    cached = sum(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in out)
                    replies = sum(len(r.json()["choices"]) for r in out)
                    times[way].append(wall)
                    print(f"rep {rep} {way:>8}: {wall:.2f} s for {replies} replies of {len(prompt)} prompt tokens, "
                          f"{cached} in usage as cached", flush=True)
    finally:
        server.stop()
        engine.close()
    a, b = statistics.median(times["n"]), statistics.median(times["separate"])
    print(f"median: n={n} in one request {a:.2f} s, {n} requests {b:.2f} s: {b / a:.2f}x")


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    main(*(args + [3, 4, 2048][len(args):]))
