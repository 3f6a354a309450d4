"""Diagnostic, not a benchmark: a batch engine's tok/s and tokens per CPU second on a fixed workload.

One batch engine (demo model), the bench's first C prompts, REPS runs of 128 greedy tokens each at METHOD
(no_mtp or auto) after one warm-up run; tok/s over the whole runs (prompts included) and tokens per CPU
second of this process (user + system). For an A/B of settings read at import (`MTPIPE_CPU_JIT`,
`MTPIPE_BLAS`), run it once per setting, alternated:

    python benchmarks/batch_cpu.py C REPS METHOD
"""

from __future__ import annotations

import resource
import sys
import time

from mtpipe.coordinator.bench.engine import bench_prompts
from mtpipe.coordinator.bench.serve_nodes import _run
from mtpipe.coordinator.engine.build import batch_engine
from mtpipe.models.registry import DEMO_MODEL


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(streams: int, reps: int, method: str) -> None:
    engine = batch_engine(DEMO_MODEL, max_rows=32, prefix_cache=0)
    try:
        prompts = [list(engine.tokenizer.encode(t)) for t in bench_prompts(8)][:streams]
        _run(engine, prompts, 128, method)
        cpu, start, tokens = cpu_seconds(), time.perf_counter(), 0
        for _ in range(reps):
            tokens += sum(map(len, _run(engine, prompts, 128, method)[2]))
        wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
        print(f"{tokens / wall:.1f} tok/s wall, {tokens / cpu:.1f} tok per CPU s")
    finally:
        engine.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
