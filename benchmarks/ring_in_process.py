"""Diagnostic, not a benchmark: what a 2-node ring's round costs without processes or sockets.

Both nodes' parts of the ring (node/groups.py over a StageWorker for layers 0-3 and one for layers
4-7 with the head) run on the single-node engine's MLX thread, one after the other, one stream at a
time, no MTP: per token, node 0's part, node 1's part (its forward, head and next round) and the
whole round. In the same run, the single-node batch engine decodes the same prompts without MTP.
Against `bench serve --nodes 2`'s hop breakdown (the same parts in node processes, over TCP), this
separates what splitting the model costs from what the processes and hops cost.

    python benchmarks/ring_in_process.py TOKENS REPS
"""

from __future__ import annotations

import statistics
import sys
import time

from mtpipe.coordinator.bench.engine import bench_prompts
from mtpipe.coordinator.bench.serve import engine_run
from mtpipe.coordinator.engine.build import batch_engine
from mtpipe.models.loading import load_shard
from mtpipe.models.registry import DEMO_MODEL
from mtpipe.models.shard import ShardSpec
from mtpipe.node.groups import RingGroups
from mtpipe.node.protocol import StepKind, StepRequest
from mtpipe.node.stage import StageWorker


def nodes(layers: int = 8) -> tuple[RingGroups, RingGroups]:
    first = StageWorker(load_shard(DEMO_MODEL, ShardSpec(0, layers // 2, layers)))
    last = StageWorker(load_shard(DEMO_MODEL, ShardSpec(layers // 2, layers, layers)))
    return RingGroups(first), RingGroups(last)


def stream(first: RingGroups, last: RingGroups, prompt: list[int], tokens: int, seq: str) -> list[float]:
    """One stream through both parts: median ms per token of node 0, node 1 and the round, and tok/s."""
    h = first.worker.step(StepRequest(seq, 0, StepKind.PREFILL, prompt, final=True), None)
    out = last.worker.step(StepRequest(seq, 0, StepKind.PREFILL, prompt, final=True), h)
    _, rnd = last.joined("bench", 1, out, tokens, ())
    parts: list[tuple[float, float]] = []
    start = time.perf_counter()
    while rnd is not None and rnd.rows:
        a = time.perf_counter()
        h = first.run(rnd, None)
        b = time.perf_counter()
        _, rnd = last.next_round(rnd, last.run(rnd, h))
        parts.append((b - a, time.perf_counter() - b))
    if rnd is not None:
        first.end(rnd.key)  # the ending frame, as it would reach node 0
    wall = time.perf_counter() - start
    return [1000 * statistics.median(p[0] for p in parts), 1000 * statistics.median(p[1] for p in parts),
            1000 * statistics.median(p[0] + p[1] for p in parts), len(parts) / wall]


def main(tokens: int, reps: int) -> None:
    engine = batch_engine(DEMO_MODEL)
    try:
        prompts = [list(engine.tokenizer.encode(t)) for t in bench_prompts(4)]
        first, last = engine.thread.call(nodes)
        engine_run(engine, prompts[:1], 8, "no_mtp")
        for rep in range(reps):
            runs = [engine.thread.call(stream, first, last, p, tokens, f"r{rep}-{i}") for i, p in enumerate(prompts)]
            node0, node1, whole, tps = (statistics.median(r[k] for r in runs) for k in range(4))
            single = statistics.median(engine_run(engine, [p], tokens, "no_mtp")[0].tps for p in prompts)
            print(f"rep {rep}: in-process ring node 0 {node0:.2f} ms, node 1 {node1:.2f} ms, round {whole:.2f} ms "
                  f"({tps:.0f} tok/s); single node no MTP {single:.0f} tok/s ({1000 / single:.2f} ms); "
                  f"ring / single {tps / single:.3f}", flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
