"""Admission by a horizon with preemption, against admission by all of max_tokens, on one batch engine, or
(`--nodes N`) on the ring engine over N node processes (each node's budget for its own layers).

The demo model, 8 streams opened at once, auto MTP, each asking max_tokens 4096 (a client that leaves
max_tokens out gets far more) but ending after about REPLY tokens (sampled with a seed, each stops at a
token it first gives there), so both ways produce the same tokens. The
memory budget is what ROOM rows need at their max_tokens; the horizon admits what fits with room for 256
tokens more, and preempts where the rows outgrow the budget after all. Two cases:
  short: replies of 128 tokens, room for 2 rows at their max_tokens;
  long: replies of 1024 tokens, the budget shrunk to what 2 rows need at 1100 tokens
        (rows admitted by the horizon outgrow it: preemptions).
Prints per case and way the aggregate tok/s (wave wall time), the mean time to the first token and
the preemptions (medians over REPS waves each, the ways alternated), and horizon/reserve ratios.
Over nodes, each budget is what the node with the most attention layers needs (the MTP layer's included).

    python benchmarks/admit_horizon.py [REPS] [--nodes N]
"""

from __future__ import annotations

import argparse
import dataclasses
import queue
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import mtpipe  # noqa: F401  (the optimized BLAS before MLX)
from mtpipe.coordinator.bench.engine import bench_prompts
from mtpipe.coordinator.bench.nodes import spawn_nodes
from mtpipe.coordinator.engine import scheduler as plan
from mtpipe.coordinator.engine.build import batch_engine, ring_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.coordinator.engine.sinks import END
from mtpipe.models.registry import DEMO_MODEL
from mtpipe.node.protocol import SamplingParams

ROWS, MAX_TOKENS, DEPTH = 8, 4096, 3


def requests(engine: object, prompts: list[list[int]], reply: int) -> list[GenerationRequest]:
    """Each prompt asking MAX_TOKENS, sampled with a seed of its own, ending after about `reply` tokens:
    at the first token from there on that it gave nowhere before (the demo model's greedy replies loop)."""
    out = []
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=1.0, seed=i)
        req = GenerationRequest(p, MAX_TOKENS, params, mtp_depth=DEPTH, mtp_auto=True, ignore_eos=True)
        alone = engine.complete(dataclasses.replace(req, max_tokens=reply + 64)).tokens  # type: ignore[attr-defined]
        at = next(j for j in range(reply - 1, len(alone)) if alone[j] not in alone[:j])
        out.append(dataclasses.replace(req, stop_token_ids=[alone[at]]))
    return out


def wave(engine: object, reqs: list[GenerationRequest]) -> tuple[float, float, int]:
    sinks: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in reqs]
    start = time.perf_counter()
    for req, sink in zip(reqs, sinks):
        engine.open(req, lambda item, s=sink: s.put((time.perf_counter(), item)))  # type: ignore[attr-defined]
    tokens, firsts, preempted = 0, [], 0
    for sink in sinks:
        first = None
        while (got := sink.get(timeout=900))[1] is not END:
            at, item = got
            assert not isinstance(item, BaseException), item
            first = first or at
            tokens += len(item.tokens)
            if item.stats is not None:
                preempted += item.stats.preempted
        firsts.append(first - start)
    return tokens / (time.perf_counter() - start), statistics.mean(firsts), preempted


def batch(stack: ExitStack) -> tuple[Any, plan.ModelDims, Callable[[int | None, int], None]]:
    """The batch engine, its dims, and how to set its horizon and budget."""
    engine = batch_engine(DEMO_MODEL, prefix_cache=0)
    stack.callback(engine.close)

    def setup(horizon: int | None, budget: int) -> None:
        engine.thread.call(lambda: (setattr(engine, "horizon", horizon), setattr(engine, "budget", budget)))
    return engine, engine.dims, setup


def ring(stack: ExitStack, nodes: int) -> tuple[Any, plan.ModelDims, Callable[[int | None, int], None]]:
    """The ring engine over node processes, the dims of its fullest node, and how to set every node's."""
    engine = ring_engine(DEMO_MODEL, stack.enter_context(spawn_nodes(nodes, DEMO_MODEL)), prefix_cache=0)
    stack.callback(engine.close)
    health = engine.pipeline.health()

    def setup(horizon: int | None, budget: int) -> None:
        engine.room.horizon = horizon
        engine.room.rebudget(budget, health)
    return engine, max((n.dims for n in engine.room.nodes), key=lambda d: d.kv_bytes_per_token), setup


def main(reps: int, nodes: int) -> None:
    with ExitStack() as stack:
        engine, dims, setup = ring(stack, nodes) if nodes > 1 else batch(stack)
        run(engine, dims, setup, reps)


def run(engine: Any, dims: plan.ModelDims, setup: Callable[[int | None, int], None], reps: int) -> None:
    prompts = [engine.tokenizer.encode(p) for p in bench_prompts(ROWS)]
    longest = max(len(p) for p in prompts)
    full = plan.footprint(longest + MAX_TOKENS, DEPTH)
    cases = {"short": (128, plan.batch_bytes(dims, [full] * 2)),
             "long": (1024, plan.batch_bytes(dims, [plan.footprint(longest + 1100, DEPTH)] * 2))}
    ways = {"reserve": None, "horizon": plan.ADMIT_HORIZON}
    for case, (reply, budget) in cases.items():
        reqs = requests(engine, prompts, reply)
        got: dict[str, list[tuple[float, float, int]]] = {w: [] for w in ways}
        for rep in range(reps):
            for way in list(ways) if rep % 2 == 0 else list(ways)[::-1]:
                setup(ways[way], budget)
                got[way].append(wave(engine, reqs))
        med = {w: [statistics.median(x[i] for x in runs) for i in range(3)] for w, runs in got.items()}
        for way, (tps, ttft, pre) in med.items():
            print(f"{case} (replies {reply}, budget {budget / 2**20:.1f} MiB) {way}: {tps:.1f} tok/s, "
                  f"mean TTFT {ttft:.2f} s, {pre:.0f} preemptions")
        print(f"{case}: horizon/reserve tok/s {med['horizon'][0] / med['reserve'][0]:.3f}, "
              f"TTFT {med['horizon'][1] / med['reserve'][1]:.3f}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reps", type=int, nargs="?", default=3)
    parser.add_argument("--nodes", type=int, default=1, help="over N node processes (the ring engine)")
    args = parser.parse_args()
    main(args.reps, args.nodes)
