"""What scoring prompts costs (prompt logprobs, lm-eval's loglikelihood), against mlx-lm scoring the same.

The demo model, one batch engine without kept prefixes (so every request prefills its whole prompt);
ROWS prompts of LENGTH tokens (the bench's held-out text, joined and cut), all opened at once, REPS times
each way, in turn:
- `scored`: max_tokens 0 with each token's log-probability and the most likely other's (what OpenAI's
  echo with logprobs 1 and max_tokens 0 asks);
- `prefill`: the same prompts for one token, not scored: the prefill alone;
- `mlx-lm`: mlx-lm's model over the prompts as one batch (they are all LENGTH long), log-softmax, each
  token's value and the top one, evaluated.
Prints prompt tokens a second (medians) and the ratios; the scores of the first prompt are checked
against mlx-lm's.

    python benchmarks/prompt_scoring.py [REPS] [ROWS] [LENGTH]
"""

from __future__ import annotations

import queue
import statistics
import sys
import time

import mtpipe  # noqa: F401  (first: it puts the optimized BLAS under MLX before mlx.core loads)
import mlx.core as mx
import numpy as np

from mtpipe.coordinator.bench.engine import bench_prompts
from mtpipe.coordinator.engine.build import batch_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.coordinator.engine.sinks import END
from mtpipe.models.registry import DEMO_MODEL
from mtpipe.node.protocol import SamplingParams


def engine_wave(engine: object, prompts: list[list[int]], scored: bool) -> tuple[float, list]:
    sinks: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in prompts]
    start = time.perf_counter()
    for p, sink in zip(prompts, sinks):
        params = SamplingParams(prompt_logprobs=1 if scored else -1)
        engine.open(GenerationRequest(p, 0 if scored else 1, params, mtp_depth=0), sink.put)  # type: ignore[attr-defined]
    first = None
    for i, sink in enumerate(sinks):
        while (item := sink.get(timeout=600)) is not END:
            assert not isinstance(item, BaseException), item
            if i == 0 and item.prompt_logprobs is not None:
                first = item.prompt_logprobs
    return sum(map(len, prompts)) / (time.perf_counter() - start), first


def mlx_lm_wave(model: object, prompts: list[list[int]]) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    tokens = mx.array(prompts)
    logits = model(tokens[:, :-1]).astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    values = mx.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]
    best = mx.max(lp, axis=-1)
    mx.eval(values, best)
    return sum(map(len, prompts)) / (time.perf_counter() - start), np.array(values[0])


def main(reps: int, rows: int, length: int) -> None:
    from mlx_lm import load

    from mtpipe.models import blas

    print(f"BLAS: {blas.info()}")
    engine = batch_engine(DEMO_MODEL, prefix_cache=0)
    joined = [t for p in bench_prompts(16) for t in engine.tokenizer.encode(p)]
    prompts = [(joined * (1 + rows * length // len(joined)))[i * length : (i + 1) * length] for i in range(rows)]
    model, _ = engine.thread.call(lambda: load(str(DEMO_MODEL)))  # (on the engine's MLX thread, as its own work)
    got: dict[str, list[float]] = {"scored": [], "prefill": [], "mlx-lm": []}
    try:
        engine_wave(engine, prompts, True)  # (warm-up)
        ours, theirs = None, None
        for rep in range(reps):
            for way in ("scored", "prefill", "mlx-lm") if rep % 2 == 0 else ("mlx-lm", "prefill", "scored"):
                if way == "mlx-lm":
                    tps, theirs = engine.thread.call(lambda: mlx_lm_wave(model, prompts))
                else:
                    tps, first = engine_wave(engine, prompts, way == "scored")
                    ours = first if way == "scored" else ours
                got[way].append(tps)
    finally:
        engine.close()
    diff = float(np.abs(np.array([s.logprob for s in ours]) - theirs).max())
    med = {k: statistics.median(v) for k, v in got.items()}
    for way, tps in med.items():
        print(f"{way}: {tps:.0f} prompt tokens/s ({', '.join(f'{v:.0f}' for v in got[way])})")
    print(f"{rows} prompts of {length} tokens: scored / prefill {med['scored'] / med['prefill']:.3f}, "
          f"scored / mlx-lm {med['scored'] / med['mlx-lm']:.3f}; largest difference from mlx-lm's scores {diff:.2e}")


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    main(*(args + [3, 8, 512][len(args):]))
