"""The batch engine: every active sequence decodes in one round, on the process's one MLX thread.

Requests arrive from any thread (`open`); the MLX thread runs the loop: refuse what waited too long,
admit what fits the memory budget (scheduler.py), run one decode round for all decoding rows, then
one prefill step for every prompt being taken in (a chunk of each, in one forward), and hand each
request its chunks through its sink. A request cancelled by its client (or done) leaves the batch
before the next round, on every stage.

Each prompt's state before its last token is kept (node/prefixes.py), and each request's as it ends
(its prompt and reply but the reply's last token, never fed), within `prefix_cache` bytes, least
recently used dropped first and all of them before a request waits for memory: a prompt that starts
with a kept one (the next turn of a chat, the same prompt again) prefills only the rest.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ...models.mlx_thread import MLXThread
from ...node.batch import BatchStage, RowStep
from ...node.protocol import Scored, StageUnavailable, StepKind, StepOutput, StepRequest
from . import scheduler as plan
from .detokenizer import TextStream
from .request import (GenerationChunk, GenerationRequest, GenerationResult, GenerationStats, RequestError,
                      check_request, check_vocabulary, collect, ended_in_stages, stop_reason, take_tokens)
from .sinks import END, ServerBusy, Sink, guarded, stream

log = logging.getLogger(__name__)

DEFAULT_MAX_ROWS = 16
DEFAULT_QUEUE_TIMEOUT_S = 60.0
DEFAULT_PREFILL_CHUNK = 512
PREFIX_CACHE_SHARE = 4  # kept prompt prefixes may take up to 1/4 of the memory budget by default
END_TIMEOUT_S = 30.0  # close(): how long the MLX thread may take to end what it holds (longer: it is stuck)


@dataclass
class Live:
    """One request inside the engine (touched only on the MLX thread, except `cancelled`)."""

    seq_id: str
    req: GenerationRequest
    sink: Sink
    text: TextStream
    stats: GenerationStats
    need: plan.Footprint
    queued: float
    cancelled: threading.Event = field(default_factory=threading.Event)
    prefilled: int = 0  # prompt tokens fed so far
    step: int = 0  # prefill steps sent
    generated: int = 0
    emitted: list[int] = field(default_factory=list)  # every token the stages gave, past a stop included
    next_tokens: list[int] = field(default_factory=list)  # the next round's [y, d1..dK]
    started: float = 0.0
    prefix: str = ""  # the kept prefix its prompt goes on from
    admitted: Callable[[], None] | None = None  # told once it leaves the queue
    ends: frozenset[int] = frozenset()  # the tokens that end it (`GenerationRequest.ends`)
    scored: list[Scored] | None = None  # its prompt's log-probabilities so far, where asked; handed out first


class Handle:
    def __init__(self, live: Live, wake: Callable[[], None]):
        self._live = live
        self._wake = wake

    def cancel(self) -> None:
        """The client is gone: the sequence leaves the batch at the next round."""
        self._live.cancelled.set()
        self._wake()


class BatchEngine:
    batching = "batch"  # the active sequences as rows of one batch per round

    def __init__(self, stages: list[BatchStage], tokenizer: Any, eos_token_ids: set[int] | list[int],
                 max_context: int, has_mtp: bool, thread: MLXThread, *, dims: plan.ModelDims, budget: int,
                 max_rows: int = DEFAULT_MAX_ROWS, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_S, prefix_cache: int | None = None):
        self.stages = stages
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)
        self.max_context = max_context
        self.has_mtp = has_mtp
        self.thread = thread
        self.dims = dims
        self.budget = budget
        self.max_rows = max_rows
        self.prefill_chunk = prefill_chunk
        self.queue_timeout = queue_timeout
        self.prefix_cache = budget // PREFIX_CACHE_SHARE if prefix_cache is None else max(0, prefix_cache)
        self._kept: dict[str, plan.KeptPrefix] = {}
        if self.prefix_cache:
            thread.call(lambda: [s.keep_prefixes(True) for s in stages])
        self._inbox: queue.SimpleQueue[Live] = queue.SimpleQueue()
        self._closed = False
        self._open_lock = threading.Lock()
        self._waiting: list[Live] = []
        self._prefilling: list[Live] = []
        self._decoding: list[Live] = []  # in batch order
        self._round_s = 0.0
        self._prefill_token_s = 0.0  # per token of a prefill step's rows, each padded to the step's width
        self._narrowed = 0  # prefill steps just run narrower than the widest row's chunk (plan.fill_width)
        self.vocab_size = stages[0].worker.shard.config.args.vocab_size  # what the first stage embeds
        head = stages[-1].worker.head
        self.constrains = head is not None and head.grammars is not None  # output held to grammars (constraints.py)
        self.keeps_prefixes = self.prefix_cache > 0  # (a prompt's other choices start from its kept prefix)
        self.pipeline = self  # describe() and close() for the API and CLI, as a pipeline offers them
        thread.set_worker(self._work)

    # -- any thread -------------------------------------------------------------------------------

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))

    def validate(self, req: GenerationRequest) -> None:
        check_request(req, max_context=self.max_context, has_mtp=self.has_mtp, constrains=self.constrains)
        # The first stage would refuse it in the middle of the batch's work: refuse it here, from open().
        check_vocabulary(req, self.vocab_size)
        if req.params.grammar is not None:  # (so would the last, compiling it with the tokenizer)
            try:
                self.stages[-1].worker.head.grammars.check(req.params.grammar)
            except ValueError as e:
                raise RequestError(f"the output cannot be held to this format: {e}", "response_format") from None

    def open(self, req: GenerationRequest, sink: Sink, admitted: Callable[[], None] | None = None) -> Handle:
        """Queue a request; its chunks, then END or an exception, go to `sink` (from the MLX thread),
        and `admitted()` is called once it leaves the queue."""
        self.validate(req)
        positions = len(req.prompt_tokens) + req.max_tokens
        seq_id = uuid.uuid4().hex
        cancelled = threading.Event()  # (a client callback that fails cancels its request: `guarded`)
        live = Live(seq_id, req, guarded(sink, cancelled.set, seq_id), TextStream.of(self.tokenizer, req),
                    GenerationStats(prompt_tokens=len(req.prompt_tokens)),
                    plan.footprint(self.dims, positions, req.mtp_depth), time.monotonic(), cancelled=cancelled,
                    admitted=guarded(admitted, cancelled.set, seq_id) if admitted is not None else None,
                    ends=req.ends(self.eos), scored=[] if req.params.prompt_logprobs >= 0 else None)
        with self._open_lock:  # (close() ends what is in the inbox once it is closed)
            if self._closed:
                raise StageUnavailable("the engine was stopped")
            self._inbox.put(live)
        self.thread.wake()
        return Handle(live, self.thread.wake)

    def generate(self, req: GenerationRequest) -> Iterator[GenerationChunk]:
        return stream(lambda sink: self.open(req, sink))

    def complete(self, req: GenerationRequest) -> GenerationResult:
        return collect(self.generate(req))

    def describe(self) -> dict[str, Any]:
        stages = self.thread.call(lambda: [dict(index=i, **s.describe()) for i, s in enumerate(self.stages)])
        return {"kind": "local", "stages": stages, "batch": {"max_rows": self.max_rows, "budget_bytes": self.budget,
                                                             "prefix_cache_bytes": self.prefix_cache}}

    def close(self) -> None:
        """Stop the engine: every request it still holds ends with an error, and no other is taken."""
        with self._open_lock:
            self._closed = True
        if self.thread.alive:
            try:
                self.thread.call(self._end_all, timeout=END_TIMEOUT_S)
            except TimeoutError:  # a stuck round: what it holds ends with the process
                log.error("the MLX thread did not end its requests within %.0f s: it is stuck", END_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - closing goes on
                log.exception("ending the open requests failed")
        self.thread.set_worker(None)
        self.thread.close()

    def _end_all(self) -> None:
        self.thread.set_worker(None)
        self._take_inbox()
        for live in self._waiting + self._prefilling + self._decoding:
            self._finish(live, StageUnavailable("the engine was stopped"))
        self._kept = {}
        for stage in self.stages:  # (their arrays go here, on the MLX thread)
            stage.keep_prefixes(False)

    # -- the MLX thread ---------------------------------------------------------------------------

    def _work(self) -> bool:
        """One unit of work: admissions, one decode round, one prefill chunk. True if more is waiting."""
        self._take_inbox()
        self._drop_cancelled()
        self._admit()
        if self._decoding:
            self._guard(self._decoding, self._round)
        if self._prefilling:
            self._guard(self._prefilling, self._prefill)
        # Requests still waiting count as work: one admitted when the last running one finished in this
        # unit would otherwise wait for the next open() to wake the thread (nothing running: the next
        # unit admits at least one, so this never spins).
        return bool(self._decoding or self._prefilling or self._waiting)

    def _take_inbox(self) -> None:
        while True:
            try:
                self._waiting.append(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _guard(self, lives: list[Live], work: Callable[[], None]) -> None:
        try:
            work()
        except Exception as e:  # a failed round fails its requests, never the loop
            log.exception("a batch step failed")
            for live in list(lives):
                self._finish(live, e)

    def _drop_cancelled(self) -> None:
        for group in (self._waiting, self._prefilling, self._decoding):
            for live in [x for x in group if x.cancelled.is_set()]:
                self._finish(live, None)

    def _admit(self) -> None:
        waiting = [plan.Waiting(x.seq_id, x.need, x.queued) for x in self._waiting]
        running = [x.need for x in self._prefilling + self._decoding]
        if waiting and self._kept and len(running) < self.max_rows:  # kept prefixes make room for the next
            head = self._waiting[0].req  # request before it waits for it (sparing the prefix it goes on from)
            wanted = plan.reusable(list(self._kept.values()), head.prompt_tokens, head.mtp_depth > 0)
            rows = [*running, waiting[0].need]
            # (unless that prefix alone would keep it out beside running rows: then its prompt goes in whole)
            spare = wanted is not None and (not running or
                                            plan.batch_bytes(self.dims, rows) + wanted.nbytes <= self.budget)
            self._fit(rows, keep={wanted.key} if spare else set(), only_if_room=bool(running))
        budget = self.budget - sum(k.nbytes for k in self._kept.values())
        for seq_id in plan.admit(waiting, running, self.dims, budget, self.max_rows):
            live = next(x for x in self._waiting if x.seq_id == seq_id)
            self._waiting.remove(live)
            live.started = time.perf_counter()
            self._reuse(live)
            self._prefilling.append(live)
            if live.admitted is not None:
                live.admitted()
        waiting = [plan.Waiting(x.seq_id, x.need, x.queued) for x in self._waiting]
        for seq_id in plan.expired(waiting, time.monotonic(), self.queue_timeout):
            live = next(x for x in self._waiting if x.seq_id == seq_id)
            self._finish(live, ServerBusy(f"no room for this request after {self.queue_timeout:.0f} s in the queue",
                                          retry_after=max(1, int(self.queue_timeout // 4))))

    def _prefill(self) -> None:
        """One prompt chunk for every sequence taking its prompt, in one forward (the prompt's last
        token goes alone, as its own step, and yields the first token)."""
        group = list(self._prefilling)
        needs = [max(1, len(x.req.prompt_tokens) - 1 - x.prefilled) for x in group]
        wide = plan.prefill_chunk(max(needs), self.prefill_chunk, bool(self._decoding), self._round_s,
                                  self._prefill_token_s * len(group))
        n = plan.fill_width(needs, wide, self._narrowed)
        self._narrowed = self._narrowed + 1 if n < wide else 0
        reqs = []
        for live in group:
            prompt = live.req.prompt_tokens
            left = len(prompt) - 1 - live.prefilled
            chunk, final = (prompt[live.prefilled : live.prefilled + min(n, left)], False) if left > 0 \
                else (prompt[-1:], True)
            first = live.step == 0
            reqs.append(StepRequest(live.seq_id, live.step, StepKind.PREFILL, chunk, final=final,
                                    params=live.req.params if first else None,
                                    mtp_depth=live.req.mtp_depth if first else 0, mtp_auto=live.req.mtp_auto and first,
                                    prefix=live.prefix if first else "",
                                    budget=max(1, live.req.max_tokens) if final else 0,
                                    stop_tokens=tuple(sorted(live.ends)) if final else ()))
        start = time.perf_counter()
        x = None
        for stage in self.stages:
            x = stage.fill(reqs, x)
        padded = max(len(r.tokens) for r in reqs) * len(reqs)  # (every row runs at the step's width)
        if n == wide and any(not r.final for r in reqs):  # (a narrow step's time is mostly its fixed part)
            self._prefill_token_s = plan.ema(self._prefill_token_s, (time.perf_counter() - start) / padded)
        for live, req, out in zip(group, reqs, x):
            live.step += 1
            live.prefilled += len(req.tokens)
            if live.scored is not None:
                live.scored += out.prompt_logprobs
            if not req.final:
                continue
            live.stats.prefill_seconds = time.perf_counter() - live.started
            keep = self._keep_as(live)
            try:
                kept = [stage.join(live.seq_id, keep) for stage in self.stages]
            except Exception as e:  # noqa: BLE001 - this row fails (and leaves every stage), not the batch
                log.exception("sequence %s could not join the batch", live.seq_id)
                self._drop_kept([keep])
                self._finish(live, e)
                continue
            self._kept_now(keep, live.req.prompt_tokens[:-1], kept)
            self._prefilling.remove(live)
            self._decoding.append(live)
            live.started = time.perf_counter()
            self._emit(live, out)

    # -- kept prompt prefixes -----------------------------------------------------------------------

    def _reuse(self, live: Live) -> None:
        """Start an admitted prompt from the longest kept prefix it begins with (unless it is scored:
        the prompt's tokens are read as they go in)."""
        hit = plan.reusable(list(self._kept.values()), live.req.prompt_tokens, live.req.mtp_depth > 0)
        if hit is None or live.scored is not None:
            return
        hit.used = time.monotonic()
        live.prefix, live.prefilled = hit.key, len(hit.tokens)
        live.stats.cached_tokens = len(hit.tokens)

    def _keep_as(self, live: Live) -> str:
        """The key its prompt is kept under as it joins ("": not kept, as one larger than the cache)."""
        tokens = tuple(live.req.prompt_tokens[:-1])
        if plan.kept_bytes(self.dims, len(tokens)) > self.prefix_cache:  # (not copied to go at once)
            return ""
        return self._new_key(live.seq_id, tokens, live.req.mtp_depth > 0)

    def _new_key(self, key: str, tokens: tuple[int, ...], drafts: bool) -> str:
        """`key`, or "" when `tokens` are not to be kept: nothing, or kept already (unless that one lacks
        the MTP head's part and this sequence drafts)."""
        if not self.prefix_cache or not tokens:
            return ""
        if plan.held(list(self._kept.values()), tokens, drafts):
            return ""
        return key

    def _keep_end(self, live: Live) -> None:
        """Keep a finished request's state at its end, its prompt and reply but the reply's last token
        (never fed): the next turn of a chat starts with them. It never fails the request."""
        tokens = (*live.req.prompt_tokens, *live.emitted[:-1])
        key = self._new_key(f"{live.seq_id}/end", tokens, live.req.mtp_depth > 0)
        if not key or plan.kept_bytes(self.dims, len(tokens)) > self.prefix_cache:  # (not copied to go at once)
            return
        try:
            kept = [stage.keep_end(live.seq_id, key, len(tokens)) for stage in self.stages]
        except Exception:  # noqa: BLE001
            log.exception("keeping the end of %s failed", live.seq_id)
            kept = [None]
        self._kept_now(key, list(tokens), kept, ending=live)

    def _kept_now(self, key: str, tokens: list[int], kept: list[Any], ending: Live | None = None) -> None:
        """Kept on every stage (`kept`, None where not): note it, and drop what no longer fits beside the
        running rows (`ending`, about to leave, not among them)."""
        if not key:
            return
        if any(k is None for k in kept):  # (a stage that marked nothing: none keeps it)
            self._drop_kept([key])
            return
        nbytes = sum(k.nbytes for k in kept)
        if nbytes > self.prefix_cache:  # (it alone would empty the cache, then go too)
            self._drop_kept([key])
            return
        self._drop_kept([k.key for k in self._kept.values() if k.tokens == tuple(tokens)])  # (without MTP)
        self._kept[key] = plan.KeptPrefix(key, tuple(tokens), nbytes, kept[-1].drafts, time.monotonic())
        over = sum(k.nbytes for k in self._kept.values()) - self.prefix_cache
        if over > 0:
            self._drop_kept(plan.least_used(list(self._kept.values()), over, self._pinned()))
        self._fit([x.need for x in self._prefilling + self._decoding if x is not ending])

    def _fit(self, rows: list[plan.Footprint], keep: set[str] = frozenset(), only_if_room: bool = False) -> None:
        """Drop kept prefixes, least recently used first, until they and these rows fit the budget.
        `only_if_room`: none, where dropping every one it may would still leave the rows over it (a
        request that must wait for running rows to leave would empty the cache and wait all the same)."""
        kept = list(self._kept.values())
        over = plan.batch_bytes(self.dims, rows) + sum(k.nbytes for k in kept) - self.budget
        spared = self._pinned() | keep
        if only_if_room and over > sum(k.nbytes for k in kept if k.key not in spared):
            return
        self._drop_kept(plan.least_used(kept, over, spared))

    def _pinned(self) -> set[str]:
        """Kept prefixes a prompt is about to start from (its first step not taken yet)."""
        return {x.prefix for x in self._prefilling if x.prefix and x.step == 0}

    def _drop_kept(self, keys: list[str]) -> None:
        pinned = self._pinned()
        for key in keys:
            if not key or key in pinned:
                continue
            self._kept.pop(key, None)
            for stage in self.stages:
                stage.drop_prefix(key)

    # -- rounds -------------------------------------------------------------------------------------

    def _round(self) -> None:
        rows = [RowStep(x.seq_id, x.next_tokens) for x in self._decoding]
        start = time.perf_counter()
        h = None
        for stage in self.stages:
            h = stage.forward(rows, h)
        commits = [r.output.commit for r in h]
        for stage in self.stages:
            stage.commit(commits)
        self._round_s = plan.ema(self._round_s, time.perf_counter() - start)
        for live, row in zip(list(self._decoding), h):
            live.stats.record_round(row.output)
            self._emit(live, row.output)

    def _emit(self, live: Live, out: StepOutput) -> None:
        """Hand the round's tokens to the request; finish it at EOS, a stop string or max_tokens. A
        failure here (detokenizing, the sink) fails this request alone."""
        try:
            self._hand_out(live, out)
        except Exception as e:  # noqa: BLE001
            log.exception("handing out the tokens of %s failed", live.seq_id)
            self._finish(live, e)

    def _hand_out(self, live: Live, out: StepOutput) -> None:
        live.emitted += out.tokens
        new, finish = take_tokens(out.tokens, live.ends, live.text, live.generated, live.req.max_tokens)
        live.generated += len(new)
        live.stats.generation_tokens = live.generated
        logprobs = out.logprobs[: len(new)] if live.req.params.top_logprobs >= 0 else None
        scored, live.scored = live.scored, None
        if finish is None:
            live.next_tokens = [out.tokens[-1], *out.drafts]
            live.sink(GenerationChunk(text=live.text.release(final=False), tokens=new, logprobs=logprobs,
                                      prompt_logprobs=scored))
            return
        live.stats.decode_seconds = time.perf_counter() - live.started
        live.stats.ended_within(out, len(new))
        live.sink(GenerationChunk(text=live.text.release(final=True), tokens=new, finish_reason=finish,
                                  stats=live.stats, logprobs=logprobs, prompt_logprobs=scored,
                                  stop_reason=stop_reason(finish, new, live.text, live.req)))
        if ended_in_stages(new, live.ends, live.generated, live.req.max_tokens):
            self._keep_end(live)
        self._finish(live, None)

    def _finish(self, live: Live, error: BaseException | None) -> None:
        """Take a request out of the engine and free its caches on every stage."""
        for group in (self._waiting, self._prefilling, self._decoding):
            if live in group:
                group.remove(live)
        for stage in self.stages:
            try:
                stage.release(live.seq_id)
            except Exception:
                log.exception("releasing %s failed", live.seq_id)
        if error is not None:
            live.sink(error)
        live.sink(END)
