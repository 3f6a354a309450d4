"""Diagnostic, not a benchmark: the same 8 streams at the engine level and through the HTTP API.

One batch engine on the demo model, the real API app on a free port and the bench's client process
(coordinator/bench/serve_api.py). REPS times: 8 prompts x 128 tokens without MTP opened at once on the
engine, then streamed through the API. Prints both aggregates and their ratio, how far apart the
streams' first and last chunks came, the run's length, and the CPU each process used meanwhile.

    python benchmarks/api_vs_engine_c8.py REPS
"""

from __future__ import annotations

import sys
import time

import psutil

from mtpipe.coordinator.bench.engine import bench_prompts
from mtpipe.coordinator.bench.serve import _request, api_run
from mtpipe.coordinator.bench.streams import Recorder, aggregate_tps
from mtpipe.coordinator.bench.serve_api import Clients, LiveServer
from mtpipe.coordinator.engine.build import batch_engine
from mtpipe.models.registry import DEMO_MODEL

Streams = list[tuple[list[float], list[float]]]


def spread(streams: Streams) -> str:
    first, last = [t[0] for t, _ in streams], [t[-1] for t, _ in streams]
    return (f"first chunks within {1e3 * (max(first) - min(first)):.0f} ms, last within "
            f"{1e3 * (max(last) - min(last)):.0f} ms, run {1e3 * (max(last) - max(first)):.0f} ms")


def cores(proc: psutil.Process, before: tuple, start: float) -> float:
    now = proc.cpu_times()
    return (now.user + now.system - before.user - before.system) / (time.perf_counter() - start)


def main(reps: int) -> None:
    engine = batch_engine(DEMO_MODEL, max_rows=16)
    server, clients = LiveServer(engine), Clients()
    try:
        prompts = [list(engine.tokenizer.encode(t)) for t in bench_prompts(8)]
        server.start()
        api_run(clients, server.url, prompts, 16, "no_mtp")
        me = psutil.Process()
        for _ in range(reps):
            recs = [Recorder() for _ in prompts]
            before, start = me.cpu_times(), time.perf_counter()
            for prompt, rec in zip(prompts, recs):
                engine.open(_request(engine, prompt, 128, "no_mtp"), rec)
            for rec in recs:
                rec.wait()
            engine_cores = cores(me, before, start)
            at_engine: Streams = [(r.times, r.counts) for r in recs]
            kid = psutil.Process(next(iter(clients.pool._processes)))
            before, kid_before, start = me.cpu_times(), kid.cpu_times(), time.perf_counter()
            records = clients.stream(server.url, prompts, 128, 0)
            api_cores, client_cores = cores(me, before, start), cores(kid, kid_before, start)
            at_api: Streams = [(r.times, r.token_counts()) for r in records]
            a, b = aggregate_tps(at_engine), aggregate_tps(at_api)
            print(f"engine {a:.0f} tok/s, API {b:.0f} tok/s: {b / a:.3f}")
            print(f"  engine: {spread(at_engine)}; server {engine_cores:.2f} cores")
            print(f"  API:    {spread(at_api)}; server {api_cores:.2f} cores, clients {client_cores:.2f}", flush=True)
    finally:
        clients.close()
        server.stop()
        engine.close()


if __name__ == "__main__":
    main(int(sys.argv[1]))
