"""Diagnostic: what drafting the tokens min_tokens refuses cost a request that wants to end early.

One batch engine on the demo model; each of the bench's prompts alone, greedy, 96 tokens with
min_tokens 96 and EOS pushed up by a logit bias (so the MTP head, which sees the bias, would draft EOS
where the verify refuses it), at 3 drafts and at auto, REPS times in turn. Prints each depth's median
tok/s and the acceptance. Run it on two commits (PYTHONPATH) to compare.

    python benchmarks/min_tokens_drafts.py [REPS] [BIAS]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from mtpipe.coordinator.bench.engine import bench_prompts
from mtpipe.coordinator.engine.build import batch_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.models.registry import DEMO_MODEL
from mtpipe.node.protocol import SamplingParams

TOKENS = 96


def run(engine: object, prompts: list[list[int]], params: SamplingParams, depth: int,
        auto: bool) -> tuple[float, float]:
    """Tokens per second over the prompts one after another, and the acceptance of their drafts."""
    tokens = drafted = accepted = 0
    start = time.perf_counter()
    for p in prompts:
        r = engine.complete(GenerationRequest(p, max_tokens=TOKENS, params=params, mtp_depth=depth, mtp_auto=auto))
        tokens += len(r.tokens)
        drafted, accepted = drafted + r.stats.drafted, accepted + r.stats.accepted
    return tokens / (time.perf_counter() - start), accepted / max(drafted, 1)


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    bias = float(sys.argv[2]) if len(sys.argv) > 2 else 12.0
    engine = batch_engine(DEMO_MODEL)
    try:
        prompts = [engine.tokenizer.encode(p) for p in bench_prompts(4)]
        eos = sorted(engine.eos)[0]
        params = SamplingParams(logit_bias=((eos, bias),), min_tokens=TOKENS)
        run(engine, prompts[:1], params, 3, False)  # (warm)
        got: dict[str, list[tuple[float, float]]] = {"k3": [], "auto": []}
        for _ in range(reps):
            got["k3"].append(run(engine, prompts, params, 3, False))
            got["auto"].append(run(engine, prompts, params, 3, True))
        print(json.dumps({name: {"tok_s": round(statistics.median(t for t, _ in runs), 1),
                                 "acceptance": round(statistics.median(a for _, a in runs), 3)}
                          for name, runs in got.items()}))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
