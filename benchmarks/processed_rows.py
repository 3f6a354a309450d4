"""Side by side, not a target: `auto` against no MTP for rows whose logits are processed (a presence
penalty), in the batch engine on the demo model, greedy.

At each concurrency: waves of the eight bench prompts, c at a time, 96 tokens each (`bench serve`'s
waves: tokens after every stream started, to the last chunk), then the closed loop (`bench serve`'s:
c clients, each sending its next request as the last ends, 4 requests each of spread lengths up to
128 tokens). Each run prints one JSON line of tok/s and auto / no MTP.

    python benchmarks/processed_rows.py REPS [PENALTY]
"""

from __future__ import annotations

import json
import sys

from mtpipe.coordinator.bench import serve
from mtpipe.coordinator.bench.engine import bench_prompts
from mtpipe.coordinator.engine.build import batch_engine
from mtpipe.models.registry import DEMO_MODEL
from mtpipe.node.protocol import SamplingParams

LEVELS = (1, 4)
METHODS = ("no_mtp", "auto")


def waves(engine: object, prompts: list[list[int]], params: SamplingParams, c: int, method: str) -> float:
    tokens = seconds = 0.0
    for wave in serve.waves(len(prompts), c):
        decode = serve.engine_run(engine, [prompts[i] for i in wave], 96, method, [params] * c)[0]
        tokens, seconds = tokens + decode.tokens, seconds + decode.seconds
    return tokens / seconds


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    params = SamplingParams(presence_penalty=float(sys.argv[2]) if len(sys.argv) > 2 else 0.3)
    engine = batch_engine(DEMO_MODEL, max_rows=8, prefix_cache=0)
    try:
        prompts = [list(engine.tokenizer.encode(t)) for t in bench_prompts(8)]
        for c in LEVELS:  # warm-up: every shape and both methods once
            for method in METHODS:
                serve.engine_run(engine, prompts[:c], 16, method, [params] * c)
            serve.closed_loop(engine, None, prompts, [params] * len(prompts), c, 16, 0.0, 2)
        for rep in range(reps):
            out: dict[str, float] = {}
            for c in LEVELS:
                for method in METHODS:
                    out[f"waves_c{c}_{method}"] = round(waves(engine, prompts, params, c, method), 1)
                closed, _ = serve.closed_loop(engine, None, prompts, [params] * len(prompts), c, 128, 0.0, 4)
                out.update({f"closed_c{c}_{m}": round(closed[m], 1) for m in METHODS})
                for level in ("waves", "closed"):
                    auto, plain = out[f"{level}_c{c}_auto"], out[f"{level}_c{c}_no_mtp"]
                    out[f"{level}_c{c}_auto_vs_no_mtp"] = round(auto / plain, 3)
            print(json.dumps({"rep": rep, "presence_penalty": params.presence_penalty, **out}), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
