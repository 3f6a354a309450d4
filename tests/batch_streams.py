"""A request in a batch engine as a test reads it (test_batch.py, test_preemption.py, test_ring_preemption.py)."""

from __future__ import annotations

import dataclasses
import queue
import time
from collections.abc import Callable
from typing import Any

from mtpipe.coordinator.engine.batch import BatchEngine
from mtpipe.coordinator.engine.request import GenerationChunk, GenerationRequest, resolve_depth
from mtpipe.coordinator.engine.sinks import END
from mtpipe.node.protocol import SamplingParams

MAX_TOKENS = 28
WAIT_S = 60.0  # the longest any single wait for a chunk may take before the test fails


def encode(engine: Any, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text))


def request(prompt: list[int], depth: int | str = 0, max_tokens: int = MAX_TOKENS, **kw: Any) -> GenerationRequest:
    drafts, auto = resolve_depth(depth, has_mtp=True)
    return GenerationRequest(prompt, max_tokens=max_tokens, mtp_depth=drafts, mtp_auto=auto, **kw)


def never_ends(engine: Any) -> SamplingParams:
    """Greedy, never an end token: only max_tokens ends such a request."""
    return SamplingParams(logit_bias=tuple((t, -100.0) for t in sorted(engine.eos)))


class Stream:
    """One request in a batch engine: its sink is a SimpleQueue the test thread drains (chunks, then
    an exception or END, as BatchEngine.generate reads them). Items are stamped as the sink gets them."""

    def __init__(self, engine: BatchEngine, req: GenerationRequest):
        self.req = req
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.chunks: list[GenerationChunk] = []
        self.stamps: list[float] = []  # when the sink got each chunk (monotonic)
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self.handle = engine.open(req, lambda item: self.items.put((time.monotonic(), item)))

    @property
    def ended(self) -> bool:
        return self.ended_at is not None

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.chunks for t in c.tokens]

    def _take(self) -> None:
        stamp, item = self.items.get(timeout=WAIT_S)
        assert not self.ended, "nothing may follow END"
        if item is END:
            self.ended_at = stamp
        elif isinstance(item, BaseException):
            assert self.error is None
            self.error = item
        else:
            assert self.error is None, "no chunk after an error"
            self.chunks.append(item)
            self.stamps.append(stamp)

    def first(self) -> Stream:
        """Wait for the first chunk (or the end)."""
        while not self.chunks and not self.ended:
            self._take()
        return self

    def finish(self) -> list[int]:
        while not self.ended:
            self._take()
        if self.error is not None:
            raise self.error
        return self.tokens

    @property
    def stats(self):
        return self.chunks[-1].stats


def preemption_mix(engine: Any, prompts: list[list[int]], tokens: int) -> list[GenerationRequest]:
    """Four requests that end at `tokens` only, in the order they are to be admitted (the last ones leave
    first): greedy at depth 0 and auto, scored at depth 3, sampled with a seed, a penalty and min_tokens at 2."""
    ends = never_ends(engine)
    sampled = dataclasses.replace(ends, temperature=0.9, seed=11, frequency_penalty=0.5, min_tokens=tokens)
    scored = dataclasses.replace(ends, prompt_logprobs=1, top_logprobs=1)
    return [request(prompts[0], 0, tokens, params=ends), request(prompts[1], "auto", tokens, params=ends),
            request(prompts[2], 3, tokens, params=scored), request(prompts[3], 2, tokens, params=sampled)]


def check_preemption_mix(streams: list[Stream], reference: Any, tokens: int,
                         preemptions: Callable[[], int]) -> list[Stream]:
    """Each of `preemption_mix` gave the tokens it gives alone; the first admitted was never preempted, the
    last was; the scored one's prompt log-probabilities came once, with its first chunk. Those preempted."""
    for s in streams:
        got = s.finish()
        alone = reference.complete(s.req)
        assert got == alone.tokens, f"depth {s.req.depth_label}: {got} vs alone {alone.tokens}"
        assert s.chunks[-1].finish_reason == "length" and s.stats.generation_tokens == tokens
    preempted = [s for s in streams if s.stats.preempted]
    assert preempted and preemptions() == sum(s.stats.preempted for s in streams)
    assert not streams[0].stats.preempted and streams[3].stats.preempted  # (the last admitted left first)
    chunks = streams[2].chunks
    assert len(chunks[0].prompt_logprobs) == len(streams[2].req.prompt_tokens) - 1
    assert all(c.prompt_logprobs is None for c in chunks[1:])
    assert sum(len(c.logprobs) for c in chunks) == tokens
    return preempted


def scraped(engine: Any) -> dict[str, float]:
    """The scheduler's metrics as /metrics exposes them for `engine` (unlabelled samples by name)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from mtpipe.coordinator.api.metrics import ServerMetrics

    text = generate_latest(ServerMetrics(engine.scheduler_state).registry).decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def cancel_while_preempted(engine: Any, running: Stream, waiting: Stream, preemptions: Callable[[], int]) -> None:
    """Once `waiting` was preempted beside `running`, /metrics has counted it (as it happened) and shows one
    request running and one waiting; cancelled, it ends without an error; then `running` is cancelled."""
    deadline = time.monotonic() + WAIT_S
    while not preemptions():  # (the second outgrows the budget within a few rounds)
        assert time.monotonic() < deadline, "never preempted"
        time.sleep(0.01)
    now = scraped(engine)
    assert (now["mtpipe_requests_running"], now["mtpipe_requests_waiting"]) == (1, 1)
    assert now["mtpipe_preemptions_total"] == 1 and 0 < now["mtpipe_cache_usage_ratio"] <= 1
    waiting.handle.cancel()
    waiting.finish()  # (ends, without an error)
    assert waiting.error is None and all(c.finish_reason is None for c in waiting.chunks)
    running.handle.cancel()
    running.finish()


def nothing_scheduled(engine: Any) -> bool:
    """/metrics shows no request running or waiting, and no memory held."""
    now = scraped(engine)
    return [now[f"mtpipe_{x}"] for x in ("requests_running", "requests_waiting", "cache_usage_ratio")] == [0] * 3
