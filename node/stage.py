"""A stage: one shard, and the per-sequence caches and snapshots of its layers.

Every stage runs its layers over a step's positions and applies commits locally; the last stage
hands its hidden states to the head (head.py), which turns them into tokens. Requests are validated
before anything is touched, so a refused request leaves the sequence exactly as it was.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import mlx.core as mx

from ..models.gdn_snapshots import GDNSnapshots
from ..models.loading import LoadedShard
from .head import DraftState, Head, Prepared, new_draft_state
from .prefixes import Prefix, check_resumed, prefix_of_sequence, resume_draft, sequence_cache
from .protocol import MAX_MTP_DEPTH, Commit, StageError, StepKind, StepOutput, StepRequest
from .sysinfo import system_memory

log = logging.getLogger(__name__)

CLEAR_CACHE_EVERY = 256
MAX_KEPT_PREFIXES = 256  # kept prompt prefixes on a stage, whoever asked (the engine keeps fewer)
PREFIX_MEMORY_SHARE = 4  # and at most this share of the memory free as the stage was built


def check_first_step(req: StepRequest, *, drafts_here: bool, has_mtp: bool) -> None:
    """What the first step of a sequence sets for its whole life (params, depth), checked once."""
    if req.params is not None:
        try:
            req.params.validate()
        except ValueError as e:
            raise StageError(str(e)) from None
    if not 0 <= req.mtp_depth <= MAX_MTP_DEPTH:
        raise StageError(f"mtp_depth must be in [0, {MAX_MTP_DEPTH}], got {req.mtp_depth}")
    if req.resumed_at < 0:
        raise StageError(f"resumed_at must be >= 0, got {req.resumed_at}")
    if req.params is not None and req.params.prompt_logprobs >= 0 and (req.prefix or req.resumed_at):
        raise StageError("prompt log-probabilities read the whole prompt: not from a kept prefix or on a resume")
    if req.mtp_depth > 0 and drafts_here and not has_mtp:
        raise StageError("this model was loaded without an MTP head; use mtp_depth 0")


def check_hidden(hidden: mx.array | None, shape: tuple[int, int, int]) -> None:
    """The previous stage's hidden states, as many as the step's rows and tokens and as wide as the model."""
    if hidden is None:
        raise StageError("this stage needs the previous stage's hidden states")
    if tuple(hidden.shape) != shape:
        raise StageError(f"hidden states have shape {tuple(hidden.shape)}, expected {shape}")


@dataclass
class Sequence:
    cache: list
    next_step: int = 0
    position: int = 0  # tokens committed into this stage's caches
    decoding: bool = False
    prompt_done: bool = False  # its final prefill step went through: no prompt chunk may follow
    pending_k: int | None = None  # drafts in the last decode step, until its commit arrives
    snapshots: dict[int, GDNSnapshots] = field(default_factory=dict)
    draft: DraftState | None = None
    # (hidden, snapshots, the head's part) of the next decode step, already queued; the commit it was
    # queued after (applied already), which that step's request must echo
    lookahead: tuple[mx.array, dict, Prepared] | None = None
    early_commit: Commit | None = None
    last_commit: Commit | None = None  # the last stage's own outcome, to check the echo against


ROUND_FIT_WEIGHT = 0.05  # a round's weight in its row count's running mean: the fit follows the node's pace
ROUND_FIT_OUTLIER = 2.0  # a round counts as at most this many times its row count's mean (a stall)
ROUND_FIT_TRUSTED = 4  # rounds of a row count before its mean informs the fit
ROUND_FIT_WEIGHT_MOST = 20  # a row count's weight in the fit: its rounds, up to this


@dataclass
class RoundFit:
    """A decode round's seconds here against its rows, as fixed + per_row x rows: a weighted least-squares
    line through a running mean per row count. Rounds of a few rows cost little less than rounds of many
    where dispatch dominates: a ring splitting its rows into more groups pays the fixed part again per
    group. A row count's first round builds its kernels: left out."""

    means: dict[int, tuple[float, int]] = field(default_factory=dict)  # rows -> (mean seconds, rounds in it)

    def add(self, rows: int, seconds: float) -> None:
        if rows not in self.means:
            self.means[rows] = (0.0, 0)
            return
        mean, n = self.means[rows]
        seconds = seconds if n == 0 else min(seconds, ROUND_FIT_OUTLIER * mean)
        self.means[rows] = (seconds if n == 0 else mean + ROUND_FIT_WEIGHT * (seconds - mean), n + 1)

    def line(self) -> tuple[float, float]:
        """(fixed, per row) seconds; (0, 0) until two row counts were timed enough: unmeasured, so a ring
        keeps a group per node (a line through one row count would read it all as fixed, or all per row)."""
        pts = [(r, m, min(n, ROUND_FIT_WEIGHT_MOST)) for r, (m, n) in self.means.items() if n >= ROUND_FIT_TRUSTED]
        if len(pts) < 2:
            return 0.0, 0.0
        total = sum(w for _, _, w in pts)
        x, y = sum(r * w for r, _, w in pts) / total, sum(m * w for _, m, w in pts) / total
        spread = sum(w * (r - x) ** 2 for r, _, w in pts)
        slope = max(0.0, sum(w * (r - x) * (m - y) for r, m, w in pts) / spread)
        fixed = y - slope * x
        if fixed < 0:  # (a line through the origin, then)
            return 0.0, y / x
        return fixed, slope


