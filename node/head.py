"""The last stage's head: hidden states in, token ids out.

It runs the acceptance walk of a decode step against the drafts it made itself, picks the
correction or bonus token, and drafts the next round with the MTP head, as many drafts as the
request asked for or, with `mtp_auto`, as depth.py finds pays best. Its per-sequence state (the MTP
cache, the RNG, the pending drafts and what they were drawn from) never leaves this node.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from ..models.draft_vocab import DraftVocab, default_size
from ..models.mtp import DEFAULT_WINDOW, attended, entries_only_pays
from ..models.shard import queue_layers
from .acceptance import accept_coupled, accept_greedy, accept_sampled, draw, filtered_probs, gumbel_pick
from .depth import PRIOR_ROUNDS, DepthChooser, StageCosts
from .device_sampling import drafts_on_device, draw_drafts
from .constraints import Grammars, constraint_for
from .processors import (History, LogprobTable, apply, bias_vector, draft_row, has_processors, logprob_table,
                         read_logprobs)
from .protocol import Commit, SamplingParams, StepKind, StepOutput, StepRequest
from .scoring import PromptScores


@dataclass
class DraftState:
    """Last-stage state of one sequence: the MTP cache and what the pending drafts were drawn from."""

    params: SamplingParams
    depth: int  # drafts of the next round
    rng: np.random.Generator  # unseeded sampling
    mtp_cache: KVCache | None
    chooser: DepthChooser | None = None  # mtp_auto: picks `depth` before each round
    joins_at: int | None = None  # auto, joining a batch whose rows share one depth: that depth (first round)
    mtp_len: int = 0  # MTP cache entries built from true backbone hiddens (positions 0..mtp_len-1)
    pending_hidden: mx.array | None = None  # hidden of the last position whose next token is unknown
    # (hidden, next token) pairs not yet in the MTP cache: kept while rounds carry no drafts
    idle_hidden: list[mx.array] = field(default_factory=list)  # joined once, when drafting resumes
    idle_tokens: list[int] = field(default_factory=list)
    last_hidden: mx.array | None = None  # hidden of the last position fed, whose pair went in last
    left: int | None = None  # tokens it may still emit, from its prompt's last step (None: not told)
    stops: frozenset[int] = frozenset()  # tokens that end it
    last_token: int | None = None  # the token the next decode step must start with
    drafts: list[int] = field(default_factory=list)
    draft_probs: np.ndarray | None = None  # [K, V], sampling only
    handed_out: float = 0.0  # when the last drafts left this stage (perf_counter); 0: after a prefill
    last_drafted: int = -1  # drafts the last round carried
    prior_rounds: int = 0  # its rounds with drafts counted in the stage's acceptance
    draft_seconds: float = 0.0  # what drafting them cost
    # Rounds queued ahead (on_token, on_drafts, or once a processed round's token is known): what queuing
    # this round's cost during the last round, and what queuing the next round's costs during this one.
    ahead_done: float = 0.0
    ahead_next: float = 0.0
    history: History = field(default_factory=History)  # for the logits processors, and positions
    bias: mx.array | None = None  # logit_bias as a dense row, for the drafts (made on first use)
    key: mx.array | None = None  # for draws on the device (device_sampling.py), seeded from `rng`
    scores: PromptScores | None = None  # its prompt's log-probabilities, where asked (scoring.py)

    @property
    def processed(self) -> bool:
        return has_processors(self.params, self.history)

    def pick(self, p: np.ndarray, offset: int = 0) -> int:
        """A sampled token (or draft) for the position `offset` after the sequence's end: keyed by
        the seed and that position if the request has a seed (acceptance.py), else from the RNG."""
        if self.params.seed is not None:
            return gumbel_pick(p, self.params.seed, self.history.length + offset)
        return draw(p, self.rng)

    def next_key(self) -> mx.array:
        """A fresh key for a draw on the device."""
        if self.key is None:
            self.key = mx.random.key(int(self.rng.integers(2**63)))
        pair = mx.random.split(self.key)
        self.key = pair[0]
        return pair[1]

    def accept(self, p: np.ndarray, drafts: list[int]) -> tuple[int, list[int]]:
        """Sampled acceptance of this round's drafts against the target rows `p` [K+1, V]."""
        if self.params.seed is not None:
            return accept_coupled(p, drafts, self.params.seed, self.history.length)
        return accept_sampled(p, self.draft_probs, drafts, self.rng)

    def joins(self, depth: int | None) -> None:
        """After its prompt's last chunk it joins a batch whose `auto` rows run `depth` (None: not chosen)."""
        if self.chooser is not None:
            self.joins_at = depth

    def pairs_to_draft(self, hid: mx.array, toks: list[int]) -> tuple[mx.array | None, list[int]]:
        """This round's (hidden, next token) pairs, after those kept from rounds without drafts; at
        depth 0 they are all kept for when drafting pays again, and (None, []) is returned."""
        self.last_hidden = hid[:, -1:]
        if self.depth == 0:
            self.idle_hidden.append(hid)
            self.idle_tokens += toks
            self.drafts, self.draft_probs = [], None
            return None, []
        if self.idle_hidden:
            hid, toks = mx.concatenate([*self.idle_hidden, hid], axis=1), self.idle_tokens + toks
            self.idle_hidden, self.idle_tokens = [], []
        return hid, toks

    def bias_row(self, vocab: int) -> mx.array | None:
        if self.params.logit_bias and self.bias is None:
            self.bias = bias_vector(self.params, vocab)
        return self.bias


