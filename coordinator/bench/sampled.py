"""`mtpipe bench sampled`: how many drafts sampled requests accept, unseeded against seeded.

Unseeded requests accept a draft with probability min(1, p/q); seeded ones pick every token and draft
with Gumbel noise keyed by (seed, position, token), so their tokens do not depend on the drafts, and
accept somewhat less (node/acceptance.py). Both run the same prompts, temperatures and depths back to
back on the single-node engine; the figures are drafts accepted and tokens per round.
"""

from __future__ import annotations

from typing import Any

from ...node.protocol import SamplingParams
from ..engine.build import local_engine
from ..engine.request import GenerationRequest
from .engine import bench_prompts

SETTINGS = ((0.7, 0.95), (1.0, 1.0))  # (temperature, top_p)


def bench_sampled(model: str, max_tokens: int = 128, prompts: int = 8, depths: list[int] | None = None,
                  runs: int = 3) -> dict[str, Any]:
    engine = local_engine(model)
    texts = [engine.tokenizer.encode(p) for p in bench_prompts(prompts)]
    rows = []
    for temperature, top_p in SETTINGS:
        for depth in depths or [1, 2, 3]:
            row: dict[str, Any] = {"temperature": temperature, "top_p": top_p, "depth": depth}
            for kind in ("unseeded", "seeded"):
                drafted = accepted = tokens = rounds = 0
                for i, prompt in enumerate(texts):
                    for run in range(runs):
                        seed = 1000 * i + run if kind == "seeded" else None
                        params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
                        s = engine.complete(GenerationRequest(prompt, max_tokens=max_tokens, mtp_depth=depth,
                                                              params=params)).stats
                        drafted, accepted = drafted + s.drafted, accepted + s.accepted
                        tokens, rounds = tokens + s.generation_tokens, rounds + s.rounds
                row[kind] = {"acceptance": accepted / max(drafted, 1), "tokens_per_round": tokens / max(rounds, 1)}
            row["seeded_vs_unseeded_tokens_per_round"] = (row["seeded"]["tokens_per_round"]
                                                         / row["unseeded"]["tokens_per_round"])
            rows.append(row)
    return {"max_tokens": max_tokens, "prompts": prompts, "runs": runs, "rows": rows}


def print_report(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"sampled MTP: {result['prompts']} prompts x {result['runs']} runs, "
                        f"{result['max_tokens']} tokens")
    for col in ("temp", "top_p", "depth", "unseeded accept", "seeded accept", "unseeded tok/round",
                "seeded tok/round", "seeded / unseeded"):
        table.add_column(col)
    for r in result["rows"]:
        table.add_row(f"{r['temperature']:g}", f"{r['top_p']:g}", str(r["depth"]),
                      f"{r['unseeded']['acceptance']:.3f}", f"{r['seeded']['acceptance']:.3f}",
                      f"{r['unseeded']['tokens_per_round']:.3f}", f"{r['seeded']['tokens_per_round']:.3f}",
                      f"{r['seeded_vs_unseeded_tokens_per_round']:.3f}")
    console.print(table)
