"""Diagnostic, not a benchmark: a ring of 2 node processes at C streams with the groups in flight fixed
at each of G1,G2,..., against the ring's own choice (`auto`).

The serve bench's prompts, 128 tokens each, every count back to back in each of PASSES passes; prints
per pass the aggregate decode tok/s and each node's ms per round, rounds and busy share (its own
counters), and the medians; at the end, what the engine chooses from (the nodes' fitted rounds, the hops).

    python benchmarks/ring_groups.py PASSES C G1,G2,... [no_mtp|auto]
"""

from __future__ import annotations

import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import mtpipe  # noqa: F401  (the optimized BLAS before MLX)
from mtpipe.coordinator.bench.engine import bench_prompts
from mtpipe.coordinator.bench.nodes import spawn_nodes
from mtpipe.coordinator.bench.serve_nodes import _breakdown, _node_counters, _run
from mtpipe.coordinator.engine.build import ring_engine

MODEL = Path(__file__).resolve().parent.parent / "models" / "demo"


def main() -> None:
    passes, streams = int(sys.argv[1]), int(sys.argv[2])
    counts = sys.argv[3].split(",")
    method = sys.argv[4] if len(sys.argv) > 4 else "no_mtp"
    with ExitStack() as stack:
        engine = ring_engine(MODEL, stack.enter_context(spawn_nodes(2, MODEL)), mtp=True, max_rows=32,
                             prefix_cache=0)
        stack.callback(engine.close)
        prompts = [list(engine.tokenizer.encode(t)) for t in bench_prompts(streams)][:streams]
        _run(engine, prompts, 8, method)  # warm-up
        tok_s: dict[str, list[float]] = {g: [] for g in counts}
        for p in range(passes):
            for g in counts:
                _run(engine, prompts, 8, method)  # (the rows' first rounds at this count; then they leave)
                with engine._lock:
                    engine.fixed_groups = None if g == "auto" else int(g)
                    engine.groups = engine.groups if g == "auto" else int(g)
                    engine._rows_peak = max(engine._rows_peak, streams)  # (as if its watch looked now)
                if g == "auto":
                    engine._refresh_groups()
                before, start = _node_counters(engine), time.perf_counter()
                decode, _, tokens = _run(engine, prompts, 128, method)
                nodes = _breakdown(before, _node_counters(engine), sum(map(len, tokens)),
                                   time.perf_counter() - start)["nodes"]
                tok_s[g].append(decode.tps)
                print(p, f"groups {g} ({engine.groups})", round(decode.tps, 1),
                      [(n["ms_per_step"], n["steps"], n["busy"]) for n in nodes], flush=True)
        print("median", {g: round(statistics.median(v), 1) for g, v in tok_s.items()})
        health = engine.pipeline.health(probe_next=True)
        rounds = [(round(h.round_fixed_ms, 2), round(h.round_row_ms, 3)) for h in health]
        print("rounds (fixed ms, ms per row):", rounds, "hops (ms, round trip):", [round(h.next_rtt_ms, 3) for h in health])


if __name__ == "__main__":
    main()