def new_draft_state(req: StepRequest, grammars: Grammars | None = None) -> DraftState:
    """A sequence's head state; its grammar compiled with `grammars` (StageError where there are none)."""
    params = req.params or SamplingParams()
    seed = params.seed % 2**64 if params.seed is not None else int(np.random.SeedSequence().entropy % 2**63)
    chooser = DepthChooser(req.mtp_depth) if req.mtp_auto and req.mtp_depth > 0 else None
    return DraftState(params=params, depth=req.mtp_depth, rng=np.random.default_rng(seed),
                      mtp_cache=KVCache() if req.mtp_depth > 0 else None, chooser=chooser,
                      history=History(generated_from=req.resumed_at, constraint=constraint_for(params, grammars)),
                      scores=PromptScores(params.prompt_logprobs) if params.prompt_logprobs >= 0 else None)


class Prepared(NamedTuple):
    """A step's head part, queued behind its forward (`Head.prepare`, `BatchHead.prepare`)."""

    normed: mx.array
    picks: mx.array  # the greedy pick at every position (a sample drawn on the device at the first, on `sampled` rows)
    logits: mx.array | None  # where the sequence samples, processes or reports its logits
    logprobs: LogprobTable | None  # where it reports them
    sampled: tuple[int, ...] = ()  # rows whose first pick is a sample (device_sampling.py)

    def arrays(self) -> list[mx.array]:
        return [self.picks, *(self.logprobs.arrays() if self.logprobs is not None else [])]


