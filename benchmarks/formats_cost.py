"""Diagnostic, not a benchmark: what holding output to a JSON schema costs a decode, alone and in a batch.

One batch engine on the demo model; ROWS streams of 128 greedy tokens (ignore_eos) on the bench's
prompts, free and held to a JSON schema, without MTP and with auto, in turn, REPS times. Two schemas:
`prose`, one long string field the model writes into; `record`, twelve required fields of small integers,
whose keys and punctuation the grammar forces (drafted as they are forced). Prints each's aggregate
tok/s (median), held over free, and the share of drafts accepted.

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

FIELDS = [f"field_{i}" for i in range(12)]
SCHEMAS = {
    "prose": {"type": "object", "properties": {"code": {"type": "string", "minLength": 600}}, "required": ["code"],
              "additionalProperties": False},
    "record": {"type": "object", "properties": {k: {"type": "integer", "minimum": 0, "maximum": 99} for k in FIELDS},
               "required": FIELDS, "additionalProperties": False},
}
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
    ways = [(held, auto) for auto in (False, True) for held in (None, *SCHEMAS)]
    got: dict[tuple[str | None, bool], list[float]] = {w: [] for w in ways}
    drafts: dict[tuple[str | None, bool], list[int]] = {w: [0, 0] for w in ways}
    grammars = {name: grammar_of_schema(schema) for name, schema in SCHEMAS.items()}
    try:
        wave(engine, prompts, grammars["record"], True)  # (warm-up: compiled shapes, the depth plan)
        for rep in range(reps):
            for held, auto in ways if rep % 2 == 0 else ways[::-1]:
                tps, d, a = wave(engine, prompts, grammars[held] if held else None, auto)
                got[held, auto].append(tps)
                drafts[held, auto][0] += d
                drafts[held, auto][1] += a
    finally:
        engine.close()
    for held, auto in ways:
        tps, free = statistics.median(got[held, auto]), statistics.median(got[None, auto])
        made, taken = drafts[held, auto]
        print(f"{rows} rows, {'auto' if auto else 'no MTP'}, {held or 'free'}: {tps:.1f} tok/s, {tps / free:.3f} of free"
              + (f", drafts accepted {taken / made:.2f}" if made else ""))


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    main(*(args + [3, 8][len(args):]))
