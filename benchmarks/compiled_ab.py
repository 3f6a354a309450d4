"""Diagnostic, not a benchmark: GatedDeltaNet layers compiled against the same layers uncompiled.

One engine on the demo model; each run switches the shard's compiled layers on or off, in an order
that alternates, PASSES times over the bench prompts (one stream) or over runs of STREAMS concurrent
streams (a batch engine; STREAMS 1 is one stream through the batch engine). Prints the median and mean of the per-pair ratios (compiled / uncompiled)
for no drafts and for DEPTH, and whether every pair's tokens were identical.

    python benchmarks/compiled_ab.py DEPTH|auto PASSES [STREAMS]
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

from mtpipe.coordinator.bench.engine import _time_engine, bench_prompts
from mtpipe.coordinator.bench.streams import Recorder, aggregate_tps
from mtpipe.coordinator.engine.build import batch_engine, local_engine
from mtpipe.coordinator.engine.request import AUTO, GenerationRequest, resolve_depth
from mtpipe.models.registry import DEMO_MODEL


def report(depth: int | str, ratios: list[float], identical: bool) -> None:
    print(f"depth {depth}: {len(ratios)} pairs, compiled / uncompiled: median {statistics.median(ratios):.3f}, "
          f"mean {statistics.mean(ratios):.3f}, spread {min(ratios):.3f}-{max(ratios):.3f}; identical {identical}")


def alternate(passes: int, items: list[Any], run: Any, shards: list[Any]) -> tuple[list[float], bool]:
    compiled = [s.compiled for s in shards]
    ratios, identical = [], True
    for n in range(passes):
        for i, item in enumerate(items):
            speed, tokens = {}, {}
            for on in ((True, False) if (i + n) % 2 == 0 else (False, True)):
                for shard, c in zip(shards, compiled):
                    shard.compiled = c if on else None
                tokens[on], speed[on] = run(item)
            ratios.append(speed[True] / speed[False])
            identical &= tokens[True] == tokens[False]
    for shard, c in zip(shards, compiled):
        shard.compiled = c
    return ratios, identical


def single(depths: list[int | str], passes: int) -> None:
    engine = local_engine(DEMO_MODEL)
    shards = [stage.model for stage in engine.pipeline.stages]
    prompts = [engine.tokenizer.encode(t) for t in bench_prompts(8)]
    for depth in depths:
        alternate(1, prompts[:2], lambda p, d=depth: _time_engine(engine, p, 16, d)[:2], shards)
        ratios, identical = alternate(passes, prompts, lambda p, d=depth: _time_engine(engine, p, 128, d)[:2], shards)
        report(depth, ratios, identical)


def batched(depths: list[int | str], passes: int, streams: int) -> None:
    engine = batch_engine(DEMO_MODEL, max_rows=streams)
    try:
        shards = engine.thread.call(lambda: [stage.model for stage in engine.stages])
        texts = bench_prompts(8)
        prompts = [list(engine.tokenizer.encode(texts[i % len(texts)])) for i in range(streams)]
        for depth in depths:
            drafts, auto = resolve_depth(depth, True)

            def run(max_tokens: int, drafts: int = drafts, auto: bool = auto) -> tuple[list[list[int]], float]:
                recs = [Recorder() for _ in prompts]
                for prompt, rec in zip(prompts, recs):
                    engine.open(GenerationRequest(prompt, max_tokens=max_tokens, mtp_depth=drafts, mtp_auto=auto), rec)
                for rec in recs:
                    rec.wait()
                return [r.tokens for r in recs], aggregate_tps([(r.times, r.counts) for r in recs])

            alternate(1, [16], run, shards)
            ratios, identical = alternate(passes, [128], run, shards)
            report(depth, ratios, identical)
    finally:
        engine.close()


if __name__ == "__main__":
    depths: list[int | str] = [0, AUTO if sys.argv[1] == "auto" else int(sys.argv[1])]
    streams = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    if streams:
        batched(depths, int(sys.argv[2]), streams)
    else:
        single(depths, int(sys.argv[2]))
