"""The last stage's head over a batch: every row's acceptance, tokens and next drafts from one forward.

Each row keeps what the single-sequence head keeps (head.py's DraftState: sampling parameters, RNG,
depth chooser, pending drafts); only the MTP cache moves into one `RaggedKV` for the batch, so the
draft steps of all rows run together, each row at its own MTP length and depth. Acceptance is ragged:
each row accepts its own number of drafts. Greedy rows need one host sync per round; sampled rows
draw with their own RNG or seed, so a row's tokens do not depend on the rows around it (on the host,
but drafts without a seed, and on a GPU an unseeded row's token when it has no drafts, are drawn on
the device: device_sampling.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from ..models.mtp import attended, entries_only_pays
from ..models.ragged import RaggedKV, pad_rows
from ..models.shard import queue_layers
from .acceptance import accept_greedy, filtered_probs, kept_of_round
from .batch_depth import DepthPlan
from .depth_rates import batch_rates
from .device_sampling import drafts_on_device, draw_drafts, sample, samples_on_device
from .constraints import Constraint
from .head import DraftState, Head, Prepared
from .processors import LogprobTable, apply, draft_row, logprob_table, read_logprobs
from .protocol import Commit, SamplingParams, StageError, StepOutput


@dataclass
class RowOutput:
    seq_id: str
    output: StepOutput


def held_drafts(d: DraftState, constraint: Constraint) -> None:
    """A held row's drafts (constraints.py): what its grammar forces, proposed with certainty; else the MTP
    head's, cut at the first refused where the verdict does not read how they were drawn."""
    if forced := constraint.forced(len(d.drafts)):
        d.drafts = forced
        if d.draft_probs is not None:
            d.draft_probs = np.zeros((len(forced), d.draft_probs.shape[-1]), d.draft_probs.dtype)
            d.draft_probs[np.arange(len(forced)), forced] = 1.0
    elif d.params.greedy or d.params.seed is not None:
        d.drafts = constraint.allowed_prefix(d.drafts)
        d.draft_probs = None if d.draft_probs is None else d.draft_probs[: len(d.drafts)]


def rows_bucket(rows: int) -> int:
    return 1 << (rows - 1).bit_length()


