"""Diagnostic, not a benchmark: what one request with min_tokens costs the batch it runs in.

One batch engine on the demo model; 8 streams of 128 greedy tokens on the bench's prompts, no MTP and
auto, opened at once: all plain, then with stream 0 asking min_tokens 4 (EOS held back for its first 4
tokens: its logits are processed, which takes the batch's rounds off their look-ahead while it lasts), in
turn, REPS times. Prints the aggregate tok/s of each (medians) and their ratio.

    python benchmarks/min_tokens_batch.py [REPS]
"""

from __future__ import annotations

import queue
import statistics
import sys
import time

from mtpipe.coordinator.bench.engine import bench_prompts
from mtpipe.coordinator.engine.build import batch_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.coordinator.engine.sinks import END
from mtpipe.models.registry import DEMO_MODEL
from mtpipe.node.protocol import SamplingParams

ROWS, TOKENS = 8, 128


def wave(engine: object, prompts: list[list[int]], held: bool, auto: bool) -> float:
    sinks: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in prompts]
    start = time.perf_counter()
    for i, (p, sink) in enumerate(zip(prompts, sinks)):
        params = SamplingParams(min_tokens=4 if held and i == 0 else 0)
        req = GenerationRequest(p, TOKENS, params, mtp_depth=3 if auto else 0, mtp_auto=auto)
        engine.open(req, sink.put)  # type: ignore[attr-defined]
    tokens = 0
    for sink in sinks:
        while (item := sink.get(timeout=600)) is not END:
            assert not isinstance(item, BaseException), item
            tokens += len(item.tokens)
    return tokens / (time.perf_counter() - start)


def main(reps: int) -> None:
    engine = batch_engine(DEMO_MODEL)
    prompts = [engine.tokenizer.encode(p) for p in bench_prompts(ROWS)]
    ways = [(held, auto) for auto in (False, True) for held in (False, True)]
    got: dict[tuple[bool, bool], list[float]] = {w: [] for w in ways}
    try:
        wave(engine, prompts, True, True)  # (warm-up)
        for rep in range(reps):
            for way in ways if rep % 2 == 0 else ways[::-1]:
                got[way].append(wave(engine, prompts, *way))
    finally:
        engine.close()
    for auto in (False, True):
        plain, held = statistics.median(got[False, auto]), statistics.median(got[True, auto])
        print(f"{'auto' if auto else 'no MTP'}: all plain {plain:.1f} tok/s, one with min_tokens 4 {held:.1f} tok/s: "
              f"{held / plain:.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
