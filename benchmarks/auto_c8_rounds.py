"""Diagnostic, not a benchmark: what auto depth settles on at concurrency 8.

8 greedy streams at once on the demo model: no MTP, one draft and two drafts (fixed), then auto, REPS
times on one batch engine (so auto keeps what it learned). Prints per run decode tok/s, ms per round,
tokens per round, request-rounds by depth and drafted/accepted; at the end, the round costs auto
measured at each batch size (ms, by context bucket and depth), to compare with the fixed runs.

    python benchmarks/auto_c8_rounds.py REPS
"""

from __future__ import annotations

import sys
from typing import Any

from mtpipe.coordinator.bench.engine import bench_prompts
from mtpipe.coordinator.bench.streams import Recorder, aggregate_tps
from mtpipe.coordinator.engine.build import batch_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.coordinator.engine.sinks import END
from mtpipe.models.registry import DEMO_MODEL
from mtpipe.node.protocol import SamplingParams

METHODS = {"no_mtp": (0, False), "fixed1": (1, False), "fixed2": (2, False), "auto": (3, True)}


class StatsRecorder(Recorder):
    """A Recorder that also keeps the last statistics a stream reported."""

    stats: Any = None

    def __call__(self, item: Any) -> None:
        if item is not END and not isinstance(item, BaseException) and getattr(item, "stats", None):
            self.stats = item.stats
        super().__call__(item)


def main(reps: int) -> None:
    engine = batch_engine(DEMO_MODEL, max_rows=16)
    prompts = [list(engine.tokenizer.encode(t)) for t in bench_prompts(8)]
    try:
        for rep in range(reps):
            for method, (depth, auto) in METHODS.items():
                recs = [StatsRecorder() for _ in prompts]
                for prompt, rec in zip(prompts, recs):
                    req = GenerationRequest(prompt, max_tokens=128, params=SamplingParams(), mtp_depth=depth,
                                            mtp_auto=auto)
                    engine.open(req, rec)
                for rec in recs:
                    rec.wait()
                depths: dict[int, int] = {}
                drafted = accepted = 0
                for rec in recs:
                    for k, v in rec.stats.depths.items():
                        depths[k] = depths.get(k, 0) + v
                    drafted, accepted = drafted + rec.stats.drafted, accepted + rec.stats.accepted
                tps = aggregate_tps([(r.times, r.counts) for r in recs])
                rounds = sum(r.stats.rounds for r in recs)
                ms = 1000 * sum(r.times[-1] - r.times[0] for r in recs) / rounds
                per_round = sum(len(r.tokens) for r in recs) / rounds
                print(rep, method, f"{tps:.1f} tok/s, {ms:.2f} ms and {per_round:.2f} tokens per round",
                      dict(sorted(depths.items())), [drafted, accepted], flush=True)
        head = engine.stages[-1].head
        for rows, costs in sorted(head.plan.costs_by_rows.items()):
            print("auto's round costs at", rows, "rows:", {k: round(v * 1000, 2) for k, v in sorted(costs.live.items())})
    finally:
        engine.close()


if __name__ == "__main__":
    main(int(sys.argv[1]))
