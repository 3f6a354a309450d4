"""Diagnostic, not a benchmark: the HTTP API in the engine's process against the API in a process of its own.

One batch engine on the demo model; the API app served twice over it, on a uvicorn thread of this process
(`mtpipe serve --api-in-process`) and in a spawned front process (the default, coordinator/api/front.py);
the bench's client process. REPS times, C streams of 128 tokens at once (METHOD: no_mtp or auto): the
engine level, the two API levels (their order alternating from one repetition to the next), the engine
level again. Prints each repetition's tok/s, each API level over the mean of the two engine runs around
it, and the medians. Before that, three rounds of the three levels with the CPU each process used per
token (this one's holds the engine, and the thread-served API when that runs; the clients' process
parses the streams).

    python benchmarks/api_process_ab.py REPS [C] [METHOD]
"""

from __future__ import annotations

import logging
import statistics
import sys
import time

import psutil

from mtpipe.coordinator.api.front import FrontProcess, FrontSpec
from mtpipe.coordinator.bench.engine import bench_prompts
from mtpipe.coordinator.bench.serve import WARM_TOKENS, api_run, engine_run
from mtpipe.coordinator.bench.serve_api import MODEL_NAME, Clients, LiveServer
from mtpipe.coordinator.engine.build import batch_engine
from mtpipe.models.registry import DEMO_MODEL

TOKENS = 128


def main(reps: int, c: int, method: str) -> None:
    engine = batch_engine(DEMO_MODEL)
    thread = LiveServer(engine)
    front = FrontProcess(engine, FrontSpec(str(DEMO_MODEL), model_name=MODEL_NAME, access_log=False,
                                           log_level=logging.WARNING))
    clients = Clients()
    try:
        prompts = [list(engine.tokenizer.encode(t)) for t in bench_prompts(c)][:c]
        thread.start()
        start = time.perf_counter()
        front.start()
        print(f"front process up in {time.perf_counter() - start:.1f} s", flush=True)
        levels = {"engine": lambda n: engine_run(engine, prompts, n, method)[0],
                  "api-thread": lambda n: api_run(clients, thread.url, prompts, n, method),
                  "api-process": lambda n: api_run(clients, front.url, prompts, n, method)}
        for _ in range(2):
            for run in levels.values():
                run(WARM_TOKENS)
        me, kid = psutil.Process(), psutil.Process(front.process.pid)
        client_pid, = clients.pool._processes  # the clients' one process, started by the warm-up
        streams = psutil.Process(client_pid)

        def cpu(p: psutil.Process) -> float:
            t = p.cpu_times()
            return t.user + t.system

        for _ in range(3):
            for name, run in levels.items():
                a, b, k = cpu(me), cpu(kid), cpu(streams)
                d = run(TOKENS)
                mine, front_s = 1e3 * (cpu(me) - a) / d.tokens, 1e3 * (cpu(kid) - b) / d.tokens
                print(f"{name}: {d.tps:.0f} tok/s; CPU per token: this process {mine:.2f} ms, "
                      f"front process {front_s:.2f} ms, clients {1e3 * (cpu(streams) - k) / d.tokens:.2f} ms",
                      flush=True)
        rows = []
        for r in range(reps):
            order = ("api-thread", "api-process") if r % 2 == 0 else ("api-process", "api-thread")
            e1 = levels["engine"](TOKENS).tps
            got = {name: levels[name](TOKENS).tps for name in order}
            e2 = levels["engine"](TOKENS).tps
            t, f = got["api-thread"] / ((e1 + e2) / 2), got["api-process"] / ((e1 + e2) / 2)
            rows.append((t, f))
            print(f"rep {r}: engine {e1:.0f} / {e2:.0f}, api-thread {got['api-thread']:.0f} ({t:.3f}), "
                  f"api-process {got['api-process']:.0f} ({f:.3f})", flush=True)
        if rows:
            print(f"median over the engine: api-thread {statistics.median(t for t, _ in rows):.3f}, api-process "
                  f"{statistics.median(f for _, f in rows):.3f}; process / thread "
                  f"{statistics.median(f / t for t, f in rows):.3f}, process ahead in "
                  f"{sum(f > t for t, f in rows)} of {len(rows)}")
    finally:
        clients.close()
        front.stop()
        thread.stop()
        engine.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 8, sys.argv[3] if len(sys.argv) > 3 else "no_mtp")