def stepped(stats: StageStats) -> None:
    """A step ran (a sequence's, a prompt chunk of several, a batch's round): counted, and every
    CLEAR_CACHE_EVERY steps MLX's allocator cache is given back, as mlx-lm does (long generations, and
    rows that left a batch, otherwise keep growing it)."""
    stats.steps += 1
    if stats.steps % CLEAR_CACHE_EVERY == 0:
        mx.clear_cache()


@dataclass
class StageStats:
    tokens_processed: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    prefill_tokens: int = 0  # prompt chunks' part of the above but the last: what a prompt token costs here
    prefill_seconds: float = 0.0
    last_error: str | None = None
    rounds: RoundFit = field(default_factory=RoundFit)  # batched decode rounds only

    def prefilled(self, tokens: int, seconds: float) -> None:
        self.prefill_tokens += tokens
        self.prefill_seconds += seconds

    @property
    def mean_step_ms(self) -> float:
        return 1000.0 * self.step_seconds / self.steps if self.steps else 0.0


class StageWorker:
    def __init__(self, shard: LoadedShard, max_sequences: int = 64, mtp_pre_norm: bool = False, overlap: bool = True,
                 draft_vocab: int | None = None, mtp_window: int | None = None):
        self.shard = shard
        self.model = shard.model
        self.head = (Head(self.model, mtp_pre_norm, shard.spec.num_layers, draft_vocab=draft_vocab,
                          mtp_window=mtp_window)
                     if shard.spec.is_last else None)
        # A stage that is the whole model queues each round before the host has handled the last one.
        self.overlap = overlap and shard.spec.is_first and shard.spec.is_last
        self.spec = shard.spec
        self.hidden_size = shard.config.args.hidden_size
        self.dtype = self.model.layers[0].input_layernorm.weight.dtype
        self.max_sequences = max_sequences
        self.max_context = shard.config.args.max_position_embeddings
        self.sequences: dict[str, Sequence] = {}
        # Kept prompt prefixes of the per-sequence path (prefixes.py), by the keys the node gives them
        # (the client's key under its client id).
        self.prefixes: dict[str, Prefix] = {}
        self.max_prefix_bytes: int | None = system_memory()[1] // PREFIX_MEMORY_SHARE or None  # (None: unknown)
        self.stats = StageStats()
        self.lock = threading.Lock()  # one forward at a time through this shard

    # -- public API ------------------------------------------------------------------------

    def step(self, req: StepRequest, hidden: mx.array | None = None,
             joins_at: int | None = None) -> mx.array | StepOutput:
        """Run one step. Non-last stages return the hidden states for the next stage. `joins_at`: for a
        prompt's last chunk, the depth of the batch its sequence joins next (head.py: `DraftState`)."""
        with self.lock:
            start = time.perf_counter()
            try:
                seq = self._check(req, hidden)
                out = self._run(req, seq, hidden, joins_at)
            except StageError as e:
                self.stats.last_error = str(e)
                raise
            stepped(self.stats)
            self.stats.tokens_processed += len(req.tokens)
            elapsed = time.perf_counter() - start
            self.stats.step_seconds += elapsed
            if req.kind == StepKind.PREFILL and not req.final:  # (a final one samples too, and drafts)
                self.stats.prefilled(len(req.tokens), elapsed)
            return out

    def release(self, seq_id: str) -> bool:
        with self.lock:
            return self.sequences.pop(seq_id, None) is not None

    def drop_prefixes(self, keys: list[str]) -> None:
        with self.lock:
            for key in keys:
                self.prefixes.pop(key, None)

    def describe(self) -> dict:
        """Plain data for health and /v1/cluster."""
        out = {
            "layers": [self.spec.start, self.spec.end],
            "num_layers": self.spec.num_layers,
            "active_sequences": len(self.sequences),
            "kept_prefixes": len(self.prefixes),
            "kept_prefix_bytes": sum(p.nbytes for p in self.prefixes.values()),
            "steps": self.stats.steps,
            "tokens_processed": self.stats.tokens_processed,
            "mean_step_ms": round(self.stats.mean_step_ms, 3),
            "last_error": self.stats.last_error,
        }
        if self.head is not None and self.head.vocab is not None:
            out["draft_vocab"] = self.head.vocab.describe()
            out["mtp_window"] = self.head.mtp_window or 0
        return out

    # -- validation (nothing is modified here) ---------------------------------------------

    def _check(self, req: StepRequest, hidden: mx.array | None) -> Sequence | None:
        seq = self.sequences.get(req.seq_id)
        T = len(req.tokens)
        if T == 0:
            raise StageError("a step needs at least one token")
        if any(not 0 <= t < self.shard.config.args.vocab_size for t in req.tokens):
            raise StageError("token id out of the vocabulary range")
        if self.spec.is_first:
            if hidden is not None:
                raise StageError("the first stage takes token ids, not hidden states")
        else:
            check_hidden(hidden, (1, T, self.hidden_size))
        if req.keep:
            if req.kind is not StepKind.PREFILL or not req.final:
                raise StageError("only a prompt's last step keeps its prefix")
            if req.keep in self.prefixes:
                raise StageError(f"prefix {req.keep!r} is kept already")
        if req.keep_end and (req.kind is not StepKind.PREFILL or not req.final or not req.group):
            raise StageError("only a prompt's last step meant for a group keeps its end")
        if seq is None:
            if req.step != 0:
                raise StageError(f"unknown sequence {req.seq_id!r}")
            if req.kind is not StepKind.PREFILL:
                raise StageError("a sequence starts with a prefill step")
            if len(self.sequences) >= self.max_sequences:
                raise StageError(f"too many active sequences ({self.max_sequences})")
            check_first_step(req, drafts_here=self.spec.is_last, has_mtp=self.shard.has_mtp)
            if req.keep and not req.prefix:
                raise StageError("a prompt's first step has no prefix before it to keep")
            prefix = self.prefixes.get(req.prefix) if req.prefix else None
            if req.prefix and prefix is None:
                raise StageError(f"no kept prompt prefix {req.prefix!r} here")
            check_resumed(prefix, req.resumed_at)
            if (start := prefix.length if prefix else 0) + T > self.max_context:
                raise StageError(f"context overflow: {start + T} > {self.max_context} positions")
            if prefix and self.spec.is_last and req.mtp_depth and not prefix.drafts:
                raise StageError(f"kept prompt prefix {req.prefix!r} has no MTP head part to draft from")
            return None
        if req.step != seq.next_step:
            raise StageError(f"step {req.step} out of order for {req.seq_id!r}: expected {seq.next_step}")
        if req.kind is StepKind.PREFILL and (seq.decoding or seq.prompt_done):
            raise StageError("prefill after the prompt's final step")
        if seq.position + T > self.max_context:
            raise StageError(f"context overflow: {seq.position + T} > {self.max_context} positions")
        if seq.early_commit is not None:
            if req.commit != seq.early_commit:
                raise StageError(f"step {req.step} needs the commit of step {req.step - 1} this stage decided")
        elif seq.pending_k is not None:
            c = req.commit
            if c is None or c.step != req.step - 1:
                raise StageError(f"step {req.step} needs the commit of step {req.step - 1}")
            if not 0 <= c.accepted <= seq.pending_k or c.trim != seq.pending_k - c.accepted:
                raise StageError(f"commit ({c.accepted} accepted, trim {c.trim}) does not fit {seq.pending_k} drafts")
            if seq.last_commit is not None and c != seq.last_commit:
                raise StageError("commit differs from the outcome this stage decided")
        elif req.commit is not None:
            raise StageError(f"no decode step awaits a commit before step {req.step}")
        if req.kind is StepKind.DECODE and self.spec.is_last:
            d = seq.draft
            if req.tokens[0] != d.last_token or req.tokens[1:] != d.drafts:
                raise StageError("decode tokens do not match the last token and drafts this stage produced")
        return seq

    # -- the forward ------------------------------------------------------------------------

    def _run(self, req: StepRequest, seq: Sequence | None, hidden: mx.array | None,
             joins_at: int | None = None) -> mx.array | StepOutput:
        if seq is None:
            seq = self.sequences[req.seq_id] = self._new_sequence(req)
        if req.keep and seq.position and self.room_for_prefix():  # (checked: the prompt's last token)
            self.prefixes[req.keep] = prefix_of_sequence(seq.cache, seq.position, seq.draft)
        if seq.pending_k is not None:
            self._apply_commit(seq, req.commit)
        seq.early_commit = None
        decode = req.kind is StepKind.DECODE
        T = len(req.tokens)
        lookahead, seq.lookahead = seq.lookahead, None
        prepared = None
        if decode and lookahead is not None:
            # The forward of exactly these tokens was issued last step; its caches are in place.
            h, snapshots, prepared = lookahead
        else:
            h = self.model.embed(mx.array([req.tokens])) if self.spec.is_first else hidden.astype(self.dtype)
            h, snapshots = self.model.run_layers(h, seq.cache, capture=decode and T > 1)
        seq.next_step = req.step + 1
        seq.decoding = seq.decoding or decode
        seq.prompt_done = seq.prompt_done or req.final
        seq.position += T
        seq.pending_k = T - 1 if decode else None
        seq.snapshots = snapshots
        if not self.spec.is_last:
            mx.eval(h)
            return h
        if req.final:
            seq.draft.joins(joins_at)
        out = self.head.run(req, seq.draft, h, seq.cache, seq.position,
                            on_token=(lambda tok: self._issue_lookahead(seq, tok)) if self.overlap else None,
                            on_drafts=(lambda o, drafts: self._issue_verify(seq, o, drafts)) if self.overlap else None,
                            prepared=prepared)
        if out.commit is not None:
            seq.last_commit = out.commit
        return out

    def room_for_prefix(self) -> bool:
        """A stage keeps what its client's engine asks while it has room, whatever that engine reckons;
        else nothing (the engine then prefills whole a prompt that counted on it)."""
        if len(self.prefixes) >= MAX_KEPT_PREFIXES:
            return False
        return self.max_prefix_bytes is None or sum(p.nbytes for p in self.prefixes.values()) < self.max_prefix_bytes

    def _new_sequence(self, req: StepRequest) -> Sequence:
        prefix = self.prefixes[req.prefix] if req.prefix else None  # (checked to be here)
        if prefix is None:
            seq = Sequence(cache=self.model.make_cache())
        else:
            seq = Sequence(cache=sequence_cache(prefix, len(self.model.layers)), position=prefix.length)
        if self.spec.is_last:
            seq.draft = new_draft_state(req, self.head.grammars)
            if prefix is not None:
                resume_draft(seq.draft, prefix)
        return seq

    def _apply_commit(self, seq: Sequence, commit: Commit) -> None:
        if commit.trim:
            for i, (c, layer) in enumerate(zip(seq.cache, self.model.layers)):
                if layer.is_linear:
                    seq.snapshots[i].restore(c, commit.accepted)
                else:
                    c.trim(commit.trim)
        seq.position -= commit.trim
        seq.pending_k = None
        seq.snapshots = {}

    def _issue_lookahead(self, seq: Sequence, token: mx.array) -> None:
        """Single stage, no drafts next round: the next step's input is this step's token, so the
        whole next step (forward, logits, pick) is queued on the still-lazy token (a sampled sequence
        or one with processors: on the token once known, drawn on the host or depending on it), and
        its tail computes while the host handles this one (mlx-lm's generate does the same with
        async_eval; on the CPU backend async_eval returns only when the last few operations are
        left). The next request must feed that token: the decode checks above make sure it does."""
        h, _ = self.model.run_layers(self.model.embed(token.reshape(1, 1)), seq.cache)
        self._queue(seq, h, {}, [])

    def _issue_verify(self, seq: Sequence, out: StepOutput, drafts: mx.array | None) -> None:
        """Single stage, drafts for the next round: its verify over [token, drafts] is known, and
        so is the commit of this round, which the next request will echo. Apply that commit now and queue
        the verify, so it computes while the host handles this round. `drafts`: still lazy (the verify
        queues behind them, before the host waits for them), else `out.drafts`."""
        if out.commit is not None:  # (none after the prompt)
            seq.last_commit = out.commit
            self._apply_commit(seq, out.commit)
            seq.early_commit = out.commit
        if drafts is None:
            tokens = mx.array([[out.tokens[-1], *out.drafts]])
        else:
            tokens = mx.concatenate([mx.array([out.tokens[-1]], dtype=drafts.dtype), drafts])[None]
        h, snapshots = self.model.run_layers(self.model.embed(tokens), seq.cache, capture=True)
        self._queue(seq, h, snapshots, out.drafts)

    def _queue(self, seq: Sequence, h: mx.array, snapshots: dict, drafts: list[int]) -> None:
        """The head's part of a step issued ahead, queued behind its forward and kept for that step."""
        prepared = self.head.prepare(h, seq.draft, drafts)
        seq.lookahead = (h, snapshots, prepared)
        mx.async_eval(*prepared.arrays())