class BatchHead:
    def __init__(self, head: Head, plan: DepthPlan | None = None):
        self.head = head  # the per-sequence head: prefill, calibration and the depth costs
        self.model = head.model
        self.states: list[DraftState] = []
        self.rounds: list[int] = []
        self.drafting: list[bool] = []  # rows that asked for drafts (a depth, or auto): they have an MTP cache
        self.mtp = RaggedKV()
        self.draft_seconds = 0.0  # what drafting the pending drafts cost
        self.handed_out = 0.0  # when the last round's outcome left this stage (perf_counter)
        # A round queued ahead computes during the one before: what queuing this round's cost (in the
        # last round), and what queuing the next one's costs (in this one).
        self.ahead_done = 0.0
        self.ahead_next = 0.0
        self.plan = plan or DepthPlan()  # the depth of `auto` rows, shared with the batches beside this one
        self.last_depth = -1

    def join(self, seq_id: str, d: DraftState) -> None:
        row = RaggedKV.from_cache(d.mtp_cache, d.mtp_len) if d.mtp_cache is not None else RaggedKV(None, None, [0])
        self.drafting.append(d.mtp_cache is not None)
        d.mtp_cache = None  # the batch's cache holds it now
        self.mtp = row if not self.states else RaggedKV.concat([self.mtp, row])
        self.states.append(d)
        self.rounds.append(0)
        self.plan.interrupt()

    def keep(self, rows: list[int]) -> None:
        self.states = [self.states[i] for i in rows]
        self.rounds = [self.rounds[i] for i in rows]
        self.drafting = [self.drafting[i] for i in rows]
        self.mtp = self.mtp.take(rows) if rows else RaggedKV()
        self.plan.interrupt()
        if not rows:
            self.plan.leave(self)

    def end_cache(self, i: int) -> KVCache | None:
        """Row i's MTP entries as a per-sequence cache (views that grow into new arrays on a write),
        for keeping its state at its end (prefixes.py); None for a row that never drafts."""
        d = self.states[i]
        if not self.drafting[i]:
            return None
        cache = KVCache()
        if d.mtp_len and self.mtp.keys is not None:
            cache.keys, cache.values = self.mtp.keys[i : i + 1, :, : d.mtp_len], self.mtp.values[i : i + 1, :, : d.mtp_len]
            cache.offset = d.mtp_len
        return cache

    # -- a round --------------------------------------------------------------------------------

    def prepare(self, h: mx.array, real: list[int]) -> Prepared:
        """Normed hidden, logits, greedy picks and log-probabilities at every position of a round, still
        lazy: queued behind the round's forward, so reading them never waits on a round queued after.
        `real`: each row's tokens in the round (a row without drafts may draw on the device)."""
        normed = self.model.final_norm(h)
        logits = self.model.lm_logits(normed)
        processed = any(d.processed for d in self.states)  # `decide` takes them from the processed logits
        picks = mx.argmax(logits, axis=-1)
        sampled = tuple(i for i, (d, n) in enumerate(zip(self.states, real))
                        if not d.processed and samples_on_device(d.params, n > 1))
        if sampled:  # the round's first token of rows that need no host to draw it
            first = [sample(logits[i, 0], d.params, d.next_key()) if i in sampled else picks[i, 0]
                     for i, d in enumerate(self.states)]
            picks = mx.concatenate([mx.stack(first)[:, None], picks[:, 1:]], axis=1)
        return Prepared(normed, picks, logits, None if processed else self._logprobs(logits), sampled)

    def _logprobs(self, logits: mx.array) -> LogprobTable | None:
        """The log-probabilities of the rows that report them."""
        rows = [i for i, d in enumerate(self.states) if d.params.top_logprobs >= 0]
        if not rows:
            return None
        return logprob_table(logits, max(self.states[i].params.top_logprobs for i in rows), rows)

    def decide(self, rows: list, h: mx.array, positions: list[int],
               prepared: Prepared | None = None,
               on_picks: Callable[[mx.array], None] | None = None,
               on_drafts: Callable[[list[RowOutput], mx.array], None] | None = None) -> list[RowOutput]:
        """`rows`: the round's RowSteps (batch.py), `h`: the last layer's hidden states of all rows;
        `prepared`: what `prepare` made of `h` when the round was queued ahead. The next round can be
        queued before the host waits for its tokens: `on_picks` gets the still-lazy picks when no row
        carries drafts this round or the next and every row is greedy or draws on the device, and
        `on_drafts` the round's outcome and the next drafts still computing ([rows, deepest], each
        row's first `depth` real) when no row's drafts are drawn on the host."""
        normed, picks, logits, table, on_device = prepared or self.prepare(h, [len(r.tokens) for r in rows])
        mtp_in = h if self.head.mtp_pre_norm else normed
        processed = [(i, d.params, d.history, r.tokens[1:]) for i, (r, d) in enumerate(zip(rows, self.states))
                     if d.processed]
        if processed:  # position by position, as if the drafts before were accepted (processors.py)
            logits = apply(logits, processed)
            greedy = mx.argmax(logits, axis=-1)
            if on_device:  # (their logits are not processed)
                drawn = mx.array([i in on_device for i in range(len(rows))])[:, None] & (mx.arange(picks.shape[1]) == 0)
                greedy = mx.where(drawn, picks, greedy)
            picks, table = greedy, self._logprobs(logits)
        elif on_picks is not None and all(len(r.tokens) == 1 and d.depth == 0 and (d.params.greedy or i in on_device)
                                          for i, (r, d) in enumerate(zip(rows, self.states))):
            if prepared is None:  # so the time of queuing the next round is that round's alone, and
                mx.eval(picks, *(table.arrays() if table is not None else []))  # reading these never waits on it
            start = time.perf_counter()
            on_picks(picks[:, 0])
            self.ahead_next = time.perf_counter() - start
        host_draws = any(not d.params.greedy and i not in on_device for i, d in enumerate(self.states))
        mx.eval(picks, *([logits] if host_draws else []), *(table.arrays() if table is not None else []))
        picks_host = picks.tolist()
        reports = []
        outs, pairs = [], []
        drawn = self._host_draws(rows, logits, on_device)
        for i, (row, d) in enumerate(zip(rows, self.states)):
            drafts = row.tokens[1:]
            K = len(drafts)
            if d.params.greedy:
                n, tokens = accept_greedy(picks_host[i][: K + 1], drafts)
            elif i in on_device and K == 0:
                n, tokens = 0, [picks_host[i][0]]
            elif K == 0:
                n, tokens = 0, [drawn[i]]
            else:
                n, tokens = d.accept(filtered_probs(logits[i, : K + 1], d.params), drafts)
            if K:
                self.head.record(d, K, n)
            kept, accepted = kept_of_round(tokens, d.left, d.stops), n
            if kept < len(tokens):  # accepted past its end: the last token kept is emitted, not fed
                n, tokens, accepted = kept - 1, tokens[:kept], kept
            if d.left is not None:
                d.left -= len(tokens)
            out = StepOutput(seq_id=row.seq_id, step=self.rounds[i], tokens=tokens, accepted=accepted, drafted=K,
                             commit=Commit(step=self.rounds[i], accepted=n, trim=K - n))
            self.rounds[i] += 1
            d.last_token = tokens[-1]
            d.history.emit(tokens)
            self.head.observe(tokens)
            if d.params.top_logprobs >= 0:
                reports.append((out, (i, tokens, d.params.top_logprobs)))
            outs.append(RowOutput(row.seq_id, out))
            pairs.append((mtp_in[i : i + 1, : n + 1], tokens))
        if reports:
            for (out, _), lps in zip(reports, read_logprobs(table, [r for _, r in reports])):
                out.logprobs = lps
        self._choose(rows, positions)
        start, queuing = time.perf_counter(), 0.0

        def ahead(drafts: mx.array) -> None:
            nonlocal queuing
            queued = time.perf_counter()
            on_drafts(outs, drafts)
            self.ahead_next = queuing = time.perf_counter() - queued

        self._draft(pairs, ahead if on_drafts is not None else None)
        self.handed_out = time.perf_counter()
        self.draft_seconds = self.handed_out - start - queuing  # the queued round is charged to itself
        self.ahead_done, self.ahead_next = self.ahead_next, 0.0
        for o, d in zip(outs, self.states):
            o.output.drafts = list(d.drafts)
        return outs

    def _host_draws(self, rows: list, logits: mx.array, on_device: tuple[int, ...]) -> dict[int, int]:
        """The tokens of the sampled rows without drafts that draw on the host, each as its
        `DraftState.pick` draws it, from probabilities taken in one pass per set of filters: one trip
        to the host for all of them (a sampled round waits for these draws before the next is queued)."""
        groups: dict[tuple, list[int]] = {}
        for i, (row, d) in enumerate(zip(rows, self.states)):
            if not d.params.greedy and i not in on_device and len(row.tokens) == 1:
                q = d.params
                groups.setdefault((q.temperature, q.top_p, q.top_k, q.min_p), []).append(i)
        drawn: dict[int, int] = {}
        for idx in groups.values():
            p = filtered_probs(logits[mx.array(idx), 0], self.states[idx[0]].params)
            drawn.update((i, self.states[i].pick(p[j])) for j, i in enumerate(idx))
        return drawn

    def _choose(self, rows: list, positions: list[int]) -> None:
        """Depths for the rows with timed `auto`: one for all of them and for the batches that share the
        plan (batch_depth.py), from round costs measured at this batch size. A round with K drafts costs
        drafting them and everything from handing them out to their verdict (the other stages, the
        host, the commit, the other batches' rounds). A round is timed only at the plan's depth (a round
        is as wide as its deepest row), at the same depth as the one before (a change of depth mixes
        the two rounds' work: a commit, a round queued ahead), and when the plan calls it clean. Rows
        with logits processors do more on the host, and their rounds without drafts are queued only
        once the host has their tokens: a batch with such rows follows a plan of its own."""
        timed = [d for d in self.states if d.chooser is not None]
        if not timed or self.head.costs is None:
            self.plan.leave(self)
            return
        plan = self.plan.rows_of(self, any(d.processed for d in self.states))
        bucket = rows_bucket(len(rows))
        costs = plan.costs(bucket, self.head.costs)
        context = max(positions)
        depth = max(len(r.tokens) - 1 for r in rows)
        steady, self.last_depth = depth == self.last_depth, depth
        # (the first round of a shape builds its kernels: never timed, but noted)
        if not plan.first_shape((len(rows), depth)) and steady and plan.clean(self.handed_out, depth):
            # each round charged its own forward, whichever round it computed in
            seconds = time.perf_counter() - self.handed_out + self.draft_seconds + self.ahead_done - self.ahead_next
            costs.observe(depth, context, seconds, now=time.perf_counter())  # (this module's clock)
            plan.timed()
        kmaxes = [d.chooser.kmax for d in timed]

        def rates(seconds: list[float]) -> list[tuple[float, float]]:
            stage = costs.acceptance.extrapolated()
            rows = []
            for d in timed:
                prior = stage[: d.chooser.kmax]
                rows.append((d.chooser.acceptance.rates(prior), d.chooser.acceptance.hopeful(prior)))
            return batch_rates(rows, kmaxes, seconds)

        # rows of a fixed depth make every round at least that wide: drafts up to it cost the others little
        least = max((d.depth for d in self.states if d.chooser is None), default=0)
        depth = max(least, plan.next(self, bucket, context, max(kmaxes), rates, least))
        for d in timed:
            d.depth = min(depth, d.chooser.kmax)

    def check(self, rows: list) -> None:
        """Before the round's forward (batch.py): a round whose tokens are not this stage's leaves the
        caches as they were."""
        for row, d in zip(rows, self.states):
            if row.tokens[0] != d.last_token or row.tokens[1:] != d.drafts:
                raise StageError(f"round tokens of {row.seq_id!r} do not match the token and drafts this stage made")

    def _draft(self, pairs: list[tuple[mx.array, list[int]]],
               ahead: Callable[[mx.array], None] | None = None) -> None:
        """Every row's next drafts. The first MTP call adds each row's true (hidden, next token) pairs
        and drafts d1 from its last one; later steps chain on the MTP output, for the rows that want
        that many drafts (their chained entries are dropped next round). Greedy drafts and those drawn
        on the device go to `ahead` still lazy, before the host waits for them, unless a row's drafts
        are drawn on the host (a seed's)."""
        B = len(self.states)
        for d in self.states:
            if d.history.constraint is not None and d.history.constraint.finished:
                d.depth = 0  # (its format is complete: nothing but an end token can follow)
        hids, toks, counts = [], [], []
        for d, drafting, (hid, tok) in zip(self.states, self.drafting, pairs):
            if drafting:
                hid, tok = d.pairs_to_draft(hid, tok)
            else:  # never drafts (as the single-sequence head, which skips these rows): keep nothing
                hid, tok = None, []
                d.drafts, d.draft_probs = [], None
            hids.append(hid)
            toks.append(tok)
            counts.append(len(tok))
        depth = max(d.depth for d in self.states)
        if depth == 0:
            return
        self.mtp.lengths = [d.mtp_len for d in self.states]  # drop last round's chained entries
        width = max(counts)
        H = next(h for h in hids if h is not None).shape[-1]
        dtype = next(h for h in hids if h is not None).dtype
        hidden = mx.concatenate([
            mx.zeros((1, width, H), dtype) if h is None
            else (mx.pad(h, [(0, 0), (0, width - h.shape[1]), (0, 0)]) if h.shape[1] < width else h)
            for h in hids
        ])
        embedded = self.model.embed(pad_rows([t or [0] for t in toks]))
        before_last = [max(c - 1, 0) for c in counts]  # each row's pairs before its last
        last = mx.array(before_last)
        window = self.head.mtp_window  # what each drafting position attends to (models/mtp.py)
        if entries_only_pays(width, attended(max(self.mtp.lengths), window)):  # only each last pair's output drafts
            self.model.mtp.extend(hidden[:, :-1], embedded[:, :-1], self.mtp, before_last)
            rows = mx.arange(B)
            g = self.model.mtp.rows(hidden[rows, last][:, None], embedded[rows, last][:, None], self.mtp,
                                    [min(c, 1) for c in counts], window)
        else:
            g = self.model.mtp.rows(hidden, embedded, self.mtp, counts, window)
            g = g[mx.arange(B), last][:, None]  # [B, 1, H]
        for d, c in zip(self.states, counts):
            d.mtp_len += c
            d.drafts, d.draft_probs = [], None
        lazy: list[mx.array] = []
        probs: list[list[np.ndarray]] = [[] for _ in range(B)]  # drawn on the host
        drawn_from: list[list[mx.array]] = [[] for _ in range(B)]  # drawn on the device
        on_device = {i for i, d in enumerate(self.states) if d.depth and drafts_on_device(d.params)}
        host = any(not d.params.greedy and d.depth and i not in on_device for i, d in enumerate(self.states))
        queue = not host and queue_layers()  # each draft step computes while the host builds the next
        tokens = mx.zeros((B,), mx.int32)
        vocab = self.head.vocab
        rows_bias: list[mx.array | None] = [None] * B  # (what each row's drafts add: processors.draft_row)
        bias = None
        for k in range(depth):
            if k:
                real = [1 if d.depth > k else 0 for d in self.states]
                g = self.model.mtp.rows(g, self.model.embed(tokens[:, None]), self.mtp, real, window)
            logits = vocab.logits(g)[:, 0]
            adds = [draft_row(d.bias_row(vocab.vocab), d.params, d.history, k, vocab.vocab) if d.depth > k else None
                    for d in self.states]
            if any(a is not b for a, b in zip(adds, rows_bias)):
                rows_bias, zero = adds, mx.zeros((vocab.vocab,), mx.float32)
                bias = vocab.narrow(mx.stack([zero if a is None else a for a in adds])) if any(
                    a is not None for a in adds) else None
            if bias is not None:
                logits = logits + bias
            index = mx.argmax(logits, axis=-1)
            groups: dict[SamplingParams, list[int]] = {}  # rows drawing on the device, by their filters
            for i in sorted(on_device):
                if self.states[i].depth > k:
                    groups.setdefault(self.states[i].params, []).append(i)
            for params, rows in groups.items():
                drawn, q = draw_drafts(logits[mx.array(rows)], params, self.states[rows[0]].next_key())
                index[mx.array(rows)] = drawn.astype(index.dtype)
                for j, i in enumerate(rows):
                    drawn_from[i].append(q[j])
            tokens = vocab.tokens(index)
            if host:
                mx.eval(tokens, logits)
                drawn = tokens.tolist()
                for i, d in enumerate(self.states):
                    if d.depth > k and not d.params.greedy and i not in on_device:
                        q = filtered_probs(vocab.widen(logits[i]), d.params)
                        drawn[i] = d.pick(q, k)
                        probs[i].append(q)
                tokens = mx.array(drawn, dtype=mx.int32)
            lazy.append(tokens)
            if queue:
                mx.async_eval(tokens)
        drafts = mx.stack(lazy, axis=1)  # [B, depth]
        # (stacked before the next round is queued: an array made after it would wait for that round)
        reported = mx.stack([q for row in drawn_from for q in row]) if on_device else None  # rows in order
        held = any(d.history.constraint is not None and d.depth for d in self.states)  # (drafts the host may change)
        if ahead is not None and not host and not held:
            # on their own: computed in one go with the next round, reading them would wait for it
            mx.async_eval(drafts, *([reported] if reported is not None else []))
            ahead(drafts)
        drafted = drafts.tolist()
        if reported is not None:
            rows_q = iter(vocab.widen_probs(np.asarray(reported)))
            for i in sorted(on_device):
                probs[i] = [next(rows_q) for _ in drawn_from[i]]
        for i, d in enumerate(self.states):
            d.drafts = drafted[i][: d.depth]
            d.draft_probs = np.stack(probs[i]) if probs[i] else None
            if d.history.constraint is not None and d.drafts:
                held_drafts(d, d.history.constraint)
