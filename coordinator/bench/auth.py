"""What the cluster secret costs (mutual TLS on every link), told apart from the noise between node pairs.

Node processes differ in speed by a few percent on a shared machine, whatever they run, so one pair
with a secret against one pair without measures the pairs as much as TLS. Here two pairs without a
secret (A, B) and one with (C) each form a 2-node pipeline; every trial decodes one prompt on all
three, in an order that rotates through the six permutations. Reported per depth: C against the
mean of A and B, as the median over trials of the per-trial ratio, and B against A, the control:
what two identical pairs differ by here.
"""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path
from typing import Any

from ..engine.build import remote_engine
from ..engine.request import AUTO
from .engine import _time_engine
from .nodes import BENCH_SECRET, NodeProcesses

PAIRS = ("A", "B", "C_auth")


def bench_auth(model_path: Path, prompts: list[list[int]], max_tokens: int, reps: int = 3,
               depths: tuple[int | str, ...] = (0, AUTO)) -> dict[str, Any]:
    orders = list(itertools.permutations(PAIRS))
    speeds: dict[tuple[str, int | str], list[float]] = {(p, k): [] for p in PAIRS for k in depths}
    outputs: dict[tuple[str, int | str], list[list[int]]] = {(p, k): [] for p in PAIRS for k in depths}
    with NodeProcesses(2, model_dirs=[model_path]) as a, NodeProcesses(2, model_dirs=[model_path]) as b, \
            NodeProcesses(2, secret=BENCH_SECRET, model_dirs=[model_path]) as c:
        engines: dict[str, Any] = {}
        try:
            engines["A"] = remote_engine(model_path, a.addresses, mtp=True)
            engines["B"] = remote_engine(model_path, b.addresses, mtp=True)
            engines["C_auth"] = remote_engine(model_path, c.addresses, mtp=True, secret=BENCH_SECRET)
            for engine in engines.values():  # warm up every path once
                for k in depths:
                    _time_engine(engine, prompts[0], 8, k)
            trial = 0  # the same order for every depth of a prompt: each depth sees all six
            for _ in range(reps):
                for prompt in prompts:
                    for k in depths:
                        for pair in orders[trial % len(orders)]:
                            tokens, tps, _ = _time_engine(engines[pair], prompt, max_tokens, k)
                            speeds[pair, k].append(tps)
                            outputs[pair, k].append(tokens)
                    trial += 1
        finally:
            for engine in engines.values():
                engine.close()

    def median_ratio(x: list[float], y: list[float]) -> float:
        return round(statistics.median(u / v for u, v in zip(x, y)), 3)

    out: dict[str, Any] = {"reps": reps, "prompts": len(prompts), "tok_s": {}, "ratios": {}, "identical": {}}
    for k in depths:
        name = "mtp" if k == AUTO else "no_mtp" if k == 0 else f"mtp_k{k}"
        a_s, b_s, c_s = (speeds[p, k] for p in PAIRS)
        out["tok_s"].update({f"{p}_{name}": round(statistics.mean(speeds[p, k]), 2) for p in PAIRS})
        out["ratios"][f"auth_on_vs_off_{name}"] = median_ratio(c_s, [(u + v) / 2 for u, v in zip(a_s, b_s)])
        out["ratios"][f"control_b_vs_a_{name}"] = median_ratio(b_s, a_s)
        out["identical"][name] = outputs["A", k] == outputs["B", k] == outputs["C_auth", k]
    return out
