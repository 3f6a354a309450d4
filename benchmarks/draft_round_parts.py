"""Diagnostic, not a benchmark: what a round with drafts costs next to one without, and where it goes.

1. Rounds of a batch engine at fixed depths 0-3 (ROWS streams of the bench's prompts, 128 greedy tokens
   each, two reps): the median time between the last stage's verdicts and the tokens a row gets per
   round. Drafts pay where (round ms / tokens per round) falls below depth 0's. Also each busy thread's
   CPU time per round (from /proc): MLX's compute thread against the engine's (the host); the compute
   thread's share of a round is how much of it is computing rather than waiting on the host.
2. The whole model's parts, synchronous, over a 200-token cache at 1 and ROWS rows: building a
   forward of M tokens a row on the host, then computing it; the same for one MTP draft step.
3. How long MLX's `async_eval` holds the host on this backend for a chain of 40 matmuls (on the CPU it
   waits for much of what it queues, so host work queued behind it overlaps less than it seems).

    python benchmarks/draft_round_parts.py ROWS
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import auto_c8_trace as trace  # noqa: E402  (its run(), and the mtpipe imports)
import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from mtpipe.coordinator.bench.engine import bench_prompts  # noqa: E402
from mtpipe.coordinator.engine.build import batch_engine  # noqa: E402
from mtpipe.models import shard  # noqa: E402
from mtpipe.models.loading import load_shard  # noqa: E402
from mtpipe.models.registry import DEMO_MODEL  # noqa: E402
from mtpipe.node import batch_head  # noqa: E402


def thread_seconds() -> dict[str, float]:
    """CPU seconds of each of this process's threads, by name (a thread MLX started: its id)."""
    names = {str(t.native_id): t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[names.get(tid, f"native {tid}")] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def engine_rounds(rows: int) -> None:
    verdicts: list[tuple[float, int]] = []
    decide = batch_head.BatchHead.decide

    def timed(self: batch_head.BatchHead, steps: list, *a: object, **kw: object) -> object:
        verdicts.append((time.perf_counter(), len(steps)))
        return decide(self, steps, *a, **kw)

    batch_head.BatchHead.decide = timed
    engine = batch_engine(DEMO_MODEL, max_rows=16)
    try:
        prompts = [list(engine.tokenizer.encode(t)) for t in bench_prompts(8)][:rows]
        for k in range(4):
            trace.run(engine, prompts, k, False, 8)
        for rep in range(2):
            for k in range(4):
                verdicts.clear()
                before, start = thread_seconds(), time.perf_counter()
                tps = trace.run(engine, prompts, k, False)
                wall, after = time.perf_counter() - start, thread_seconds()
                gaps = sorted(b[0] - a[0] for a, b in zip(verdicts, verdicts[1:]) if a[1] == b[1] == rows)
                ms = statistics.median(gaps) * 1e3
                per_round = 128 / len(verdicts)
                busy = sorted(((after[t] - before.get(t, 0.0)) * 1e3 / len(verdicts), t) for t in after)[::-1][:2]
                print(f"{rows} rows, K={k}: {tps:7.1f} tok/s, round {ms:5.2f} ms, {per_round:.2f} tokens a row "
                      f"per round, {ms / per_round:5.2f} ms per token a row (rep {rep}); CPU ms a round: "
                      f"{wall * 1e3 / len(verdicts):.2f} wall, " + ", ".join(f"{t} {v:.2f}" for v, t in busy))
    finally:
        engine.close()
        batch_head.BatchHead.decide = decide


def split(build: Callable[[], mx.array], undo: Callable[[], None], n: int = 100) -> tuple[float, float]:
    """Median ms building on the host, then computing."""
    built, computed = [], []
    for i in range(n + 10):
        t0 = time.perf_counter()
        out = build()
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        undo()
        if i >= 10:
            built.append(t1 - t0)
            computed.append(t2 - t1)
    return statistics.median(built) * 1e3, statistics.median(computed) * 1e3


def model_parts(rows: int) -> None:
    shard.queue_layers = lambda: False  # (built whole, then computed: the two apart)
    model = load_shard(DEMO_MODEL).model
    hidden_size = model.norm.weight.shape[0]
    for b in sorted({1, rows}):
        prompt = mx.array([[5 + (i * 7) % 3000 for i in range(200)]] * b)
        cache = model.make_cache()
        mx.eval(model.run_layers(model.embed(prompt), cache)[0])
        attention = [c for c in cache if isinstance(c, KVCache)]
        for m in (1, 2, 4):
            def forward(m: int = m) -> mx.array:
                h, _ = model.run_layers(model.embed(mx.full((b, m), 7)), cache, capture=m > 1)
                return mx.argmax(model.lm_logits(model.final_norm(h)), axis=-1)

            def undo(m: int = m) -> None:
                for c in attention:
                    c.offset -= m

            build, compute = split(forward, undo)
            print(f"{b} rows, forward of {m} token(s) a row: build {build:.2f} ms, compute {compute:.2f} ms")
        mtp_cache = KVCache()
        hid, emb = mx.random.normal((b, 200, hidden_size)), model.embed(prompt)
        model.mtp.extend(hid[:, :-1], emb[:, :-1], mtp_cache)
        mx.eval(mtp_cache.keys)

        def draft() -> mx.array:
            return mx.argmax(model.lm_logits(model.mtp(hid[:, -1:], emb[:, -1:], mtp_cache)), axis=-1)

        def drop() -> None:
            mtp_cache.offset -= 1

        build, compute = split(draft, drop)
        print(f"{b} rows, one draft step: build {build:.2f} ms, compute {compute:.2f} ms")


def async_eval_hold() -> None:
    a = mx.random.normal((512, 512))
    mx.eval(a)
    for _ in range(3):
        x = a
        for _ in range(40):
            x = mx.tanh(x @ a)
        t0 = time.perf_counter()
        mx.async_eval(x)
        t1 = time.perf_counter()
        mx.eval(x)
        t2 = time.perf_counter()
        print(f"async_eval of 40 matmuls held the host {1e3 * (t1 - t0):.1f} ms, then {1e3 * (t2 - t1):.1f} ms more")


if __name__ == "__main__":
    assert len(sys.argv) == 2 and sys.argv[1].isdigit(), __doc__
    engine_rounds(int(sys.argv[1]))
    model_parts(int(sys.argv[1]))
    async_eval_hold()
