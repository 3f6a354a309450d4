"""A stage over many sequences at once: prompts one by one, decode rounds for all of them in one forward.

A new sequence is prefilled alone through the stage's per-sequence worker (stage.py), in chunks the
scheduler interleaves with decode rounds, then joins the batch: its caches become one row of the
batch's caches (ragged.py). Each decode round runs every row's [y, d1..dK] in one padded forward;
rows carry different numbers of drafts. The commit of a round (per row: drafts accepted, entries to
trim) is applied right after it, per row, from the states each row captured. A row leaves between
rounds and its caches go with it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import mlx.core as mx

from ..models.gdn_snapshots import GDNSnapshots
from ..models.ragged import concat_caches, pad_rows, restore_rows, rows_cache, take_rows
from .batch_depth import DepthPlan
from .batch_head import BatchHead, RowOutput
from .filling import FillGroup
from .head import Prepared
from .prefixes import Prefix, prefix_at_end, prefix_of
from .protocol import Commit, StageError, StepOutput, StepRequest
from .stage import StageWorker, check_hidden, stepped

log = logging.getLogger(__name__)


@dataclass
class Ahead:
    """The next round's forward, queued before the host hands out this round's tokens (a whole-model
    stage): on this round's still-lazy picks when no row drafts (rows greedy or drawn on the device),
    else on the drafts still computing (rows greedy, or drafting on the device), else on the tokens
    once the host has them; after applying this round's commit. If the next round is not exactly those
    tokens for the same rows, the caches go back to `saved`."""

    tokens: mx.array | list[list[int]]  # each row's tokens it was fed (lazy picks or drafts until known)
    h: mx.array
    snapshots: dict[int, GDNSnapshots]
    prepared: Prepared  # that round's head part
    saved: list  # per layer: (conv, state) of a GatedDeltaNet layer, the lengths of an attention layer


@dataclass
class RowStep:
    """One row of a decode round: its tokens [y, d1..dK]."""

    seq_id: str
    tokens: list[int]


class BatchStage:
    def __init__(self, worker: StageWorker, plan: DepthPlan | None = None):
        if worker.overlap:
            raise ValueError("a batch stage prefills through a worker that does not queue rounds ahead")
        self.worker = worker
        self.model = worker.model
        self.spec = worker.spec
        self.head = BatchHead(worker.head, plan) if worker.head is not None else None
        self.ids: list[str] = []  # the batch's rows, in order
        self.cache: list = []  # per layer: RaggedKV (attention) or ArraysCache with [rows, ...] states
        self.positions: list[int] = []
        self.snapshots: dict[int, GDNSnapshots] = {}
        self.real: list[int] = []  # tokens each row fed to the last forward
        self.stats = worker.stats  # prefill steps and decode rounds alike
        self.ahead: Ahead | None = None
        self.lookahead = self.spec.is_first and self.spec.is_last
        self.early: list[Commit] | None = None  # the last round's commit, applied when it was decided
        args = worker.shard.config.args
        self.prefixes: dict[str, Prefix] = {}  # kept prompt prefixes (prefixes.py), by the engine's keys
        self.filling = FillGroup(self.model, worker.head, first=self.spec.is_first, dtype=worker.dtype,
                                 max_context=worker.max_context, vocab_size=args.vocab_size,
                                 hidden_size=args.hidden_size, has_mtp=worker.shard.has_mtp, prefixes=self.prefixes,
                                 plan=self.head.plan if self.head is not None else None)

    # -- membership -------------------------------------------------------------------------

    def prefill(self, req: StepRequest, hidden: mx.array | None = None) -> mx.array | StepOutput:
        """A prompt chunk of a sequence not yet in the batch (the worker's per-sequence path)."""
        if req.seq_id in self.ids:
            raise StageError(f"sequence {req.seq_id!r} is already decoding")
        if self.head is not None:
            self.head.plan.interrupt()  # the next round's timing would include this chunk
        return self.worker.step(req, hidden)

    def fill(self, reqs: list[StepRequest], hidden: mx.array | None = None) -> mx.array | list[StepOutput]:
        """Prompt chunks of sequences not yet in the batch, all in one forward (filling.py)."""
        for req in reqs:
            if req.seq_id in self.ids:
                raise StageError(f"sequence {req.seq_id!r} is already decoding")
        if self.head is not None:
            self.head.plan.interrupt()  # the next round's timing would include this step
        start = time.perf_counter()
        out = self.filling.step(reqs, hidden)
        tokens, elapsed = sum(len(r.tokens) for r in reqs), time.perf_counter() - start
        stepped(self.stats)
        self.stats.tokens_processed += tokens
        self.stats.step_seconds += elapsed
        if not any(r.final for r in reqs):  # (a final chunk samples too, and drafts)
            self.stats.prefilled(tokens, elapsed)
        return out

    def join(self, seq_id: str, keep: str = "") -> Prefix | None:
        """Move a prefilled sequence into the batch, as its last row. With `keep`, what its prompt left
        here before its last token is kept under that key (when prefixes are marked: `keep_prefixes`)."""
        kept = None
        if seq_id in self.filling:
            mark = self.filling.marks.pop(seq_id, None)
            row, position, draft = self.filling.take(seq_id)
            if keep and mark is not None:
                kept = self.prefixes[keep] = prefix_of(mark, row, draft)
        else:
            seq = self.worker.sequences.pop(seq_id, None)
            if seq is None:
                raise StageError(f"unknown sequence {seq_id!r}")
            row, position, draft = rows_cache(seq.cache), seq.position, seq.draft
        self.drop_ahead()
        self.cache = row if not self.ids else concat_caches([self.cache, row])
        self.ids.append(seq_id)
        self.positions.append(position)
        if self.head is not None:
            self.head.join(seq_id, draft)
        return kept

    def keep_end(self, seq_id: str, key: str, position: int) -> Prefix | None:
        """Keep what a finished row holds, as the last commit left it, under `key`: a prefix of
        `position` tokens, its prompt and what it generated but the last token (never fed). None when
        prefixes are not kept or the row is not at `position` (nothing kept then)."""
        if not self.filling.marking:
            return None
        kept = self.end_prefix(seq_id, position)
        if kept is not None:
            self.prefixes[key] = kept
        return kept

    def end_prefix(self, seq_id: str, position: int) -> Prefix | None:
        """A copy of what a row holds as the last commit left it, as a prefix of `position` tokens; None
        when the row is not here at that position."""
        if seq_id not in self.ids or self.positions[self.ids.index(seq_id)] != position:
            return None
        i = self.ids.index(seq_id)
        self.drop_ahead()  # (the round queued ahead wrote past the commit)
        draft = self.head.states[i] if self.head is not None else None
        mtp = self.head.end_cache(i) if self.head is not None else None
        return prefix_at_end(self.cache, i, position, draft, mtp, self.model)

    def keep_prefixes(self, on: bool) -> None:
        """Mark each prompt's state before its last token, so that `join` can keep it."""
        self.filling.marking = on
        if not on:
            self.prefixes.clear()

    def drop_prefix(self, key: str) -> None:
        self.prefixes.pop(key, None)

    def leave(self, seq_ids: set[str]) -> None:
        """Drop rows (finished or abandoned): their caches are freed with them."""
        for seq_id in seq_ids:
            self.worker.release(seq_id)
            self.filling.release(seq_id)
        keep = [i for i, s in enumerate(self.ids) if s not in seq_ids]
        if len(keep) == len(self.ids):
            return
        self.drop_ahead()
        self.cache = take_rows(self.cache, keep) if keep else []
        self.real = [self.real[i] for i in keep] if len(self.real) == len(self.ids) else []
        self.ids = [self.ids[i] for i in keep]
        self.positions = [self.positions[i] for i in keep]
        if self.head is not None:
            self.head.keep(keep)
        self.snapshots = {}

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self.ids or seq_id in self.worker.sequences or seq_id in self.filling

    @property
    def sequences(self) -> int:
        return len(self.ids) + len(self.worker.sequences) + len(self.filling.ids)

    # -- a round --------------------------------------------------------------------------------

    def forward(self, rows: list[RowStep], hidden: mx.array | None = None) -> mx.array | list[RowOutput]:
        """One decode round for every row, in batch order; the last stage returns each row's outcome."""
        if [r.seq_id for r in rows] != self.ids:
            raise StageError("a round carries exactly the batch's rows, in order")
        real = [len(r.tokens) for r in rows]
        if min(real) < 1:
            raise StageError("every row of a round needs at least one token")
        if any(p + t > self.worker.max_context for p, t in zip(self.positions, real)):
            raise StageError("context overflow in a decode round")
        if self.head is not None:
            self.head.check(rows)
        start = time.perf_counter()
        self.early = None  # (a commit the engine never confirmed: this round is decided afresh)
        ahead, self.ahead = self.ahead, None
        prepared = None
        if ahead is not None and [r.tokens for r in rows] == ahead.tokens:
            h, self.snapshots, prepared = ahead.h, ahead.snapshots, ahead.prepared
        else:
            if ahead is not None:
                self._restore(ahead)
            if self.spec.is_first:
                h = self.model.embed(pad_rows([r.tokens for r in rows]))
            else:
                check_hidden(hidden, (len(rows), max(real), self.worker.hidden_size))
                h = hidden.astype(self.worker.dtype)
            h, self.snapshots = self.model.run_rows(h, self.cache, real)
        self.real = real
        stepped(self.stats)
        self.stats.tokens_processed += sum(real)
        self.positions = [p + t for p, t in zip(self.positions, real)]
        if not self.spec.is_last:
            mx.eval(h)
            self.stats.step_seconds += time.perf_counter() - start
            return h
        out = self.head.decide(rows, h, self.positions, prepared=prepared,
                               on_picks=self._issue_ahead if self.lookahead else None,
                               on_drafts=self._issue_verify if self.lookahead else None)
        if self.ahead is not None and not isinstance(self.ahead.tokens, list):
            # queued on lazy picks ([rows]) or drafts ([rows, depth]): note them as the host now knows
            # them (no wait on the queue later)
            drafted = self.ahead.tokens.ndim == 2
            self.ahead.tokens = [[r.output.tokens[-1], *(r.output.drafts if drafted else [])] for r in out]
        elif self.lookahead and self.ahead is None:
            commits = [r.output.commit for r in out]
            self._apply(commits)  # decided here: the engine's commit then only confirms it
            self.early = commits
            self._issue_ahead([[r.output.tokens[-1], *r.output.drafts] for r in out])
        self.stats.step_seconds += time.perf_counter() - start
        return out

    def commit(self, commits: list[Commit]) -> None:
        """Each row keeps its accepted prefix of the last round (one commit per row, in batch order)."""
        early, self.early = self.early, None
        if early is not None:
            if commits != early:
                raise StageError("commits differ from the outcome this stage decided")
            return
        self._apply(commits)

    def _apply(self, commits: list[Commit]) -> None:
        trims = [c.trim for c in commits]
        if len(trims) != len(self.ids) or any(not 0 <= t < n for t, n in zip(trims, self.real)):
            raise StageError("commits do not fit the last round")
        if any(trims):
            self.drop_ahead()
            keep = [n - 1 - t for n, t in zip(self.real, trims)]
            for i, (c, layer) in enumerate(zip(self.cache, self.model.layers)):
                if layer.is_linear:
                    restore_rows(self.snapshots[i], c, keep)
                else:
                    c.trim(trims)
            self.positions = [p - t for p, t in zip(self.positions, trims)]
        self.snapshots = {}

    # -- the round queued ahead -----------------------------------------------------------------

    def _issue_verify(self, out: list[RowOutput], drafts: mx.array) -> None:
        """The next round over each row's [token, drafts], queued on the drafts still computing: this
        round's commit is known, so it is applied first (the engine's commit then only confirms it).
        A row's columns past its own depth are padding, never read."""
        self.drop_ahead()  # queued on the picks alone, before this round chose to draft
        commits = [r.output.commit for r in out]
        self._apply(commits)
        self.early = commits
        last = mx.array([r.output.tokens[-1] for r in out], dtype=drafts.dtype)[:, None]
        real = [1 + d.depth for d in self.head.states]
        self._issue_ahead(drafts, mx.concatenate([last, drafts], axis=1), real)

    def _issue_ahead(self, tokens: mx.array | list[list[int]], inputs: mx.array | None = None,
                     real: list[int] | None = None) -> None:
        """The next round queued on `tokens`: host lists, else lazy picks (or lazy drafts, with their
        `inputs` and `real` lengths)."""
        saved = [(c[0], c[1]) if layer.is_linear else list(c.lengths) for c, layer in zip(self.cache, self.model.layers)]
        if isinstance(tokens, list):
            inputs, real = pad_rows(tokens), [len(t) for t in tokens]
        elif inputs is None:
            inputs, real = tokens[:, None], [1] * len(self.ids)
        h, snapshots = self.model.run_rows(self.model.embed(inputs), self.cache, real)
        prepared = self.head.prepare(h, real)
        mx.async_eval(*prepared.arrays())
        self.ahead = Ahead(tokens, h, snapshots, prepared, saved)

    def _restore(self, ahead: Ahead) -> None:
        """Undo a queued round: GatedDeltaNet states as they were, attention lengths as they were (the
        entries it wrote lie past them, invisible)."""
        for c, layer, saved in zip(self.cache, self.model.layers, ahead.saved):
            if layer.is_linear:
                c[0], c[1] = saved
            else:
                c.lengths = saved

    def drop_ahead(self) -> None:
        """Undo a round queued ahead (its work is lost; an early commit stays, it is final): before the
        batch changes, or to read the caches as the last commit left them."""
        if self.ahead is not None:
            self._restore(self.ahead)
            self.ahead = None

    def release(self, seq_id: str) -> bool:
        if seq_id in self.ids:
            self.leave({seq_id})
            return True
        return self.worker.release(seq_id) or self.filling.release(seq_id)

    def describe(self) -> dict:
        out = self.worker.describe()
        out["active_sequences"] = self.sequences
        out["batch_rows"] = len(self.ids)
        out["kept_prefixes"] = len(self.prefixes)
        out["kept_prefix_bytes"] = sum(p.nbytes for p in self.prefixes.values())
        return out
