"""Diagnostic, not a benchmark: what a round at depth 0 and at depth 1 really costs at concurrency 8
in `bench serve`'s closed loop, against what auto's plan times.

8 clients on the demo model, each sending its next `auto` request as the last ends (spread lengths,
serve_steady.py), with the batch plan pinned at depth 0 or 1, alternated REPS times after a warm-up
of each. Per run: tok/s while every slot is taken; the run's wall time split into prompt chunks and
decode rounds (ms per round outside the chunks); rows and tokens per round; and the rounds the plan
timed with their mean, to compare.

    python benchmarks/closed_loop_pinned.py REPS
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from typing import Any

from mtpipe.coordinator.bench.engine import bench_prompts
from mtpipe.coordinator.bench.serve import _request
from mtpipe.coordinator.bench.serve_steady import engine_closed_loop, lengths, steady_window
from mtpipe.coordinator.engine.build import batch_engine
from mtpipe.models.registry import DEMO_MODEL
from mtpipe.node import batch, batch_depth, batch_head
from mtpipe.node.depth import StageCosts

SLOTS, TOTAL = 8, 32
pin = {"depth": 0}
seen: defaultdict[str, float] = defaultdict(float)


def wrap(cls: Any, name: str, after: Any) -> None:
    """`cls.name` calls `after(self, elapsed seconds, result, *args)` after each call."""
    original = getattr(cls, name)

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = original(self, *args, **kwargs)
        after(self, time.perf_counter() - start, out, *args)
        return out

    setattr(cls, name, wrapped)


def pinned(self: Any, member: object, bucket: int, context: int, kmax: int, rates: Any, least: int = 0) -> int:
    self.members[member] = (pin["depth"], kmax, rates)
    self.depth, self.held = pin["depth"], 0
    return self._take(member, pin["depth"])


def on_fill(self: Any, seconds: float, out: Any, reqs: list, *rest: Any) -> None:
    seen["fill_s"] += seconds
    seen["fill_tokens"] += sum(len(r.tokens) for r in reqs)


def on_round(self: Any, seconds: float, outs: list, rows: list, *rest: Any) -> None:
    seen["rounds"] += 1
    seen["row_rounds"] += len(rows)
    seen["tokens"] += sum(len(o.output.tokens) for o in outs)


def on_timing(self: Any, seconds: float, out: Any, depth: int, context: int, timed: float) -> None:
    seen["timed"] += 1
    seen["timed_s"] += timed


def main(reps: int) -> None:
    batch_depth.DepthPlan.next = pinned
    wrap(batch.BatchStage, "fill", on_fill)
    wrap(batch_head.BatchHead, "decide", on_round)
    wrap(StageCosts, "observe", on_timing)
    engine = batch_engine(DEMO_MODEL, max_rows=16)
    sizes = lengths(TOTAL, 128)
    try:
        prompts = [list(engine.tokenizer.encode(t)) for t in bench_prompts(SLOTS)]

        def run() -> tuple[float, float]:
            start = time.perf_counter()
            recs = engine_closed_loop(engine, lambda i: _request(engine, prompts[i % SLOTS], sizes[i], "auto"),
                                      SLOTS, TOTAL)
            return steady_window([(r.times, r.counts, r.ended) for r in recs], SLOTS).tps, time.perf_counter() - start

        for depth in (0, 1):
            pin["depth"] = depth
            run()
        for _ in range(reps):
            for depth in (0, 1):
                pin["depth"] = depth
                seen.clear()
                tps, wall = run()
                rounds, row_rounds, timed = seen["rounds"], seen["row_rounds"], max(seen["timed"], 1)
                print(f"depth {depth}: {tps:.0f} tok/s | wall {wall:.2f} s, prompt chunks {seen['fill_s']:.2f} s "
                      f"({seen['fill_tokens']:.0f} tokens) | {rounds:.0f} rounds, {row_rounds / rounds:.2f} rows "
                      f"and {seen['tokens'] / row_rounds:.2f} tokens per row-round, "
                      f"{(wall - seen['fill_s']) * 1000 / rounds:.1f} ms per round outside the chunks | "
                      f"timed {seen['timed']:.0f} at {seen['timed_s'] * 1000 / timed:.1f} ms", flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main(int(sys.argv[1]))
