"""Closed loop for `mtpipe bench serve`: c clients, each sending its next request the moment its last one
ends, which is the load a busy server sees.

A wave (serve.py) starts c streams together and lasts until the slowest one ends. With drafts, rows
accept at their own rates and end apart, so a wave's last rounds run with fewer rows. A server whose
clients keep sending fills a freed row at once. Here this engine, and mlx-lm's BatchGenerator with a
prompt inserted as each row ends, serve `PER_SLOT` requests per client by default, the bench prompts in
turn, of spread lengths (`lengths`: as in real traffic, so rows without drafts do not all end, and
refill, together).
The figure is output tokens per second while every slot is taken: from the moment each of the first c
requests has its first token to the moment a request ends with none left to take its place. The
prefill of requests that come in meanwhile counts, as it does for a server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..engine.batch import BatchEngine
from ..engine.request import GenerationRequest
from .streams import Decode, Recorder, window

PER_SLOT = 4  # requests per client in a run, by default: the first and last of each are ramp and drain
GOLDEN = 0.6180339887  # spreads lengths evenly whatever their number (`lengths`)

# a stream as sent: chunk times, tokens per chunk, when it ended
Stream = tuple[list[float], list[float], float]


def lengths(total: int, max_tokens: int) -> list[int]:
    """Each request's max tokens: spread evenly over half to one and a half times `max_tokens` (mean
    about `max_tokens`), the same for every method and for mlx-lm."""
    return [max(1, int(max_tokens * (0.5 + (i * GOLDEN) % 1.0))) for i in range(total)]


def steady_window(streams: list[Stream], slots: int) -> Decode:
    """Tokens while every slot was taken, over that time. `streams` in the order they were sent, the
    first `slots` at once, then one as each ended: the window opens when each of the first `slots`
    has its first token and closes when the (len - slots + 1)-th ends (a slot stays empty from then)."""
    if len(streams) < slots or slots < 1:
        return Decode()
    firsts = [t[0] for t, _, _ in streams[:slots] if t]
    if not firsts:
        return Decode()
    end = sorted(e for _, _, e in streams)[len(streams) - slots]
    return window([(t, n) for t, n, _ in streams], max(firsts), end)


def engine_closed_loop(engine: BatchEngine, request: Callable[[int], GenerationRequest], slots: int,
                       total: int) -> list[Recorder]:
    """`total` requests (`request(i)` the i-th sent) through `slots` client threads, each opening its
    next one when its last one ends; their records in the order sent. Once a request fails, no client
    sends another, and the first failure is raised when the ones under way have ended."""
    recs = [Recorder() for _ in range(total)]
    sent = iter(range(total))
    lock = threading.Lock()
    failed = threading.Event()

    def client() -> None:
        while not failed.is_set():
            with lock:
                i = next(sent, None)
            if i is None:
                return
            try:
                engine.open(request(i), recs[i])
                recs[i].wait()
            except BaseException:
                failed.set()
                raise

    with ThreadPoolExecutor(slots, thread_name_prefix="bench-client") as pool:
        for f in [pool.submit(client) for _ in range(slots)]:
            f.result()
    return recs


def mlx_lm_closed_loop(model: Any, tokenizer: Any, prompts: list[list[int]], slots: int, max_tokens: list[int],
                       temperature: float = 0.0) -> list[Stream]:
    """The same load on mlx-lm's BatchGenerator: one request per entry of `max_tokens` (its length), the
    prompts in turn, at most `slots` rows, a prompt inserted as each row ends; sampled at `temperature`
    when above 0. Each request's stream, in the order sent. Runs on the calling thread, which must own
    the MLX stream (the engine's MLX thread)."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    extra = {"sampler": make_sampler(temp=temperature)} if temperature > 0 else {}
    gen = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids], completion_batch_size=slots,
                         **extra)
    streams: list[Stream] = []
    index: dict[int, int] = {}  # uid -> position in `streams`
    total = len(max_tokens)

    def send(n: int) -> None:
        sent = range(len(streams), len(streams) + n)
        for uid in gen.insert([prompts[i % len(prompts)] for i in sent], [max_tokens[i] for i in sent]):
            index[uid] = len(streams)
            streams.append(([], [], 0.0))

    try:
        send(min(slots, total))
        while responses := gen.next_generated():
            now = time.perf_counter()
            ended = 0
            for r in responses:
                times, counts, _ = streams[index[r.uid]]
                if r.finish_reason != "stop":  # (a stop token is not output)
                    times.append(now)
                    counts.append(1.0)
                if r.finish_reason is not None:
                    streams[index[r.uid]] = (times, counts, now)
                    ended += 1
            if ended and len(streams) < total:
                send(min(ended, total - len(streams)))
    finally:
        gen.close()
    return streams