class Head:
    """Token selection, acceptance and drafting over a shard that holds the last layer."""

    def __init__(self, model: object, mtp_pre_norm: bool = False, layers_total: int = 0,
                 draft_vocab: int | None = None, mtp_window: int | None = None):
        self.model = model
        # The MTP head reads the backbone hidden after the final norm (vLLM, SGLang, llama.cpp) unless
        # told to read it before (mlx-lm PR #990); post-norm measured better on trained checkpoints.
        self.mtp_pre_norm = mtp_pre_norm
        self.layers_total = layers_total or len(model.layers)
        self.costs: StageCosts | None = None  # calibrated on the first sequence with mtp_auto
        # Sequences with logits processors are measured apart: each round does more on the host, and
        # one without drafts is queued only once its token is known, so they cost more than plain ones;
        # and the processors move the target away from the drafts, so fewer are accepted. (A sampled
        # sequence's round without drafts is also queued once its token is drawn; those share the
        # plain table, whose rounds with drafts they queue as greedy ones do.)
        self.processed_costs: StageCosts | None = None
        # Drafts score only the most frequent tokens (None: the default share of the vocabulary).
        self.vocab: DraftVocab | None = None
        if model.has_mtp:
            size = default_size(model.config.args.vocab_size) if draft_vocab is None else draft_vocab
            self.vocab = DraftVocab(model, size)
        # Each draft position attends to this many before it only (models/mtp.py; None: all of them).
        if mtp_window is not None and mtp_window < 0:
            raise ValueError(f"mtp_window must be 0 (the whole context) or more, got {mtp_window}")
        self.mtp_window = (DEFAULT_WINDOW if mtp_window is None else mtp_window) or None
        self.grammars: Grammars | None = None  # where the stage's process holds the tokenizer (constraints.py)

    def prepare(self, h: mx.array, d: DraftState, drafts: list[int]) -> Prepared:
        """A step's head part, all still lazy: queued with the forward that makes `h`, the whole next
        step, log-probabilities included, computes while the host handles this one. For a sequence
        with processors, `d.history` must already hold every token before the step's."""
        normed = self.model.final_norm(h)
        logits = self._process(d, self.model.lm_logits(normed), drafts)
        picks = mx.argmax(logits, axis=-1).reshape(-1)
        report = d.params.top_logprobs >= 0
        table = logprob_table(logits, d.params.top_logprobs) if report else None
        return Prepared(normed, picks, logits if d.processed or report or not d.params.greedy else None, table)

    def run(self, req: StepRequest, d: DraftState, h: mx.array, caches: list, context: int,
            on_token: Callable[[mx.array], None] | None = None,
            on_drafts: Callable[[StepOutput, mx.array | None], None] | None = None,
            prepared: Prepared | None = None) -> StepOutput:
        """One step's tokens from the last layer's hidden states `h` (`context` positions in the caches).
        The next round can be queued before the host waits for this one: `on_token` gets a greedy pick
        while it is still lazy when the next round is that token alone, `on_drafts` the output and the
        next round's drafts, still lazy (None for drafts drawn on the host, a seed's, or a sequence with
        processors: `out.drafts`, once known); `prepared` is what `prepare` made of `h` for a round
        queued so. A sampled sequence, or one with processors, gets its next round without drafts
        queued once this round's token is known and in its history."""
        # A processed pick depends on the tokens before it, a sample is drawn on the host: the next round waits for it.
        queue_token, on_token = (on_token, None) if d.processed or not d.params.greedy else (None, on_token)
        normed = self.model.final_norm(h) if prepared is None else prepared.normed
        mtp_in = h if self.mtp_pre_norm else normed  # which backbone hidden feeds the MTP head
        out = StepOutput(seq_id=req.seq_id, step=req.step)
        if d.chooser is not None and (self.costs is None or d.chooser.kmax > self.costs.kmax):
            fresh = self.calibrate(d.chooser.kmax, h.dtype)
            self.costs = fresh if self.costs is None else self.costs.widened(fresh.prior)
            self.processed_costs = None
        prefill = req.kind is StepKind.PREFILL
        if prefill:
            self.observe(req.tokens)
            d.history.extend_prompt(req.tokens, req.stop_tokens if req.final else None)  # (ends: before a pick)
            self._extend_mtp(d, mtp_in, req.tokens)
            if d.scores is not None:
                out.prompt_logprobs = d.scores.read(self.model, normed, req.tokens, req.final)
            if not req.final:
                mx.eval(normed, [c.state for c in caches], d.mtp_cache.state if d.mtp_cache else [])
                return out
            self._choose(d, context)
            logits = self._logits(d, normed[:, -1:], [], None)
            table = self._table(d, logits, None)
            out.tokens = [self._pick(d, logits, on_token)]
            if req.budget:  # (a batch's rounds end it there: batch_head.py)
                d.left, d.stops = req.budget - 1, frozenset(req.stop_tokens)
            hid, toks = d.pending_hidden, out.tokens
            d.pending_hidden = None
        elif len(req.tokens) == 1:
            self._choose(d, context)  # before the pick: with no drafts next, the next forward starts on it
            logits = self._logits(d, normed[:, -1:], [], prepared)
            table = self._table(d, logits, prepared)
            out.tokens = [self._pick(d, logits, on_token, None if prepared is None else prepared.picks)]
            self._observe(d, 0, context)
            out.commit = Commit(step=req.step, accepted=0, trim=0)
            hid, toks = mtp_in, out.tokens
        else:
            logits = self._logits(d, normed, req.tokens[1:], prepared)
            table = self._table(d, logits, prepared)
            n, out.tokens = self._accept(d, logits, req.tokens[1:], None if prepared is None else prepared.picks)
            out.accepted, out.drafted = n, len(req.tokens) - 1
            self._observe(d, out.drafted, context)
            self.record(d, out.drafted, n)
            self._choose(d, context)
            out.commit = Commit(step=req.step, accepted=n, trim=out.drafted - n)
            # Positions y, d1..dn pair with d1..dn, c: their MTP entries are rebuilt from true hiddens.
            hid, toks = mtp_in[:, : n + 1], out.tokens
        d.last_token = out.tokens[-1]
        d.history.emit(out.tokens)
        self.observe(out.tokens)
        if table is not None:
            out.logprobs = read_logprobs(table, [(0, out.tokens, d.params.top_logprobs)])[0]
        if queue_token is not None and d.depth == 0 and (len(req.tokens) == 1 or prefill):
            start = time.perf_counter()
            queue_token(mx.array(out.tokens[-1]))
            d.ahead_next = time.perf_counter() - start
        if d.mtp_cache is not None:
            d.mtp_cache.trim(d.mtp_cache.offset - d.mtp_len)  # drop last round's chained entries
            start, queuing, queued = time.perf_counter(), 0.0, False

            def ahead(drafts: mx.array | None) -> None:
                """The next verify, queued on the drafts still computing (None: on `out.drafts`)."""
                nonlocal queuing, queued
                began = time.perf_counter()
                on_drafts(out, drafts)
                d.ahead_next = queuing = time.perf_counter() - began
                queued = True

            out.drafts = self._draft(d, hid, toks, ahead if on_drafts is not None and not d.processed else None)
            d.draft_seconds = time.perf_counter() - start - queuing
            if on_drafts is not None and not queued and out.drafts:
                ahead(None)  # processed against the drafts, or drafts drawn on the host: once they are known
        d.ahead_done, d.ahead_next = d.ahead_next, 0.0
        d.handed_out = 0.0 if prefill else time.perf_counter()
        return out

    def observe(self, tokens: list[int]) -> None:  # (tokens seen here rank the draft vocabulary)
        if self.vocab is not None:
            self.vocab.observe(tokens)

    @staticmethod
    def _process(d: DraftState, logits: mx.array, drafts: list[int]) -> mx.array:
        return apply(logits, [(0, d.params, d.history, drafts)]) if d.processed else logits

    def _logits(self, d: DraftState, normed: mx.array, drafts: list[int],
                prepared: Prepared | None) -> mx.array | None:
        """A step's processed logits; None when the picks `prepare` queued are all the step needs."""
        if prepared is not None:
            return prepared.logits
        return self._process(d, self.model.lm_logits(normed), drafts)

    @staticmethod
    def _table(d: DraftState, logits: mx.array | None, prepared: Prepared | None) -> LogprobTable | None:
        """A step's log-probabilities, if the sequence reports them: computed now, before the next round
        may be queued, so reading them never waits on that round."""
        if d.params.top_logprobs < 0:
            return None
        if prepared is not None:
            return prepared.logprobs
        table = logprob_table(logits, d.params.top_logprobs)
        mx.eval(*table.arrays())
        return table

    def _choose(self, d: DraftState, context: int) -> None:
        """The next round's depth: its own chooser's, or for a sequence about to join a batch, the
        depth the batch's rows run (this stage's own round costs are never timed in a batch)."""
        if d.chooser is not None and d.joins_at is not None:
            d.depth, d.joins_at = min(d.joins_at, d.chooser.kmax), None
        elif d.chooser is not None:
            d.depth = d.chooser.next_depth(self.costs_for(d), context)

    def _observe(self, d: DraftState, drafted: int, context: int) -> None:
        """A whole round, from handing out `drafted` drafts to knowing their verdict, plus drafting them;
        a round queued ahead is charged its own forward, not the next one's. Only a round at the depth
        of the one before is timed: the first after a change (or a prefill) also pays for what the
        change cost once (no round queued ahead of it, the rest of the prompt's work)."""
        steady, d.last_drafted = drafted == d.last_drafted, drafted
        if self.costs is not None and d.handed_out and steady:
            seconds = time.perf_counter() - d.handed_out + d.draft_seconds + d.ahead_done - d.ahead_next
            self.costs_for(d).observe(drafted, context, seconds)

    def record(self, d: DraftState, drafted: int, accepted: int) -> None:
        """A verdict on drafts: the sequence's own (auto) and, from each sequence's first PRIOR_ROUNDS
        rounds with drafts, the stage's: the prior of sequences that have not drafted yet. Sequences
        whose drafts pay draft far more often than those whose drafts do not, so counting all their
        rounds would make every new sequence look like the first kind."""
        if d.chooser is not None:
            d.chooser.acceptance.record(drafted, accepted)
        if self.costs is not None and d.prior_rounds < PRIOR_ROUNDS:
            d.prior_rounds += 1
            self.costs_for(d).acceptance.record(drafted, accepted)

    def costs_for(self, d: DraftState) -> StageCosts:
        if not d.processed:
            return self.costs
        if self.processed_costs is None:
            self.processed_costs = StageCosts(list(self.costs.prior), optimistic=True)
        return self.processed_costs

    def calibrate(self, kmax: int, dtype: mx.Dtype, context: int = 64, trials: int = 3) -> StageCosts:
        """Round costs for 0..kmax drafts before any live timing: this stage's verify over K+1
        positions scaled to the whole model, plus K draft steps. Runs on scratch caches."""
        model = self.model
        hidden = model.layers[0].input_layernorm.weight.shape[0]
        cache = model.make_cache()
        mx.eval(model.run_layers(mx.zeros((1, context, hidden), dtype), cache)[0])

        def best_of(fn: Callable[[], mx.array]) -> float:
            times = []
            for _ in range(trials):
                start = time.perf_counter()
                mx.eval(fn())
                times.append(time.perf_counter() - start)
            return min(times)

        def verify(k: int) -> mx.array:
            h, _ = model.run_layers(mx.zeros((1, k + 1, hidden), dtype), cache, capture=k > 0)
            return mx.argmax(model.lm_logits(model.final_norm(h)), axis=-1)

        share = self.layers_total / max(len(model.layers), 1)
        verify_s = [best_of(lambda k=k: verify(k)) * share for k in range(kmax + 1)]
        mtp_cache = KVCache()
        g = mx.zeros((1, 1, hidden), dtype)
        draft_s = best_of(lambda: mx.argmax(self.vocab.logits(model.mtp(g, model.embed(mx.array([[0]])), mtp_cache))))
        return StageCosts([v + k * draft_s for k, v in enumerate(verify_s)], optimistic=True)

    def _extend_mtp(self, d: DraftState, hidden: mx.array, tokens: list[int]) -> None:
        """Prefill: add MTP entries (H[t], x[t+1]); the chunk's last position waits for its next token."""
        if d.mtp_cache is None:
            return
        hid, toks = hidden[:, :-1], tokens[1:]
        if d.pending_hidden is not None:
            hid, toks = mx.concatenate([d.pending_hidden, hid], axis=1), tokens
        d.pending_hidden = hidden[:, -1:]
        if toks:  # no output of a prompt position is read: its cache entries are all it needs
            self.model.mtp.extend(hid, self.model.embed(mx.array([toks])), d.mtp_cache)
            d.mtp_len += len(toks)

    def _draft(self, d: DraftState, hid: mx.array, toks: list[int],
               ahead: Callable[[mx.array], None] | None = None) -> list[int]:
        """K drafts. The first MTP call adds true entries for all (hidden, next token) pairs and its
        last output drafts d1; later drafts chain on the MTP output g (entries trimmed next round).
        A chain of greedy drafts, or of drafts drawn on the device (sampled, without a seed), is
        evaluated once at its end (on the CPU each step is queued as it is built), after `ahead` was
        given the drafts still lazy; with a seed each draft is drawn on the host."""
        hid, toks = d.pairs_to_draft(hid, toks)
        if hid is None:
            return []
        inputs = mx.array([toks])
        # Only the last pair's output drafts: the others may just write their entries.
        if entries_only_pays(len(toks), attended(d.mtp_cache.offset, self.mtp_window)):
            self.model.mtp.extend(hid[:, :-1], self.model.embed(inputs[:, :-1]), d.mtp_cache)
            hid, inputs = hid[:, -1:], inputs[:, -1:]
        lazy: list[mx.array] = []
        probs = []  # drawn on the host
        drawn_from: list[mx.array] = []  # drawn on the device
        on_device = drafts_on_device(d.params)
        queue = queue_layers()  # each draft step computes while the host builds the next
        vocab, narrowed = self.vocab, (None, None)  # (a bias row, the same row over the draft vocabulary)
        for k in range(d.depth):
            g = self.model.mtp(hid, self.model.embed(inputs), d.mtp_cache, self.mtp_window)[:, -1:]
            logits = vocab.logits(g).reshape(-1)
            if (bias := draft_row(d.bias_row(vocab.vocab), d.params, d.history, k, vocab.vocab)) is not None:
                narrowed = narrowed if narrowed[0] is bias else (bias, vocab.narrow(bias))
                logits = logits + narrowed[1]
            if d.params.greedy or on_device:
                if on_device:
                    index, q = draw_drafts(logits[None], d.params, d.next_key())
                    index = index[0]
                    drawn_from.append(q[0])
                else:
                    index = mx.argmax(logits)
                tok = vocab.tokens(index)
                lazy.append(tok)
                if queue:
                    mx.async_eval(tok)
                inputs = tok.reshape(1, 1)
            else:
                q = filtered_probs(vocab.widen(logits), d.params)
                drawn = d.pick(q, k)
                lazy.append(mx.array(drawn))
                probs.append(q)
                inputs = mx.array([[drawn]])
            hid = g
        d.mtp_len += len(toks)
        drafts = mx.stack(lazy)
        # (stacked before the next round is queued: an array made after it would wait for that round)
        reported = mx.stack(drawn_from) if drawn_from else None
        if ahead is not None and lazy and not probs:
            # on their own: computed in one go with the next round, reading them would wait for it
            mx.async_eval(drafts, *([reported] if reported is not None else []))
            ahead(drafts)
        d.drafts = drafts.tolist()
        if reported is not None:
            probs = list(vocab.widen_probs(np.asarray(reported)))
        d.draft_probs = np.stack(probs) if probs else None
        return d.drafts

    def _pick(self, d: DraftState, logits: mx.array | None, on_token: Callable[[mx.array], None] | None,
              token: mx.array | None = None) -> int:
        if d.params.greedy:
            ahead = on_token is not None and d.depth == 0  # the next round is this token alone
            if token is None:
                token = mx.argmax(logits.reshape(-1))
                if ahead:
                    # The CPU's async_eval waits for most of what it queues, this round's forward too:
                    # computed first, queuing the next round costs (and is charged) that round alone.
                    mx.eval(token)
            if ahead:
                start = time.perf_counter()
                on_token(token)
                d.ahead_next = time.perf_counter() - start
            return int(token.item())
        return d.pick(filtered_probs(logits.reshape(-1), d.params))

    def _accept(self, d: DraftState, logits: mx.array | None, drafts: list[int],
                picks: mx.array | None = None) -> tuple[int, list[int]]:
        if d.params.greedy:
            return accept_greedy((mx.argmax(logits[0], axis=-1) if picks is None else picks).tolist(), drafts)
        return d.accept(filtered_probs(logits[0], d.params), drafts)
