"""The batch engine: every active sequence decodes in one round, on the process's one MLX thread.

Requests arrive from any thread (`open`); the MLX thread runs the loop: refuse what waited too long,
admit what fits the memory budget (scheduler.py), preempt the last admitted rows where the running
ones outgrew it, run one decode round for all decoding rows, then one prefill step for every prompt
being taken in (a chunk of each, in one forward), and hand each request its chunks through its sink.
A request cancelled by its client (or done) leaves the batch before the next round, on every stage.
Prompt prefixes are kept between requests (batch_prefixes.py).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from ...models.mlx_thread import MLXThread
from ...node.batch import BatchStage, RowStep
from ...node.protocol import StageUnavailable, StepKind, StepOutput, StepRequest
from . import scheduler as plan
from .batch_live import Handle, Live
from .batch_prefixes import KeepsPrefixes
from .detokenizer import TextStream
from .request import (GenerationChunk, GenerationRequest, GenerationResult, GenerationStats, RequestError,
                      check_request, check_vocabulary, collect, ended_in_stages, stop_reason, take_tokens)
from .sinks import END, ServerBusy, Sink, guarded, stream

log = logging.getLogger(__name__)

DEFAULT_MAX_ROWS = 16
DEFAULT_QUEUE_TIMEOUT_S = 60.0
DEFAULT_PREFILL_CHUNK = 512
DESCRIBE_WAIT_S = 0.5  # GET /v1/cluster waits this long for the MLX thread, then shows the stages as they were
PREFIX_CACHE_SHARE = 4  # kept prompt prefixes may take up to 1/4 of the memory budget by default
END_TIMEOUT_S = 30.0  # close(): how long the MLX thread may take to end what it holds (longer: it is stuck)


class BatchEngine(KeepsPrefixes):
    batching = "batch"  # the active sequences as rows of one batch per round

    def __init__(self, stages: list[BatchStage], tokenizer: Any, eos_token_ids: set[int] | list[int],
                 max_context: int, has_mtp: bool, thread: MLXThread, *, dims: plan.ModelDims, budget: int,
                 max_rows: int = DEFAULT_MAX_ROWS, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_S, prefix_cache: int | None = None,
                 horizon: int | None = plan.ADMIT_HORIZON):
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
        self.horizon = horizon  # admitted with room to grow by this many tokens (None: by all its max tokens)
        self.preemptions = 0
        self._admissions = 0
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
        self._stages: list[dict[str, Any]] = []  # as the MLX thread last described them
        thread.call(self._describe_stages)
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
        seq_id = uuid.uuid4().hex
        cancelled = threading.Event()  # (a client callback that fails cancels its request: `guarded`)
        live = Live(seq_id, req, guarded(sink, cancelled.set, seq_id), TextStream.of(self.tokenizer, req),
                    GenerationStats(prompt_tokens=len(req.prompt_tokens)), time.monotonic(), cancelled=cancelled,
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
        """The stages as the MLX thread describes them (as it last did, where it is busy for longer than
        DESCRIBE_WAIT_S: a long prompt's step), and the batch."""
        if self.thread.owns():
            self._describe_stages()
        else:
            described = self.thread.submit(self._describe_stages)
            try:
                described.result(DESCRIBE_WAIT_S)
            except TimeoutError:  # (unless it has begun: the next one asks again)
                described.cancel()
        batch = {"max_rows": self.max_rows, "budget_bytes": self.budget, "prefix_cache_bytes": self.prefix_cache,
                 "admit_horizon": self.horizon, "preemptions": self.preemptions}
        return {"kind": "local", "stages": self._stages, "batch": batch}

    def scheduler_state(self) -> plan.SchedulerState:
        """Rows, queue, memory the rows hold (not kept prefixes, which make way for them) and preemptions,
        from any thread: it reads copies of the engine thread's lists and never waits for a round."""
        lives = [*self._prefilling, *self._decoding]
        held = plan.batch_bytes(self.dims, self._needs(lives, 0))
        waiting = len(self._waiting) + self._inbox.qsize()  # (opened, not yet taken in by the MLX thread)
        return plan.SchedulerState(len(lives), waiting, held / self.budget if self.budget else 0.0, self.preemptions)

    def _describe_stages(self) -> None:
        self._stages = [dict(index=i, **s.describe()) for i, s in enumerate(self.stages)]

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
        self._preempt()
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

    def _needs(self, lives: list[Live], horizon: int | None) -> list[plan.Footprint]:
        """What these rows hold, in their order, once each has `horizon` tokens more (None: at their ends)."""
        return [x.need(horizon) for x in lives]

    def _admit(self) -> None:
        # (stable: first come, first served within a priority; a new list, as other threads count this one)
        self._waiting = sorted(self._waiting, key=lambda x: x.req.priority)
        needs = self._needs(self._waiting, self.horizon)
        waiting = [plan.Waiting(x.seq_id, need, x.queued, preempted=bool(x.order))
                   for x, need in zip(self._waiting, needs)]
        running = self._needs(self._prefilling + self._decoding, self.horizon)
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
            self._admissions += 1
            live.order = self._admissions
            if not live.resumed:
                live.started = time.perf_counter()
            self._reuse(live)
            self._prefilling.append(live)
            if live.admitted is not None:
                live.admitted, told = None, live.admitted
                told()
        still = {x.seq_id for x in self._waiting}
        for seq_id in plan.expired([w for w in waiting if w.seq_id in still], time.monotonic(), self.queue_timeout):
            live = next(x for x in self._waiting if x.seq_id == seq_id)
            self._finish(live, ServerBusy(f"no room for this request after {self.queue_timeout:.0f} s in the queue",
                                          retry_after=max(1, int(self.queue_timeout // 4))))

    def _preempt(self) -> None:
        """Where the running rows, each grown by its next round, outgrow the budget: drop kept prefixes,
        then take the last admitted rows of the lowest priority out (their caches freed on every stage) to
        the head of the queue, until the others fit."""
        lives = sorted(self._prefilling + self._decoding, key=lambda x: (x.req.priority, x.order))
        needs = self._needs(lives, horizon=1)
        kept = sum(k.nbytes for k in self._kept.values())
        if len(lives) < 2 or plan.batch_bytes(self.dims, needs) + kept <= self.budget:
            return
        self._fit(needs)
        budget = self.budget - sum(k.nbytes for k in self._kept.values())
        for live in reversed(lives[len(lives) - plan.to_preempt(needs, self.dims, budget):]):
            log.info("sequence %s preempted after %d tokens: it waits for memory", live.seq_id, live.generated)
            for group in (self._prefilling, self._decoding):
                if live in group:
                    group.remove(live)
            self._waiting.insert(0, live)  # (first: whatever fails below, it is held, and ends with the engine)
            for stage in self.stages:
                try:
                    stage.release(live.seq_id)
                except Exception:
                    log.exception("releasing %s failed", live.seq_id)
            live.seq_id = uuid.uuid4().hex  # (a new sequence on the stages, its prompt and tokens so far)
            live.prefilled, live.step, live.prefix, live.next_tokens = 0, 0, "", []
            if not live.resumed:  # (its prompt goes in again from the start, from a kept prefix or not)
                live.stats.cached_tokens = 0
                live.scored = [] if live.scored is not None else None
            live.stats.preempted += 1
            self.preemptions += 1

    def _prefill(self) -> None:
        """One prompt chunk for every sequence taking its prompt, in one forward (the prompt's last
        token goes alone, as its own step, and yields the first token). A preempted sequence's prompt is
        followed by the tokens it had, and goes on from there."""
        group = list(self._prefilling)
        needs = [max(1, len(x.tokens) - 1 - x.prefilled) for x in group]
        wide = plan.prefill_chunk(max(needs), self.prefill_chunk, bool(self._decoding), self._round_s,
                                  self._prefill_token_s * len(group))
        n = plan.fill_width(needs, wide, self._narrowed)
        self._narrowed = self._narrowed + 1 if n < wide else 0
        reqs = []
        for live in group:
            prompt = live.tokens
            left = len(prompt) - 1 - live.prefilled
            chunk, final = (prompt[live.prefilled : live.prefilled + min(n, left)], False) if left > 0 \
                else (prompt[-1:], True)
            first = live.step == 0
            params = live.req.params
            if live.resumed and params.prompt_logprobs >= 0:  # (its prompt was scored already)
                params = dataclasses.replace(params, prompt_logprobs=-1)
            reqs.append(StepRequest(live.seq_id, live.step, StepKind.PREFILL, chunk, final=final,
                                    params=params if first else None,
                                    mtp_depth=live.req.mtp_depth if first else 0, mtp_auto=live.req.mtp_auto and first,
                                    prefix=live.prefix if first else "",
                                    budget=max(1, live.req.max_tokens - live.generated) if final else 0,
                                    stop_tokens=tuple(sorted(live.ends)) if final else (),
                                    resumed_at=len(live.req.prompt_tokens) if live.resumed and first else 0))
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
            if not live.resumed:
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
            if not live.resumed:  # (a preempted one's decode time runs on from its first token)
                live.started = time.perf_counter()
            self._emit(live, out)

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
        cached = live.stats.cached_tokens if not live.emitted else None  # (told with its first chunk)
        live.emitted += out.tokens
        new, finish = take_tokens(out.tokens, live.ends, live.text, live.generated, live.req.max_tokens)
        live.generated += len(new)
        live.stats.generation_tokens = live.generated
        logprobs = out.logprobs[: len(new)] if live.req.params.top_logprobs >= 0 else None
        scored, live.scored = live.scored, None
        if finish is None:
            live.next_tokens = [out.tokens[-1], *out.drafts]
            live.sink(GenerationChunk(text=live.text.release(final=False), tokens=new, logprobs=logprobs,
                                      prompt_logprobs=scored, cached_tokens=cached))
            return
        live.stats.decode_seconds = time.perf_counter() - live.started
        live.stats.ended_within(out, len(new))
        live.sink(GenerationChunk(text=live.text.release(final=True), tokens=new, finish_reason=finish,
                                  stats=live.stats, logprobs=logprobs, prompt_logprobs=scored,
                                  stop_reason=stop_reason(finish, new, live.text, live.req), cached_tokens=cached))
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
