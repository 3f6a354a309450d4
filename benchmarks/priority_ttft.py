"""What priority scheduling does for one interactive request behind a queue of batch work.

One batch engine on the demo model with room for ROWS rows at once (`max_rows`); BATCH greedy requests
of BATCH_TOKENS tokens (no drafts, end tokens ignored) are opened at once, then after a moment one short
request of SHORT_TOKENS tokens. "fcfs": all at priority 0 (what `--scheduling-policy fcfs` allows);
"priority": the short one at -1 (served first: vLLM's order). Prints per way the short request's time to
its first token and to its end, and the batch's aggregate tok/s (medians over REPS waves, the ways
alternated), and the priority/fcfs ratios.

    python benchmarks/priority_ttft.py [REPS]
"""

from __future__ import annotations

import json
import queue
import statistics
import sys
import time

import mtpipe  # noqa: F401  (the optimized BLAS before MLX)
from mtpipe.coordinator.bench.engine import bench_prompts
from mtpipe.coordinator.engine.build import batch_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.coordinator.engine.sinks import END
from mtpipe.models.registry import DEMO_MODEL

ROWS, BATCH, BATCH_TOKENS, SHORT_TOKENS, SHORT_AFTER_S = 4, 12, 256, 16, 0.3


def wave(engine: object, prompts: list[list[int]], short_priority: int) -> tuple[float, float, float]:
    sinks: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(BATCH + 1)]
    start = time.perf_counter()
    for p, sink in zip(prompts[:BATCH], sinks):
        req = GenerationRequest(p, BATCH_TOKENS, ignore_eos=True)
        engine.open(req, lambda item, s=sink: s.put((time.perf_counter(), item)))  # type: ignore[attr-defined]
    time.sleep(SHORT_AFTER_S)
    short = GenerationRequest(prompts[BATCH], SHORT_TOKENS, ignore_eos=True, priority=short_priority)
    asked = time.perf_counter()
    engine.open(short, lambda item: sinks[-1].put((time.perf_counter(), item)))  # type: ignore[attr-defined]
    ends, first, tokens = [], None, 0
    for i, sink in enumerate(sinks):
        while True:
            at, item = sink.get(timeout=600)
            if isinstance(item, BaseException):
                raise item
            if item is END:
                ends.append(at)
                break
            if i == BATCH:
                first = first or at
            else:
                tokens += len(item.tokens)
    assert first is not None
    return first - asked, ends[-1] - asked, tokens / (max(ends[:-1]) - start)


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    engine = batch_engine(DEMO_MODEL, max_rows=ROWS)
    try:
        prompts = [list(engine.tokenizer.encode(t)) for t in bench_prompts(BATCH + 1)]
        wave(engine, prompts, 0)  # (warm-up)
        got: dict[str, list[tuple[float, float, float]]] = {"fcfs": [], "priority": []}
        for r in range(reps):
            for way in (("fcfs", "priority") if r % 2 == 0 else ("priority", "fcfs")):
                got[way].append(wave(engine, prompts, -1 if way == "priority" else 0))
    finally:
        engine.close()
    out = {way: {"short_ttft_s": statistics.median(x[0] for x in runs), "short_end_s": statistics.median(x[1] for x in runs),
                 "batch_tok_s": statistics.median(x[2] for x in runs)} for way, runs in got.items()}
    for way, m in out.items():
        print(f"{way:9s} short request: first token {m['short_ttft_s']:.3f} s, end {m['short_end_s']:.3f} s; "
              f"batch {m['batch_tok_s']:.1f} tok/s")
    ratios = {k: round(out["priority"][k] / out["fcfs"][k], 3) for k in ("short_ttft_s", "short_end_s", "batch_tok_s")}
    print(json.dumps({"rows": ROWS, "batch": BATCH, "reps": reps, **{w: {k: round(v, 4) for k, v in m.items()}
                                                                        for w, m in out.items()}, "ratios": ratios}))


if __name__ == "__main__":
    main()
