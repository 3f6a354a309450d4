"""Diagnostic, not a benchmark: what wake-ups elsewhere on the machine cost the batch engine at 8 streams.

Streaming through the HTTP API wakes the API's event loop and the clients about once per token (8 per
round at 8 streams). This runs the engine level of `bench serve` (8 streams, no MTP, 128 tokens) alone,
then again while another process wakes up as often (8 pipe round trips per period, a little work
each) and does nothing else, REPS times; it prints both and their ratio.

    python benchmarks/wakeups_c8.py REPS [WAKEUPS_PER_S]
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from typing import Any

from mtpipe.coordinator.bench.engine import bench_prompts
from mtpipe.coordinator.bench.serve import engine_run
from mtpipe.coordinator.engine.build import batch_engine
from mtpipe.models.registry import DEMO_MODEL


def wake(rate: float, stop: Any) -> None:
    r, w = os.pipe()
    period = 8.0 / rate
    while not stop.is_set():
        start = time.perf_counter()
        for _ in range(8):
            os.write(w, b"x")
            os.read(r, 1)
            sum(range(200))
        time.sleep(max(0.0, period - (time.perf_counter() - start)))


def main(reps: int, rate: float) -> None:
    engine = batch_engine(DEMO_MODEL, max_rows=16)
    prompts = [list(engine.tokenizer.encode(t)) for t in bench_prompts(8)]
    engine_run(engine, prompts, 16, "no_mtp")
    ctx = multiprocessing.get_context("spawn")
    try:
        for _ in range(reps):
            quiet = engine_run(engine, prompts, 128, "no_mtp")[0].tps
            stop = ctx.Event()
            waker = ctx.Process(target=wake, args=(rate, stop))
            waker.start()
            time.sleep(0.5)
            busy = engine_run(engine, prompts, 128, "no_mtp")[0].tps
            stop.set()
            waker.join()
            print(f"alone {quiet:.0f} tok/s, with {rate:.0f} wake-ups/s elsewhere {busy:.0f} tok/s: {busy / quiet:.3f}")
    finally:
        engine.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 1100.0)
