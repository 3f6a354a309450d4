"""A stage: one shard, and the per-sequence caches and snapshots of its layers.

Every stage runs its layers over a step's positions and applies commits locally. The last stage
also turns hidden states into tokens: the acceptance walk against its own drafts, then the next
drafts from the MTP head. Requests are validated before anything is touched, so a refused request
leaves the sequence exactly as it was.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from ..models.gdn_snapshots import GDNSnapshots
from ..models.loading import LoadedShard
from .acceptance import accept_greedy, accept_sampled, draw, filtered_probs
from .protocol import Commit, SamplingParams, StageError, StepKind, StepOutput, StepRequest

log = logging.getLogger(__name__)

MAX_MTP_DEPTH = 8
CLEAR_CACHE_EVERY = 256


@dataclass
class DraftState:
    """Last-stage state of one sequence: the MTP cache and what the pending drafts were drawn from."""

    params: SamplingParams
    depth: int
    rng: np.random.Generator
    mtp_cache: KVCache | None
    mtp_len: int = 0  # MTP cache entries built from true backbone hiddens (positions 0..mtp_len-1)
    pending_hidden: mx.array | None = None  # hidden of the last position whose next token is unknown
    last_token: int | None = None  # the token the next decode step must start with
    drafts: list[int] = field(default_factory=list)
    draft_probs: np.ndarray | None = None  # [K, V], sampling only


@dataclass
class Sequence:
    cache: list
    next_step: int = 0
    position: int = 0  # tokens committed into this stage's caches
    decoding: bool = False
    pending_k: int | None = None  # drafts in the last decode step, until its commit arrives
    snapshots: dict[int, GDNSnapshots] = field(default_factory=dict)
    draft: DraftState | None = None
    lookahead: mx.array | None = None  # hidden of an already-issued next decode step
    last_commit: Commit | None = None  # the last stage's own outcome, to check the echo against


@dataclass
class StageStats:
    tokens_processed: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    last_error: str | None = None

    @property
    def mean_step_ms(self) -> float:
        return 1000.0 * self.step_seconds / self.steps if self.steps else 0.0


class StageWorker:
    def __init__(self, shard: LoadedShard, max_sequences: int = 64, mtp_pre_norm: bool = False):
        self.shard = shard
        # The MTP head reads the backbone hidden after the final norm (vLLM, SGLang, llama.cpp) unless
        # told to read it before (mlx-lm PR #990); post-norm measured better on trained checkpoints.
        self.mtp_pre_norm = mtp_pre_norm
        self.model = shard.model
        self.spec = shard.spec
        self.hidden_size = shard.config.args.hidden_size
        self.dtype = self.model.layers[0].input_layernorm.weight.dtype
        self.max_sequences = max_sequences
        self.max_context = shard.config.args.max_position_embeddings
        self.sequences: dict[str, Sequence] = {}
        self.stats = StageStats()
        self.lock = threading.Lock()  # one forward at a time through this shard

    # -- public API ------------------------------------------------------------------------

    def step(self, req: StepRequest, hidden: mx.array | None = None) -> mx.array | StepOutput:
        """Run one step. Non-last stages return the hidden states for the next stage."""
        with self.lock:
            start = time.perf_counter()
            try:
                seq = self._check(req, hidden)
                out = self._run(req, seq, hidden)
            except StageError as e:
                self.stats.last_error = str(e)
                raise
            self.stats.steps += 1
            if self.stats.steps % CLEAR_CACHE_EVERY == 0:
                mx.clear_cache()  # long generations otherwise grow the allocator cache (as mlx-lm does)
            self.stats.tokens_processed += len(req.tokens)
            self.stats.step_seconds += time.perf_counter() - start
            return out

    def release(self, seq_id: str) -> bool:
        with self.lock:
            return self.sequences.pop(seq_id, None) is not None

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
            if hidden is None:
                raise StageError("this stage needs the previous stage's hidden states")
            if tuple(hidden.shape) != (1, T, self.hidden_size):
                raise StageError(f"hidden states have shape {tuple(hidden.shape)}, expected (1, {T}, {self.hidden_size})")
        if seq is None:
            if req.step != 0:
                raise StageError(f"unknown sequence {req.seq_id!r}")
            if req.kind is not StepKind.PREFILL:
                raise StageError("a sequence starts with a prefill step")
            if len(self.sequences) >= self.max_sequences:
                raise StageError(f"too many active sequences ({self.max_sequences})")
            if req.params is not None:
                try:
                    req.params.validate()
                except ValueError as e:
                    raise StageError(str(e)) from None
            if not 0 <= req.mtp_depth <= MAX_MTP_DEPTH:
                raise StageError(f"mtp_depth must be in [0, {MAX_MTP_DEPTH}], got {req.mtp_depth}")
            if req.mtp_depth > 0 and self.spec.is_last and not self.shard.has_mtp:
                raise StageError("this model was loaded without an MTP head; use mtp_depth 0")
            return None
        if req.step != seq.next_step:
            raise StageError(f"step {req.step} out of order for {req.seq_id!r}: expected {seq.next_step}")
        if req.kind is StepKind.PREFILL and seq.decoding:
            raise StageError("prefill after decoding started")
        if seq.position + T > self.max_context:
            raise StageError(f"context overflow: {seq.position + T} > {self.max_context} positions")
        if seq.pending_k is not None:
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

    def _run(self, req: StepRequest, seq: Sequence | None, hidden: mx.array | None) -> mx.array | StepOutput:
        if seq is None:
            seq = self.sequences[req.seq_id] = Sequence(cache=self.model.make_cache())
            if self.spec.is_last:
                seq.draft = self._new_draft_state(req)
        if seq.pending_k is not None:
            self._apply_commit(seq, req.commit)
        decode = req.kind is StepKind.DECODE
        T = len(req.tokens)
        lookahead, seq.lookahead = seq.lookahead, None
        if decode and lookahead is not None:
            # The forward of exactly these tokens was issued last step; its caches are in place.
            h, snapshots = lookahead, {}
        else:
            h = self.model.embed(mx.array([req.tokens])) if self.spec.is_first else hidden.astype(self.dtype)
            h, snapshots = self.model.run_layers(h, seq.cache, capture=decode and T > 1)
        seq.next_step = req.step + 1
        seq.decoding = seq.decoding or decode
        seq.position += T
        seq.pending_k = T - 1 if decode else None
        seq.snapshots = snapshots
        if not self.spec.is_last:
            mx.eval(h)
            return h
        return self._head(req, seq, h)

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

    def _new_draft_state(self, req: StepRequest) -> DraftState:
        params = req.params or SamplingParams()
        seed = params.seed if params.seed is not None else int(np.random.SeedSequence().entropy % 2**63)
        use_mtp = req.mtp_depth > 0
        return DraftState(
            params=params,
            depth=req.mtp_depth,
            rng=np.random.default_rng(seed),
            mtp_cache=KVCache() if use_mtp else None,
        )

    # -- last stage: tokens out --------------------------------------------------------------

    def _head(self, req: StepRequest, seq: Sequence, h: mx.array) -> StepOutput:
        d = seq.draft
        normed = self.model.final_norm(h)
        mtp_in = h if self.mtp_pre_norm else normed  # which backbone hidden feeds the MTP head
        out = StepOutput(seq_id=req.seq_id, step=req.step)
        if req.kind is StepKind.PREFILL:
            self._extend_mtp(d, mtp_in, req.tokens)
            if not req.final:
                mx.eval(normed, [c.state for c in seq.cache], d.mtp_cache.state if d.mtp_cache else [])
                return out
            out.tokens = [self._pick(d, self.model.lm_logits(normed[:, -1:]), seq)]
            hid, toks = d.pending_hidden, out.tokens
        elif len(req.tokens) == 1:
            out.tokens = [self._pick(d, self.model.lm_logits(normed[:, -1:]), seq)]
            out.commit = seq.last_commit = Commit(step=req.step, accepted=0, trim=0)
            hid, toks = mtp_in, out.tokens
        else:
            n, out.tokens = self._accept(d, self.model.lm_logits(normed), req.tokens[1:])
            out.accepted, out.drafted = n, len(req.tokens) - 1
            out.commit = seq.last_commit = Commit(step=req.step, accepted=n, trim=out.drafted - n)
            # Positions y, d1..dn pair with d1..dn, c: their MTP entries are rebuilt from true hiddens.
            hid, toks = mtp_in[:, : n + 1], out.tokens
        d.last_token = out.tokens[-1]
        if d.mtp_cache is not None:
            d.mtp_cache.trim(d.mtp_cache.offset - d.mtp_len)  # drop last round's chained entries
            out.drafts = self._draft(d, hid, toks)
        return out

    def _extend_mtp(self, d: DraftState, hidden: mx.array, tokens: list[int]) -> None:
        """Prefill: add MTP entries (H[t], x[t+1]); the chunk's last position waits for its next token."""
        if d.mtp_cache is None:
            return
        hid, toks = hidden[:, :-1], tokens[1:]
        if d.pending_hidden is not None:
            hid, toks = mx.concatenate([d.pending_hidden, hid], axis=1), tokens
        d.pending_hidden = hidden[:, -1:]
        if toks:
            self.model.mtp(hid, self.model.embed(mx.array([toks])), d.mtp_cache)
            d.mtp_len += len(toks)

    def _draft(self, d: DraftState, hid: mx.array, toks: list[int]) -> list[int]:
        """K drafts. The first MTP call adds true entries for all (hidden, next token) pairs and its
        last output drafts d1; later drafts chain on the MTP output g (entries trimmed next round).
        Greedy chains stay lazy and are evaluated once; sampling draws each draft on the host."""
        inputs = mx.array([toks])
        lazy: list[mx.array] = []
        probs = []
        for j in range(d.depth):
            g = self.model.mtp(hid, self.model.embed(inputs), d.mtp_cache)[:, -1:]
            logits = self.model.lm_logits(g).reshape(-1)
            if d.params.greedy:
                tok = mx.argmax(logits)
                lazy.append(tok)
                inputs = tok.reshape(1, 1)
            else:
                q = filtered_probs(logits, d.params)
                drawn = draw(q, d.rng)
                lazy.append(mx.array(drawn))
                probs.append(q)
                inputs = mx.array([[drawn]])
            hid = g
        d.mtp_len += len(toks)
        d.pending_hidden = None
        d.drafts = mx.stack(lazy).tolist() if lazy else []
        d.draft_probs = np.stack(probs) if probs else None
        return d.drafts

    def _pick(self, d: DraftState, logits: mx.array, seq: Sequence) -> int:
        logits = logits.reshape(-1)
        if d.params.greedy:
            token = mx.argmax(logits)
            self._issue_lookahead(seq, token)
            return int(token.item())
        return draw(filtered_probs(logits, d.params), d.rng)

    def _issue_lookahead(self, seq: Sequence, token: mx.array) -> None:
        """Single stage, greedy, no drafts: the next step's input is this step's token, so its
        forward can be queued on the still-lazy token and computed while the host handles this
        one (what mlx-lm's generate does with async_eval). The next request must feed that token:
        the decode checks above make sure it does."""
        if not (self.spec.is_first and seq.draft.depth == 0):
            return
        h, _ = self.model.run_layers(self.model.embed(token.reshape(1, 1)), seq.cache)
        seq.lookahead = h
        mx.async_eval(h)

    def _accept(self, d: DraftState, logits: mx.array, drafts: list[int]) -> tuple[int, list[int]]:
        logits = logits[0]
        if d.params.greedy:
            return accept_greedy(mx.argmax(logits, axis=-1).tolist(), drafts)
        return accept_sampled(filtered_probs(logits, d.params), d.draft_probs, drafts, d.rng)
