"""Diagnostic, not a benchmark: how many cores the single node and a ring of 2 node processes use at C
streams, and so their tokens per core-second.

The in-process batch engine and a ring over 2 node processes (the ring's own choice of groups), each
at no MTP and auto, the serve bench's prompts, 128 tokens each, PASSES times. Cores: the CPU seconds
(user + system, all threads) of this process, and for the ring of the node processes too, over each
run's wall time; tokens per CPU second: every token of the run (prompts' first ones too) over them.

    python benchmarks/ring_cores.py PASSES C
"""

from __future__ import annotations

import sys
import time
from contextlib import ExitStack
from pathlib import Path

import psutil

import mtpipe  # noqa: F401  (the optimized BLAS before MLX)
from mtpipe.coordinator.bench.engine import bench_prompts
from mtpipe.coordinator.bench.nodes import spawn_nodes
from mtpipe.coordinator.bench.serve_nodes import _run
from mtpipe.coordinator.engine.build import batch_engine, ring_engine

MODEL = Path(__file__).resolve().parent.parent / "models" / "demo"


def cpu_seconds(procs: list[psutil.Process]) -> float:
    return sum(t.user + t.system for t in (p.cpu_times() for p in procs))


def main() -> None:
    passes, streams = int(sys.argv[1]), int(sys.argv[2])
    with ExitStack() as stack:
        single = batch_engine(MODEL, max_rows=32, prefix_cache=0)
        stack.callback(single.close)
        ring = ring_engine(MODEL, stack.enter_context(spawn_nodes(2, MODEL)), mtp=True, max_rows=32, prefix_cache=0)
        stack.callback(ring.close)
        me = psutil.Process()
        nodes = me.children(recursive=True)
        prompts = [list(single.tokenizer.encode(t)) for t in bench_prompts(streams)][:streams]
        for engine in (single, ring):
            for method in ("no_mtp", "auto"):
                _run(engine, prompts, 8, method)
        for p in range(passes):
            for name, engine in (("single", single), ("pipe2", ring)):
                procs = [me, *nodes] if engine is ring else [me]
                for method in ("no_mtp", "auto"):
                    before, start = cpu_seconds(procs), time.perf_counter()
                    decode, _, tokens = _run(engine, prompts, 128, method)
                    wall, cpu = time.perf_counter() - start, cpu_seconds(procs) - before
                    print(p, name, method, f"decode {decode.tps:.1f} tok/s, {cpu / wall:.2f} cores, "
                          f"{sum(map(len, tokens)) / cpu:.0f} tokens per CPU second", flush=True)


if __name__ == "__main__":
    main()
