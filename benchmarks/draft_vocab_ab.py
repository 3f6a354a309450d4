"""Diagnostic, not a benchmark: drafts over the draft vocabulary against drafts over the whole vocabulary.

Two engines on the demo model, one with the default draft vocabulary and one with `draft_vocab=0`;
every prompt runs on both, in an order that alternates, PASSES times over the bench prompts. Prints
the median and mean of the per-prompt ratios (draft vocabulary / whole) and both acceptances.

    python benchmarks/draft_vocab_ab.py DEPTH|auto PASSES
"""

from __future__ import annotations

import statistics
import sys

from mtpipe.coordinator.bench.engine import _time_engine, bench_prompts
from mtpipe.coordinator.engine.build import local_engine
from mtpipe.coordinator.engine.request import AUTO
from mtpipe.models.registry import DEMO_MODEL


def main(depth: int | str, passes: int) -> None:
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
    print(f"depth {depth}: {len(ratios)} pairs, draft vocabulary / whole: median {statistics.median(ratios):.3f}, "
          f"mean {statistics.mean(ratios):.3f}; acceptance "
          + ", ".join(f"{name} {a / max(d, 1):.3f}" for name, (a, d) in counts.items())
          + f"; {vocab.describe()}")


if __name__ == "__main__":
    main(AUTO if sys.argv[1] == "auto" else int(sys.argv[1]), int(sys.argv[2]))
