"""Diagnostic, not a benchmark: what holding output to a JSON schema costs a decode, alone and in a batch.

One batch engine on the demo model; ROWS streams of 128 greedy tokens (ignore_eos) on the bench's
prompts, free and held to a schema whose one field is a long string (the model writes into it), without
MTP and with auto, in turn, REPS times. Prints each's aggregate tok/s (median), held over free, and the
share of drafts accepted.

    python benchmarks/formats_cost.py [REPS] [ROWS]
"""

from __future__ import annotations

import statistics
import sys
import time

from mtpipe.coordinator.bench.engine import bench_prompts
from mtpipe.coordinator.engine.build import batch_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.coordinator.engine.sinks import END
from mtpipe.models.registry import DEMO_MODEL
from mtpipe.node.constraints import grammar_of_schema
from mtpipe.node.protocol import SamplingParams

SCHEMA = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}
TOKENS = 128


def wave(engine: object, prompts: list[list[int]], grammar: str | None, auto: bool) -> tuple[float, int, int]:
    """One wave of streams opened at once: aggregate tok/s, drafts made, drafts accepted."""
    import queue

    sinks: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in prompts]
    start = time.perf_counter()
    for p, sink in zip(prompts, sinks):
        req = GenerationRequest(p, TOKENS, SamplingParams(grammar=grammar), mtp_depth=3 if auto else 0,
                                mtp_auto=auto, ignore_eos=True)
        engine.open(req, sink.put)  # type: ignore[attr-defined]
    tokens = drafted = accepted = 0
    for sink in sinks:
        while (item := sink.get(timeout=600)) is not END:
            assert not isinstance(item, BaseException), item
            tokens += len(item.tokens)
            if item.finish_reason:
                drafted, accepted = drafted + item.stats.drafted, accepted + item.stats.accepted
    return tokens / (time.perf_counter() - start), drafted, accepted


def main(reps: int, rows: int) -> None:
    engine = batch_engine(DEMO_MODEL)
    prompts = [engine.tokenizer.encode(p) for p in bench_prompts(rows)]
    grammar = grammar_of_schema(SCHEMA)
    ways = [(held, auto) for auto in (False, True) for held in (False, True)]
    got: dict[tuple[bool, bool], list[float]] = {w: [] for w in ways}
    drafts: dict[tuple[bool, bool], list[int]] = {w: [0, 0] for w in ways}
    try:
        wave(engine, prompts, grammar, True)  # (warm-up: compiled shapes, the depth plan)
        for rep in range(reps):
            for held, auto in ways if rep % 2 == 0 else ways[::-1]:
                tps, d, a = wave(engine, prompts, grammar if held else None, auto)
                got[held, auto].append(tps)
                drafts[held, auto][0] += d
                drafts[held, auto][1] += a
    finally:
        engine.close()
    for auto in (False, True):
        free, held = statistics.median(got[False, auto]), statistics.median(got[True, auto])
        acc = [f"{drafts[h, auto][1] / drafts[h, auto][0]:.2f}" if drafts[h, auto][0] else "-" for h in (False, True)]
        print(f"{rows} rows, {'auto' if auto else 'no MTP'}: free {free:.1f} tok/s, held {held:.1f} tok/s: "
              f"{held / free:.3f}; drafts accepted free {acc[0]}, held {acc[1]}")


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    main(*(args + [3, 8][len(args):]))
