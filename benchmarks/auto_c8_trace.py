"""Diagnostic, not a benchmark: auto's batch plan round by round at concurrency 8.

The bench's 8 prompts, 128 greedy tokens each, on one batch engine: no MTP, then auto, REPS times
(after one warm-up of each). Per rep: both aggregate decode tok/s and their ratio; the deciding
member's rounds as runs of (batch bucket, depth) x count : mean ms between its decisions; and, for
the first times the plan settled on drafts, the tokens per second by depth it saw, their noise, how
long ago each depth was timed, and the round costs (ms) it read.

    python benchmarks/auto_c8_trace.py REPS
"""

from __future__ import annotations

import sys
import time
from typing import Any

from mtpipe.coordinator.bench.engine import bench_prompts
from mtpipe.coordinator.bench.streams import Recorder, aggregate_tps
from mtpipe.coordinator.engine.build import batch_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.models.registry import DEMO_MODEL
from mtpipe.node import batch_depth
from mtpipe.node.protocol import SamplingParams

LOG: list[tuple[Any, ...]] = []


def traced() -> None:
    """Wrap the plan's choice, its cost reading and `settled` to log what they saw."""
    next_depth, round_seconds, settled = (batch_depth.DepthPlan.next, batch_depth.DepthPlan.round_seconds,
                                          batch_depth.settled)

    def plan_next(self: Any, member: Any, bucket: int, *a: Any, **kw: Any) -> int:
        depth = next_depth(self, member, bucket, *a, **kw)
        LOG.append(("next", time.perf_counter(), bucket, depth))
        return depth

    def plan_seconds(self: Any, bucket: int, context: int) -> Any:
        out = round_seconds(self, bucket, context)
        LOG.append(("costs", time.perf_counter(), bucket, context, [round(x * 1000, 1) for x in out[0]]))
        return out

    def plan_settled(rates: list[float], noise: list[float], when: list[float | None],
                     lead: float | None = None) -> int:
        depth = settled(rates, noise, when, lead)
        if depth > 0:
            now = time.perf_counter()
            LOG.append(("settled", now, depth, [round(r, 1) for r in rates], [round(n, 3) for n in noise],
                        [None if w is None else round(now - w, 2) for w in when]))
        return depth

    batch_depth.DepthPlan.next, batch_depth.DepthPlan.round_seconds = plan_next, plan_seconds
    batch_depth.settled = plan_settled


def run(engine: Any, prompts: list[list[int]], depth: int, auto: bool, max_tokens: int = 128) -> float:
    recs = [Recorder() for _ in prompts]
    for prompt, rec in zip(prompts, recs):
        engine.open(GenerationRequest(prompt, max_tokens=max_tokens, params=SamplingParams(), mtp_depth=depth,
                                      mtp_auto=auto), rec)
    for rec in recs:
        rec.wait()
    return aggregate_tps([(r.times, r.counts) for r in recs])


def report(rep: int, plain: float, auto: float) -> None:
    decisions = [e for e in LOG if e[0] == "next"]
    runs: list[tuple[tuple[int, int], list[float]]] = []
    for (_, t, bucket, depth), after in zip(decisions, decisions[1:]):
        ms = (after[1] - t) * 1000
        if runs and runs[-1][0] == (bucket, depth):
            runs[-1][1].append(ms)
        else:
            runs.append(((bucket, depth), [ms]))
    print(f"rep {rep}: no MTP {plain:.1f} tok/s, auto {auto:.1f} ({auto / plain:.3f})")
    print("   ", " ".join(f"{b}r/k{d}x{len(v)}:{sum(v) / len(v):.1f}" for (b, d), v in runs))
    for i in [i for i, e in enumerate(LOG) if e[0] == "settled"][:4]:
        print("    settled", LOG[i][2:], "costs", LOG[i - 1][2:] if LOG[i - 1][0] == "costs" else None)


def main(reps: int) -> None:
    traced()
    engine = batch_engine(DEMO_MODEL, max_rows=16)
    prompts = [list(engine.tokenizer.encode(t)) for t in bench_prompts(8)]
    try:
        run(engine, prompts, 0, False)
        run(engine, prompts, 3, True)
        for rep in range(reps):
            plain = run(engine, prompts, 0, False)
            del LOG[:]
            report(rep, plain, run(engine, prompts, 3, True))
    finally:
        engine.close()


if __name__ == "__main__":
    main(int(sys.argv[1]))
