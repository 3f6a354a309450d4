"""The ring engine: many sequences over a pipeline of nodes, in groups whose rounds circle the nodes.

The coordinator only forms groups and listens. A request is prefilled (its chunks in flight along
the nodes, pipeline/remote.py) with the group it joins named on every chunk; the last node then puts
it in that group (node/groups.py) and from there on every round of the group starts on the last node
and goes straight to the first. Each round's outcome for the row comes back on the subscription;
the engine detokenizes it, ends the request at EOS, a stop string or max_tokens, and releases the
sequence. Several groups are in flight at once (scheduler.ring_groups), so while one group is on
node i another is on node i+1. While rows decode, a prompt goes in chunks of about a node's share of
a group round, so the groups behind a chunk are not held up for long. Requests are admitted by the
memory each node has for its layers' caches, and preempted where rows outgrow it (ring_room.py).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...node.protocol import StageError, StageUnavailable, StepOutput
from . import scheduler as plan
from .kept import KeptPrefixes
from .ring_live import RingHandle, RingLive
from .ring_room import RingRoom, RoomForRows
from .sinks import END, guarded, stream
from .detokenizer import TextStream
from .request import (GenerationChunk, GenerationRequest, GenerationResult, GenerationStats, check_request,
                      check_vocabulary, collect, ended_in_stages, stop_reason, take_tokens)

log = logging.getLogger(__name__)

Sink = Callable[[Any], None]
DEFAULT_MAX_ROWS = 32
DEFAULT_QUEUE_TIMEOUT_S = 60.0
GROUPS_REFRESH_S = 10.0  # how often the number of groups is reconsidered from the nodes' rounds and hops
RESUME_WINDOW_S = 30.0  # a request whose node is lost waits this long for the pipeline to come back
MEASURED_PROMPT = 64  # prompts at least this long time the pipeline's seconds per prompt token
TRIP_OUTLIER = 2.0  # a trip counts as at most this many times the running figure (a stall, a lost node)
# A row with no round for this long fails as its node lost: the backstop for rounds that stop while every node
# answers (a node lost or hung is found sooner: the keepalive, lease renewals, the last node's idle groups).
ROW_STALL_S = 60.0
MAX_RESUMES = 3  # a request lost more often than this fails: a fault that comes back at once is not going away


class RingEngine(RoomForRows):
    batching = "ring"  # groups of rows whose rounds circle the nodes

    def __init__(self, pipeline: Any, tokenizer: Any, eos_token_ids: set[int] | list[int], max_context: int,
                 has_mtp: bool, vocab_size: int, *, prefill_chunk: int, room: RingRoom | None = None,
                 queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_S, groups: int | None = None,
                 resume_window: float = RESUME_WINDOW_S, row_stall: float = ROW_STALL_S,
                 dims: plan.ModelDims | None = None, prefix_cache: int = 0):
        self.pipeline = pipeline  # a RemotePipeline whose last node starts rounds itself
        # Prompt prefixes the nodes keep (kept.py), within `prefix_cache` bytes over all nodes.
        self.kept = KeptPrefixes(dims, prefix_cache, pipeline.drop_prefix) if dims and prefix_cache > 0 else None
        if self.kept is not None:
            pipeline.on_kept = self.kept.heard
        self.tokenizer, self.eos = tokenizer, set(eos_token_ids)
        self.max_context, self.has_mtp, self.vocab_size = max_context, has_mtp, vocab_size
        self.prefill_chunk, self.queue_timeout, self.resume_window = prefill_chunk, queue_timeout, resume_window
        # Who waits for room on the nodes and who holds it (ring_room.py; none measured: by count)
        self.room = room or RingRoom(None, has_mtp, max_rows=DEFAULT_MAX_ROWS)
        self.max_rows = max_rows = self.room.max_rows
        self.fixed_groups, self.row_stall = groups, row_stall
        self.groups = groups or len(pipeline.nodes)
        self._pool = ThreadPoolExecutor(max_rows + 1, thread_name_prefix="ring-prefill")
        self._resumes = ThreadPoolExecutor(max_rows, thread_name_prefix="ring-resume")  # (never behind admissions)
        self._lock = threading.Lock()
        self._rows: dict[int, int] = {}  # group -> live rows in it
        self._rows_peak = 0  # for the groups in flight: the most live rows since they were last reconsidered,
        self._hop_s: dict[str, float] = {}  # and each link's hop, the quickest seen
        # Measured here, to size prompt chunks while rows decode: a group's trip around the nodes
        # (between two outcomes of a row), a prompt's seconds per token through the pipeline, and until
        # a prompt alone is timed (under steady load, never) the nodes' seconds per prompt token, added up.
        self._trip_s, self._token_s, self._node_token_s = 0.0, 0.0, 0.0
        self._decoding: dict[int, RingLive] = {}  # id(live) -> rows whose prompt is through (watched)
        self._queued: dict[int, RingLive] = {}  # id(live) -> admission or resume not started (ended by close())
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="ring-watch", daemon=True).start()

    # -- any thread -------------------------------------------------------------------------------

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))

    constrains = property(lambda self: bool(getattr(self.pipeline, "constrains", False)))  # (its last node: grammars)
    keeps_prefixes = property(lambda self: self.kept is not None)  # (a prompt's other choices start from its prefix)

    def validate(self, req: GenerationRequest) -> None:
        check_request(req, max_context=self.max_context, has_mtp=self.has_mtp, constrains=self.constrains)
        check_vocabulary(req, self.vocab_size)

    def open(self, req: GenerationRequest, sink: Sink, admitted: Callable[[], None] | None = None) -> RingHandle:
        """Queue a request; its chunks, then END or an exception, go to `sink` (from another thread),
        and `admitted()` is called once it has a row."""
        self.validate(req)
        if (refused := self._down_refusal()) is not None:
            raise refused
        # 64 random bits for an id: every group frame names each of its rows
        live = RingLive(uuid.uuid4().hex[:16], req, sink, TextStream.of(self.tokenizer, req),
                        GenerationStats(prompt_tokens=len(req.prompt_tokens)), time.monotonic(), on_admit=admitted,
                        ends=req.ends(self.eos))
        handle = RingHandle(self, live)
        live.sink = guarded(sink, handle.cancel, live.seq_id)  # (a client callback that fails cancels)
        if admitted is not None:
            live.on_admit = guarded(admitted, handle.cancel, live.seq_id)
        with self._lock:
            if self._stop.is_set():
                raise StageUnavailable("the engine was stopped")
            self._queued[id(live)] = live
            self.room.queue(live)
        self._admit()
        return handle

    def generate(self, req: GenerationRequest) -> Iterator[GenerationChunk]:
        return stream(lambda sink: self.open(req, sink))

    def complete(self, req: GenerationRequest) -> GenerationResult:
        return collect(self.generate(req))

    def describe(self) -> dict[str, Any]:
        out = self.pipeline.describe()
        with self._lock:
            out["ring"] = {"groups": self.groups, "max_rows": self.max_rows,
                           "rows": {str(g): n for g, n in sorted(self._rows.items()) if n}, **self.room.describe()}
        out["ring"].update(self.kept.describe() if self.kept is not None else {})
        return out

    def close(self) -> None:
        with self._lock:
            self._stop.set()
            queued, self._queued = list(self._queued.values()), {}
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._resumes.shutdown(wait=False, cancel_futures=True)
        for live in queued:  # (those whose admission or resume never starts now: every request ends)
            self._finish(live, StageUnavailable("the engine was stopped"))
        self.pipeline.close()

    # -- a request's life -------------------------------------------------------------------------

    def _start(self, live: RingLive) -> None:
        """Its room on the nodes is there: the prompt goes in (a thread of the pool: prefill waits on the
        nodes). One preempted goes on as a new sequence: its prompt and the tokens it had go in again."""
        with self._lock:  # (until here, close() ends it)
            self._queued.pop(id(live), None)
        with live.lock:
            if live.done:  # cancelled while it waited
                self._give_back(live)
                return
            again = live.admitted
            live.resuming = True  # (room and nothing on the nodes: a cancel from here gives the room back)
        down = self.pipeline.reformer.down  # its prompt waits for the pipeline, as a lost row's does
        if down is not None and not self.pipeline.reformer.wait(self.resume_window):
            return self._finish(live, StageUnavailable(str(down)), released=True)
        with live.lock:
            if live.done:  # (cancelled meanwhile: its room went back then)
                return
            if again:  # (a new sequence since it was preempted)
                live.expected, live.early = 0, {}
            live.resuming, live.admitted = False, True
            self._place(live, live.group)
            live.prefilling = True  # (from here a cancel leaves the release to `_prefill`)
        if live.on_admit is not None and not again:
            live.on_admit()
        self._prefill(live)

    def _place(self, live: RingLive, group: int | None) -> None:
        """Into `group` (None: the one with the fewest rows); its outcomes come to this request (under live.lock)."""
        with self._lock:
            live.group = plan.pick_group(self._rows, self.groups) if group is None else group
            self._rows[live.group] = self._rows.get(live.group, 0) + 1
            self._rows_peak = max(self._rows_peak, sum(self._rows.values()))
        self.pipeline.row_sinks[live.seq_id] = lambda item, seq=live.seq_id: self._on_row(live, seq, item)

    def _prefill(self, live: RingLive) -> None:
        """The prompt, and after a resume the tokens already handed out, in chunks; then the row
        decodes in its group for the tokens still wanted."""
        req, began = live.req, time.perf_counter()
        prompt = req.prompt_tokens + live.emitted
        reformer, drafts = self.pipeline.reformer, req.mtp_depth > 0
        kept = self.kept if self.kept is not None and reformer.down is None else None  # (none while down)
        epoch = reformer.down_at if kept else 0.0
        # A resumed request goes on from a kept prefix within its prompt only: a node rebuilds what its
        # penalties count from the tokens it is sent, and a prefix's own tokens are not among them.
        within = req.prompt_tokens if live.emitted else prompt
        scored = req.params.prompt_logprobs >= 0 and not live.emitted  # (read as the whole prompt goes in)
        hit = kept.reuse(within, drafts, epoch, wait=min(1.0, 0.05 + 4 * self._trip_s)) if kept and not scored else None
        start = len(hit.tokens) if hit else 0
        keep = kept.keep_as(live.seq_id, prompt, drafts, start) if kept else ""
        live.keep_end, live.kept_epoch = (kept.end_key(live.seq_id, prompt) if kept else ""), epoch
        if not live.emitted:
            live.stats.cached_tokens = start
        body = prompt[start:-1]
        size, alone = self._chunk_size(len(body))
        chunks = [(body[i : i + size], False) for i in range(0, len(body), size)]
        chunks.append((prompt[-1:], True))
        steps = live.prompt_steps(chunks, hit.key if hit else "", keep)
        seq_id = live.seq_id
        with live.lock:  # (`prefilling` was set where the row was placed)
            if live.done:  # cancelled before its prompt went out: nothing of it is on the nodes
                live.prefilling = False
                self._release(live, free=False)
                if hit:
                    kept.done(hit.key)
                return
        try:
            outs = self.pipeline.steps(steps, stop=lambda: live.done)  # (a client gone: no more chunks)
            out = outs[-1]
        except Exception as e:
            out = e
        if hit:
            kept.done(hit.key)
            if isinstance(out, StageError) and "no kept prompt prefix" in str(out):  # (a node forgot it)
                kept.forget(hit.key)
                out = StageUnavailable(f"{out}: the prompt goes in again, whole")  # (resumed)
        not_kept = isinstance(out, Exception) or out.keep_refused  # (refused: a node had no room for it)
        if keep and (not_kept or reformer.down is not None or reformer.down_at != epoch):
            kept.forget(keep)
        elif keep:
            kept.kept(keep, prompt, drafts, epoch)
        with live.lock:
            current = live.seq_id == seq_id  # (else a resume took over: its own prefill may be under way)
            if current:
                live.prefilling = False
            if live.lost_prompt is not None and live.lost_prompt[0] == seq_id:
                lost, live.lost_prompt = live.lost_prompt, None
                self._free(*lost)  # lost while it went in, released but for this: freed now
                return
            if not current:
                return
            if live.done:  # cancelled meanwhile: now that the prompt is through, free it everywhere
                self._release(live)
                return
        if isinstance(out, Exception):
            self._on_row(live, seq_id, out)
            return
        now = time.perf_counter()
        if alone and len(prompt) >= MEASURED_PROMPT:  # (with rows decoding, their rounds would count)
            with self._lock:
                self._token_s = plan.ema(self._token_s, (now - began) / len(prompt))
        if not live.emitted:  # (a resumed request's decode time runs on from its first token, through this)
            live.stats.prefill_seconds += now - began
            live.started = now
        with self._lock:
            live.last_at = now  # (a row resumed after a long wait is not stalled)
            self._decoding[id(live)] = live
        live.scored = [x for o in outs for x in o.prompt_logprobs] if scored else None  # (this sequence's, current)
        self._deliver(live, seq_id, 0, out)

    def _on_row(self, live: RingLive, seq_id: str, item: StepOutput | Exception) -> None:
        """A group round's outcome for this row, or an error about it (the subscription's thread).
        A lost node does not end the request while the pipeline may come back: it resumes."""
        if isinstance(item, Exception):
            if live.seq_id != seq_id:  # (an earlier sequence's, freed: its request went on)
                return
            if isinstance(item, StageUnavailable) and self.resume_window > 0 and live.resumes >= MAX_RESUMES:
                # the same fault again and again: it is not going away
                item = StageUnavailable(f"{item} (lost {live.resumes + 1} times: the request ends)")
            elif isinstance(item, StageUnavailable) and self.resume_window > 0:
                with live.lock:
                    resume = not live.done and not live.resuming and live.seq_id == seq_id
                    if resume:
                        live.resuming = True
                        self._end_kept(live, None)  # (its row's end, kept as it was lost, goes)
                        # the lost sequence: freed where it survived once no chunk of its prompt is on its way
                        self._release(live, slot=False, free=not live.prefilling)
                        if live.prefilling:
                            live.lost_prompt = (live.seq_id, live.group)
                with self._lock:  # (once close() has run, nothing resumes)
                    stopped = self._stop.is_set()
                    if resume and not stopped:
                        self._queued[id(live)] = live
                        self._resumes.submit(self._resume, live, item)
                if resume and stopped:
                    self._finish(live, item)
                return
            with live.lock:  # (again under its lock: a preemption may have freed this sequence meanwhile)
                if live.seq_id == seq_id and not live.resuming:
                    self._finish(live, item)
            return
        self._deliver(live, seq_id, item.step + 1, item)
        self._make_room()

    def _resume(self, live: RingLive, error: Exception) -> None:
        """Wait for the pipeline to be formed again, then go on as a new sequence: the prompt and the
        tokens already handed out are prefilled, and decoding continues where it stopped."""
        log.info("request %s waits for the pipeline (%s)", live.seq_id, error)
        back = self.pipeline.reformer.wait(self.resume_window)
        with self._lock:  # (until here, close() ends it)
            self._queued.pop(id(live), None)
        if not back:  # (resuming until it has finished: a cancel meanwhile frees nothing twice)
            self._finish(live, error, released=True)
            return
        with live.lock:
            if live.done:  # cancelled while it waited (its room went back then)
                return
            live.seq_id = uuid.uuid4().hex[:16]
            live.expected, live.early, live.resuming = 0, {}, False
            live.resumes += 1
            self._place(live, None)
            live.prefilling = True
        self._prefill(live)

    def _deliver(self, live: RingLive, seq_id: str, order: int, out: StepOutput) -> None:
        """Outcomes of its sequence `seq_id` in order: the prefill's, then the group rounds' (the prefill's
        thread may hand its own over after the first round's has arrived). An earlier sequence's are late."""
        with live.lock:
            if live.done or live.seq_id != seq_id:
                return
            live.early[order] = out
            while not live.done and live.expected in live.early:
                n, o = live.expected, live.early.pop(live.expected)
                live.expected += 1
                now = time.perf_counter()
                if n > 1 and n == order:  # between two rounds of its group as they came: one trip
                    with self._lock:
                        trip = now - live.last_at
                        cap = TRIP_OUTLIER * self._trip_s if self._trip_s else trip
                        self._trip_s = plan.ema(self._trip_s, min(trip, cap))
                live.last_at = now
                if n:
                    live.stats.record_round(o)
                self._emit(live, o, first=n == 0)

    def _emit(self, live: RingLive, out: StepOutput, first: bool) -> bool:
        """Hand the round's tokens to the request; True when that finished it."""
        req = live.req
        cached = live.stats.cached_tokens if not live.emitted else None  # (told with its first chunk)
        new, finish = take_tokens(out.tokens, live.ends, live.text, live.generated, req.max_tokens)
        live.generated += len(new)
        live.emitted += new
        live.stats.generation_tokens = live.generated
        logprobs = out.logprobs[: len(new)] if req.params.top_logprobs >= 0 else None
        scored, live.scored = live.scored, None  # (only until the prefill's outcome is handed out)
        if finish is not None and live.keep_end:  # (noted before the client hears: a next turn may come at once)
            if first and not out.continued:  # (it never joined a group: nothing is kept)
                live.keep_end = ""
            elif ended_in_stages(new, live.ends, live.generated, req.max_tokens):
                self._end_kept(live, [*req.prompt_tokens, *live.emitted[: len(live.emitted) - len(new)], *out.tokens])
            else:  # (what the last node kept, if anything, goes)
                self._end_kept(live, None)
        if finish is None and first and not out.continued:
            self._finish(live, RuntimeError(f"the last node did not put sequence {live.seq_id} in a group"))
            return True
        if finish is None:
            live.sink(GenerationChunk(text=live.text.release(final=False), tokens=new, logprobs=logprobs,
                                      prompt_logprobs=scored, cached_tokens=cached))
            return False
        live.stats.decode_seconds = time.perf_counter() - live.started
        live.stats.ended_within(out, len(new))
        live.sink(GenerationChunk(text=live.text.release(final=True), tokens=new, finish_reason=finish,
                                  stats=live.stats, logprobs=logprobs, prompt_logprobs=scored,
                                  stop_reason=stop_reason(finish, new, live.text, req), cached_tokens=cached))
        self._finish(live, None)
        return True

    def _end_kept(self, live: RingLive, fed: list[int] | None) -> None:
        """Its state at its end is kept, or not (`fed`: None), once the last node says the nodes kept it."""
        key, live.keep_end = live.keep_end, ""
        if key and self.kept is not None:
            self.kept.ended(key, fed, live.kept_epoch)

    def _finish(self, live: RingLive, error: BaseException | None, released: bool = False) -> None:
        """Take a request out (once): its row leaves the group and is freed on every node (once its
        prompt is through, if it is still on its way). A request waiting to resume has no sequence
        on the nodes (`released`): only its room is given back."""
        with live.lock:
            if live.done:
                return
            live.done = True
            self._end_kept(live, None)  # (ended otherwise: nothing of it is kept)
            if released or live.resuming or not live.admitted:  # (nothing of it on the nodes)
                self._give_back(live)
            elif not live.prefilling:
                self._release(live)
            if error is not None:
                live.sink(error)
            live.sink(END)

    def _release(self, live: RingLive, slot: bool = True, free: bool = True) -> None:
        self.pipeline.row_sinks.pop(live.seq_id, None)
        if free:
            self._free(live.seq_id, live.group)
        with self._lock:
            self._rows[live.group] -= 1
        if slot:
            self._give_back(live)

    def _watch(self) -> None:
        """Admit and preempt; fail rows whose rounds stopped coming (as lost: they may resume); choose the groups."""
        refresh_at = 0.0
        while not self._stop.wait(max(0.05, min(1.0, self.row_stall / 4, self.queue_timeout / 4))):
            try:
                self._tend()
                if time.monotonic() >= refresh_at:
                    self._refresh_groups()
                    refresh_at = time.monotonic() + GROUPS_REFRESH_S
                now = time.perf_counter()
                with self._lock:
                    for key in [k for k, live in self._decoding.items() if live.done]:
                        del self._decoding[key]
                    stalled = [(live, live.seq_id) for live in self._decoding.values() if not live.resuming
                               and not live.prefilling and live.last_at and now - live.last_at > self.row_stall]
                last = (getattr(self.pipeline, "addresses", None) or ["the last node"])[-1]
                for live, seq_id in stalled:
                    self._on_row(live, seq_id, StageUnavailable(
                        f"node {last}: no round of group {live.group} came back for {self.row_stall:.0f} s"))
            except Exception:  # (the watch goes on: the queue and stalled rows depend on it)
                log.exception("watching the ring failed")

    def _free(self, seq_id: str, group: int) -> None:
        try:
            self.pipeline.release(seq_id, group=group)
        except Exception:
            log.exception("releasing %s failed", seq_id)

    def _chunk_size(self, tokens: int) -> tuple[int, bool]:
        """A prompt's chunk: about a node's share of a group round while other rows decode (a chunk delays
        the groups behind it), the whole of `prefill_chunk` otherwise; and whether no other row decodes."""
        with self._lock:
            decoding = sum(self._rows.values()) > 1  # (this request is placed already)
            node_round = self._trip_s / max(self.groups, 1)
            size = plan.prefill_chunk(max(tokens, 1), self.prefill_chunk, decoding, node_round,
                                      self._token_s or self._node_token_s)
            return size, not decoding

    def _refresh_groups(self) -> None:
        """Groups in flight, from the nodes' measured rounds and hops (on the watch's thread: a node busy
        in a step answers late, and neither an admission nor a row's outcome waits for it)."""
        try:
            health = self.pipeline.health(probe_next=not self.fixed_groups, timeout=1.0)  # (hops: for groups)
        except Exception as e:  # keep the last choice; the nodes' own errors reach the requests
            log.debug("no rounds timed from the nodes: %s", e)
            return
        self.room.measure(health)  # (the nodes' layers change with a heal)
        self._hop_s = plan.quickest_hops(self._hop_s, {f"{h.node_id}>{h.next}": h.next_rtt_ms
                                                       for h in health if h.next})
        stages = [plan.StageRound(h.round_fixed_ms / 1000.0, h.round_row_ms / 1000.0) for h in health]
        token_s = sum(h.prefill_seconds / h.prefill_tokens for h in health if h.prefill_tokens)
        with self._lock:
            rows, self._rows_peak = self._rows_peak, sum(self._rows.values())
            if not self.fixed_groups and rows > 0:  # (no rows since the last look: nothing to go by)
                self.groups = plan.ring_groups(stages, rows, list(self._hop_s.values()))
            self._node_token_s = token_s
