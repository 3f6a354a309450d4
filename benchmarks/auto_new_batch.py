"""Diagnostic, not a benchmark: auto at 8 streams right after one stream, as `bench serve` meets it.

Per rep, a fresh batch engine: one stream (no MTP, then auto; 8 tokens, then 128), the 8 streams warmed
up with 8 tokens each method (`bench serve`'s warm-up), then 8 streams of 128 greedy tokens without MTP
and with auto. Auto's costs at 8 rows are then first carried over from one row. Prints per rep both
methods' aggregate decode tok/s, their ratio, and the deciding member's rounds as runs of (batch
bucket, depth) x count : mean ms between its decisions (`auto_c8_trace.py`); at the end the median
ratio and the share of 8-row rounds at each depth. An A/B runs it once per version, alternated
(a worktree on PYTHONPATH for the other version).

    python benchmarks/auto_new_batch.py REPS
"""

from __future__ import annotations

import re
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import auto_c8_trace as trace  # noqa: E402  (its tracing of the plan, and the mtpipe imports)

from mtpipe.coordinator.bench.engine import bench_prompts  # noqa: E402
from mtpipe.coordinator.engine.build import batch_engine  # noqa: E402
from mtpipe.models.registry import DEMO_MODEL  # noqa: E402


def depths_at_8(log: list[tuple[Any, ...]]) -> Counter[int]:
    return Counter(depth for kind, _, bucket, depth, *_ in log if kind == "next" and bucket == 8)


def main(reps: int) -> None:
    trace.traced()
    ratios: list[float] = []
    rounds: Counter[int] = Counter()
    for rep in range(reps):
        engine = batch_engine(DEMO_MODEL, max_rows=16)
        prompts = [list(engine.tokenizer.encode(t)) for t in bench_prompts(8)]
        try:
            for tokens in (8, 128):
                trace.run(engine, prompts[:1], 0, False, tokens)
                trace.run(engine, prompts[:1], 3, True, tokens)
            trace.run(engine, prompts, 0, False, 8)
            trace.run(engine, prompts, 3, True, 8)
            plain = trace.run(engine, prompts, 0, False)
            del trace.LOG[:]
            auto = trace.run(engine, prompts, 3, True)
            trace.report(rep, plain, auto)
            ratios.append(auto / plain)
            rounds += depths_at_8(trace.LOG)
        finally:
            engine.close()
    total = sum(rounds.values()) or 1
    print("median auto / no MTP", round(statistics.median(ratios), 3), "8-row rounds by depth",
          {k: f"{n} ({n / total:.1%})" for k, n in sorted(rounds.items())})


if __name__ == "__main__":
    assert re.fullmatch(r"\d+", sys.argv[1] if len(sys.argv) > 1 else ""), __doc__
    main(int(sys.argv[1]))
