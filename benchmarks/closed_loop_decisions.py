"""Diagnostic, not a benchmark: why auto drafts at concurrency 8 in `bench serve`'s closed loop.

8 clients on the demo model, each sending its next `auto` request as the last ends (spread lengths,
serve_steady.py), RUNS times on one engine. Prints every change of the batch plan's depth at 8 rows
with what it chose from: the estimated ms per round by depth at that context, the rows' hoped tokens
per second by depth, and whether the change was a probe; after each run, the plan's decisions at 8
rows by depth.

    python benchmarks/closed_loop_decisions.py RUNS
"""

from __future__ import annotations

import sys
from typing import Any

from mtpipe.coordinator.bench.engine import bench_prompts
from mtpipe.coordinator.bench.serve import _request
from mtpipe.coordinator.bench.serve_steady import engine_closed_loop, lengths
from mtpipe.coordinator.engine.build import batch_engine
from mtpipe.models.registry import DEMO_MODEL
from mtpipe.node import batch_depth
from mtpipe.node.depth_rates import context_bucket, hoped

SLOTS, TOTAL, ROWS = 8, 32, 8


class Trace:
    def __init__(self) -> None:
        self.last: int | None = None
        self.rounds = 0
        self.by_depth: dict[int, int] = {}


def traced(trace: Trace) -> Any:
    choose = batch_depth.DepthPlan.next

    def next_depth(self: Any, member: object, bucket: int, context: int, kmax: int, rates: Any,
                   least: int = 0) -> int:
        probing = self.probe.probed_from
        depth = choose(self, member, bucket, context, kmax, rates, least)
        if bucket != ROWS:
            return depth
        trace.by_depth[depth] = trace.by_depth.get(depth, 0) + 1
        if depth != trace.last:
            seconds, noise, _ = self.round_seconds(bucket, context)
            per_depth = hoped(r(seconds[: kmax + 1]) for _, _, r in self.members.values())
            probe = probing is None and self.probe.probed_from is not None
            print(f"round {trace.rounds}: {trace.last} -> {depth} at context {context} (bucket "
                  f"{context_bucket(context)}): ms {[round(s * 1000, 1) for s in seconds]} +- "
                  f"{[round(n * 100, 1) for n in noise]}%, hoped tok/s "
                  f"{[round(p) for p in per_depth]}{' (probe)' if probe else ''}", flush=True)
            trace.last = depth
        trace.rounds += 1
        return depth

    return next_depth


def main(runs: int) -> None:
    trace = Trace()
    batch_depth.DepthPlan.next = traced(trace)
    engine = batch_engine(DEMO_MODEL, max_rows=16)
    sizes = lengths(TOTAL, 128)
    try:
        prompts = [list(engine.tokenizer.encode(t)) for t in bench_prompts(SLOTS)]
        for run in range(runs):
            trace.by_depth = {}
            print("run", run, flush=True)
            engine_closed_loop(engine, lambda i: _request(engine, prompts[i % SLOTS], sizes[i], "auto"), SLOTS, TOTAL)
            print("decisions at", ROWS, "rows by depth:", dict(sorted(trace.by_depth.items())), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main(int(sys.argv[1]))
