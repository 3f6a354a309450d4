"""Diagnostic, not a benchmark: every fixed MTP depth against auto, C concurrent streams, one engine.

`pipe2`: a ring over 2 node processes on this machine (as `bench serve --nodes 2` spawns them);
`single`: the in-process batch engine. The serve bench's prompts, 128 tokens each; every method
back to back in each of PASSES passes; prints each pass, the medians of aggregate decode tok/s,
and how many row-rounds auto ran at each depth.

    python benchmarks/ring_depths.py PASSES C [pipe2|single]
"""

from __future__ import annotations

import statistics
import sys
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import mtpipe  # noqa: F401  (the optimized BLAS before MLX)
from mtpipe.coordinator.bench import serve
from mtpipe.coordinator.bench.engine import bench_prompts
from mtpipe.coordinator.bench.nodes import spawn_nodes
from mtpipe.coordinator.bench.serve_nodes import _run
from mtpipe.coordinator.engine.build import batch_engine, ring_engine

MODEL = Path(__file__).resolve().parent.parent / "models" / "demo"
METHODS = {"no_mtp": 0, "k1": 1, "k2": 2, "k3": 3, "auto": serve.METHODS["auto"]}


class DepthCounts:
    """Wraps the bench's Recorder: each finished request's rounds per depth, per method."""

    def __init__(self) -> None:
        self.method = ""
        self.counts: dict[str, Counter] = {}
        original = serve.Recorder.__call__

        def call(recorder: Any, item: Any) -> None:
            stats = getattr(item, "stats", None)
            if stats is not None and getattr(item, "finish_reason", None):
                self.counts.setdefault(self.method, Counter()).update(stats.depths)
            original(recorder, item)

        serve.Recorder.__call__ = call

    def run(self, engine: Any, prompts: list[list[int]], max_tokens: int, method: str) -> float:
        self.method = method
        return _run(engine, prompts, max_tokens, method)[0].tps


def main() -> None:
    passes, streams = int(sys.argv[1]), int(sys.argv[2])
    where = sys.argv[3] if len(sys.argv) > 3 else "pipe2"
    serve.METHODS.update(METHODS)
    counts = DepthCounts()
    with ExitStack() as stack:
        if where == "pipe2":
            engine = ring_engine(MODEL, stack.enter_context(spawn_nodes(2, MODEL)), mtp=True, max_rows=16)
        else:
            engine = batch_engine(MODEL, max_rows=16)
        stack.callback(engine.close)
        prompts = [list(engine.tokenizer.encode(t)) for t in bench_prompts(streams)][:streams]
        for method in METHODS:  # warm-up: every shape traced
            counts.run(engine, prompts, 8, method)
        counts.counts.clear()
        tok_s: dict[str, list[float]] = {m: [] for m in METHODS}
        for p in range(passes):
            for method in METHODS:
                tok_s[method].append(counts.run(engine, prompts, 128, method))
            print(p, {m: round(v[-1], 1) for m, v in tok_s.items()}, flush=True)
        print("median", {m: round(statistics.median(v), 1) for m, v in tok_s.items()})
        print("depths", {m: dict(sorted(c.items())) for m, c in counts.counts.items()})


if __name__ == "__main__":
    main()
