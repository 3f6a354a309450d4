"""Diagnostic, not a benchmark: what auto depth settles on at concurrency 8.

8 greedy streams at once on the demo model, no MTP then auto, REPS times on one batch engine (so auto
keeps what it learned); prints decode tok/s, request-rounds by depth and drafted/accepted per run.

    python benchmarks/auto_c8_rounds.py REPS
"""

from __future__ import annotations

import sys
from typing import Any

from mtpipe.coordinator.bench.engine import bench_prompts
from mtpipe.coordinator.bench.serve import Recorder, _request, aggregate_tps
from mtpipe.coordinator.engine.batch import END
from mtpipe.coordinator.engine.build import batch_engine
from mtpipe.models.registry import DEMO_MODEL


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
            for method in ("no_mtp", "auto"):
                recs = [StatsRecorder() for _ in prompts]
                for prompt, rec in zip(prompts, recs):
                    engine.open(_request(engine, prompt, 128, method), rec)
                for rec in recs:
                    rec.wait()
                depths: dict[int, int] = {}
                drafted = accepted = 0
                for rec in recs:
                    for k, v in rec.stats.depths.items():
                        depths[k] = depths.get(k, 0) + v
                    drafted, accepted = drafted + rec.stats.drafted, accepted + rec.stats.accepted
                tps = aggregate_tps([(r.times, r.counts) for r in recs])
                print(rep, method, round(tps, 1), dict(sorted(depths.items())), [drafted, accepted], flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main(int(sys.argv[1]))
