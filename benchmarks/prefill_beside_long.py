"""Diagnostic, not a benchmark: short prompts taken in beside a long one, on the batch engine.

A prompt of LONG tokens and N short prompts (8 tokens each) are opened together on one batch engine
(demo model, nothing else running), one token each; then the short prompts alone. Prints the time to
the short prompts' first tokens and to the long one's, per N, REPS times (after a warm-up).

    python benchmarks/prefill_beside_long.py REPS [LONG]
"""

from __future__ import annotations

import statistics
import sys
import time

from mtpipe.coordinator.bench.streams import Recorder
from mtpipe.coordinator.engine.build import batch_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.models.registry import DEMO_MODEL


def opened_together(engine, prompts: list[list[int]]) -> list[float]:
    """Seconds to each prompt's first token, all opened on the MLX thread between two of its units."""
    recs = [Recorder() for _ in prompts]
    start = time.perf_counter()
    engine.thread.call(lambda: [engine.open(GenerationRequest(p, max_tokens=1), r) for p, r in zip(prompts, recs)])
    for rec in recs:
        rec.wait()
    return [rec.times[0] - start for rec in recs]


def main(reps: int, long: int) -> None:
    engine = batch_engine(DEMO_MODEL, prefix_cache=0)
    try:
        text = list(engine.tokenizer.encode(open(__file__).read())) * 64
        shorts = [text[50 + 8 * i : 58 + 8 * i] for i in range(16)]
        opened_together(engine, [text[:long], *shorts[:4]])  # (warm-up)
        for n in (0, 8, 16):
            firsts, longs = [], []
            for _ in range(reps):
                times = opened_together(engine, [text[:long], *shorts[:n]])
                longs.append(times[0])
                firsts.append(max(times[1:], default=0.0))
            print(f"{n:2d} short prompts beside {long} tokens: their first tokens after {statistics.median(firsts):.3f} s, "
                  f"the long prompt's after {statistics.median(longs):.3f} s (medians of {reps})", flush=True)
        alone = [max(opened_together(engine, shorts)) for _ in range(reps)]
        print(f"16 short prompts alone: {statistics.median(alone):.3f} s", flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3000)
