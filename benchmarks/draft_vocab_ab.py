"""Diagnostic, not a benchmark: drafts over the draft vocabulary against drafts over the whole vocabulary.

Two engines on the demo model, one with the default draft vocabulary and one with `draft_vocab=0`;
every prompt runs on both, in an order that alternates, PASSES times over the bench prompts. Prints
the median and mean of the per-prompt ratios (draft vocabulary / whole) and both acceptances. With
STREAMS > 1, two batch engines instead, STREAMS concurrent streams per run (one ratio per run).

    python benchmarks/draft_vocab_ab.py DEPTH|auto PASSES [STREAMS]
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


def report(depth: int | str, ratios: list[float], extra: str) -> None:
    print(f"depth {depth}: {len(ratios)} pairs, draft vocabulary / whole: median {statistics.median(ratios):.3f}, "
          f"mean {statistics.mean(ratios):.3f}; {extra}")


def single(depth: int | str, passes: int) -> None:
    engines = {"draft_vocab": local_engine(DEMO_MODEL), "whole": local_engine(DEMO_MODEL, draft_vocab=0)}
    prompts = [engines["whole"].tokenizer.encode(t) for t in bench_prompts(8)]
    for engine in engines.values():
        _time_engine(engine, prompts[0], 16, depth)
    ratios: list[float] = []
    counts = {name: [0, 0] for name in engines}  # accepted, drafted
    for n in range(passes):
        for i, prompt in enumerate(prompts):
            names = list(engines) if (i + n) % 2 == 0 else list(reversed(engines))
            speed = {}
            for name in names:
                _, speed[name], stats = _time_engine(engines[name], prompt, 128, depth)
                counts[name][0] += stats.accepted
                counts[name][1] += stats.drafted
            ratios.append(speed["draft_vocab"] / speed["whole"])
    vocab = engines["draft_vocab"].pipeline.stages[-1].head.vocab
    report(depth, ratios, "acceptance " + ", ".join(f"{name} {a / max(d, 1):.3f}" for name, (a, d) in counts.items())
           + f"; {vocab.describe()}")


def batched(depth: int | str, passes: int, streams: int) -> None:
    engines: dict[str, Any] = {"draft_vocab": batch_engine(DEMO_MODEL, max_rows=streams),
                               "whole": batch_engine(DEMO_MODEL, max_rows=streams, draft_vocab=0)}
    drafts, auto = resolve_depth(depth, True)

    def run(engine: Any, prompts: list[list[int]], max_tokens: int) -> float:
        recs = [Recorder() for _ in prompts]
        for prompt, rec in zip(prompts, recs):
            engine.open(GenerationRequest(prompt, max_tokens=max_tokens, mtp_depth=drafts, mtp_auto=auto), rec)
        for rec in recs:
            rec.wait()
        return aggregate_tps([(r.times, r.counts) for r in recs])

    try:
        texts = bench_prompts(8)
        prompts = [list(engines["whole"].tokenizer.encode(texts[i % len(texts)])) for i in range(streams)]
        for engine in engines.values():
            run(engine, prompts, 16)
        ratios = []
        for n in range(passes):
            speed = {name: run(engines[name], prompts, 128)
                     for name in (list(engines) if n % 2 == 0 else list(reversed(engines)))}
            ratios.append(speed["draft_vocab"] / speed["whole"])
        report(depth, ratios, f"{streams} streams")
    finally:
        for engine in engines.values():
            engine.close()


if __name__ == "__main__":
    depth = AUTO if sys.argv[1] == "auto" else int(sys.argv[1])
    streams = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    if streams > 1:
        batched(depth, int(sys.argv[2]), streams)
    else:
        single(depth, int(sys.argv[2]))
