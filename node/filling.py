"""Prompts prefilled together: one padded forward per chunk for every sequence still taking its prompt.

Rows are right-padded to the longest chunk of the step. Attention writes each row's entries at its own
length (ragged.py); GatedDeltaNet layers run mlx-lm's own prefill path with a mask for the padding and
each row's length, so a row's state and conv window end at its last real token without keeping a
state per position. A row that is not in a step feeds nothing (masked throughout). On the last stage
each row's hidden states then go through the single-sequence head (head.py): its MTP cache, its
first token and first drafts are per row. A row whose prompt is in leaves for the decode batch.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..models.gdn_chunked import prefill_layer
from ..models.ragged import RaggedKV, cache_arrays, concat_caches, pad_rows, ragged_layer, take_rows
from ..models.shard import queue_layers
from .batch_depth import DepthPlan
from .constraints import constraint_for
from .head import DraftState, Head, new_draft_state
from .prefixes import Mark, Prefix, check_resumed, mark_row, resume_draft, row_from
from .protocol import StageError, StepKind, StepOutput, StepRequest
from .stage import check_first_step, check_hidden


class FillGroup:
    def __init__(self, model: object, head: Head | None, *, first: bool, dtype: mx.Dtype, max_context: int,
                 vocab_size: int, hidden_size: int, has_mtp: bool, prefixes: dict[str, Prefix] | None = None,
                 plan: DepthPlan | None = None):
        self.model = model
        self.head = head
        self.plan = plan  # the depth of the batch the rows join: their first round's (head.py: `joins_at`)
        self.first = first
        self.dtype = dtype
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.has_mtp = has_mtp
        self.ids: list[str] = []
        self.cache: list = []
        self.positions: list[int] = []
        self.steps: list[int] = []  # the next step each row expects
        self.drafts: dict[str, DraftState] = {}
        self.prefixes = prefixes if prefixes is not None else {}  # the stage's kept prompt prefixes
        self.marking = False  # copy each row's state as its prompt's last token goes in (`marks`)
        self.marks: dict[str, Mark] = {}

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self.ids

    # -- rows -----------------------------------------------------------------------------------

    def _add(self, req: StepRequest) -> None:
        prefix = self.prefixes[req.prefix] if req.prefix else None  # (checked: `_check`)
        row = self._empty_row() if prefix is None else row_from(prefix, len(self.model.layers))
        self.cache = row if not self.ids else concat_caches([self.cache, row])
        self.ids.append(req.seq_id)
        self.positions.append(0 if prefix is None else prefix.length)
        self.steps.append(0)
        if self.head is not None:
            self.drafts[req.seq_id] = draft = new_draft_state(req, self.head.grammars)
            if prefix is not None:
                resume_draft(draft, prefix)

    def _empty_row(self) -> list:
        row: list = []
        for layer in self.model.layers:
            if layer.is_linear:
                gdn = layer.linear_attn
                c = ArraysCache(size=2)
                c[0] = mx.zeros((1, gdn.conv_kernel_size - 1, gdn.conv_dim), self.dtype)
                c[1] = mx.zeros((1, gdn.num_v_heads, gdn.head_v_dim, gdn.head_k_dim), mx.float32)
                row.append(c)
            else:
                row.append(RaggedKV(None, None, [0]))
        return row

    def take(self, seq_id: str) -> tuple[list, int, DraftState | None]:
        """Remove a row: its caches (one batch row), its position and its head state."""
        i = self.ids.index(seq_id)
        row = take_rows(self.cache, [i])
        position = self.positions[i]
        self._drop(i)
        return row, position, self.drafts.pop(seq_id, None)

    def release(self, seq_id: str) -> bool:
        if seq_id not in self.ids:
            return False
        self._drop(self.ids.index(seq_id))
        self.drafts.pop(seq_id, None)
        self.marks.pop(seq_id, None)
        return True

    def _drop(self, i: int) -> None:
        keep = [j for j in range(len(self.ids)) if j != i]
        self.cache = take_rows(self.cache, keep) if keep else []
        for lst in (self.ids, self.positions, self.steps):
            del lst[i]

    # -- a step ---------------------------------------------------------------------------------

    def step(self, reqs: list[StepRequest], hidden: mx.array | None) -> mx.array | list[StepOutput]:
        """One prompt chunk for each row named in `reqs` (other rows sit this step out). Returns the
        hidden states of every row (padded), or on the last stage each named row's output, in order."""
        self._check(reqs, hidden)
        for req in reqs:
            if req.seq_id not in self.ids:
                self._add(req)
        by_id = {r.seq_id: r for r in reqs}
        if self.marking:  # (before the forward: where the prompt's last token is about to go in)
            for i, s in enumerate(self.ids):
                if s in by_id and by_id[s].final and self.positions[i]:
                    self.marks[s] = mark_row(self.cache, i, self.positions[i], self.drafts.get(s))
        tokens = [by_id[s].tokens if s in by_id else [] for s in self.ids]
        real = [len(t) for t in tokens]
        width = max(real)
        if self.first:
            h = self.model.embed(pad_rows([t or [0] for t in tokens]))
        else:
            h = hidden.astype(self.dtype)
        # Rows shorter than the widest mask their padding out of the GatedDeltaNet layers; with every
        # row full, the layers run unmasked (the same arithmetic, without a mask op per position).
        ragged = any(n != width for n in real)
        valid = mx.arange(width)[None, :] < mx.array(real)[:, None] if ragged else None
        queue = queue_layers()  # each layer computes while the host builds the next
        for layer, c in zip(self.model.layers, self.cache):
            if layer.is_linear:
                c.lengths = mx.array(real) if ragged else None
                h = prefill_layer(layer, h, c, valid)
                c.lengths = None
            else:
                h, _ = ragged_layer(layer, h, c, real)
            if queue:
                mx.async_eval(h)
        self.positions = [p + n for p, n in zip(self.positions, real)]
        for i, s in enumerate(self.ids):
            if s in by_id:
                self.steps[i] += 1
        if self.head is None:
            mx.eval(h, cache_arrays(self.cache))
            return h
        outs: list[StepOutput] = []
        for i, s in enumerate(self.ids):
            req = by_id.get(s)
            if req is None:
                continue
            if req.final and self.plan is not None:
                self.drafts[s].joins(self.plan.depth)
            outs.append(self.head.run(req, self.drafts[s], h[i : i + 1, : real[i]], [], self.positions[i]))
        mx.eval(cache_arrays(self.cache))
        made = {o.seq_id: o for o in outs}
        return [made[r.seq_id] for r in reqs]

    def _check(self, reqs: list[StepRequest], hidden: mx.array | None) -> None:
        seen = set()
        for req in reqs:
            if req.seq_id in seen:
                raise StageError(f"sequence {req.seq_id!r} twice in one prefill step")
            seen.add(req.seq_id)
            if req.kind is not StepKind.PREFILL or not req.tokens:
                raise StageError("a prefill step carries prompt tokens")
            if any(not 0 <= t < self.vocab_size for t in req.tokens):
                raise StageError("token id out of the vocabulary range")
            if req.seq_id in self.ids:
                i = self.ids.index(req.seq_id)
                if req.step != self.steps[i]:
                    raise StageError(f"step {req.step} out of order for {req.seq_id!r}: expected {self.steps[i]}")
                if self.positions[i] + len(req.tokens) > self.max_context:
                    raise StageError(f"context overflow: {self.positions[i] + len(req.tokens)} > {self.max_context}")
            elif req.step != 0:
                raise StageError(f"unknown sequence {req.seq_id!r}")
            else:
                check_first_step(req, drafts_here=self.head is not None, has_mtp=self.has_mtp)
                prefix = self.prefixes.get(req.prefix) if req.prefix else None
                if req.prefix and prefix is None:
                    raise StageError(f"no kept prompt prefix {req.prefix!r} on this stage")
                check_resumed(prefix, req.resumed_at)
                if (start := prefix.length if prefix else 0) + len(req.tokens) > self.max_context:
                    raise StageError(f"context overflow: {start + len(req.tokens)} > {self.max_context}")
                if self.head is not None and req.params is not None:  # (its grammar compiles: kept for `_add`)
                    constraint_for(req.params, self.head.grammars, build=False)
        if self.first and hidden is not None:
            raise StageError("the first stage takes token ids, not hidden states")
        if not self.first:  # every row, the new ones too, as wide as the step's longest chunk
            rows = len(self.ids) + len(seen - set(self.ids))
            check_hidden(hidden, (rows, max(len(r.tokens) for r in reqs), self.hidden_size))
