"""Logits processors inside a verify, and the log-probabilities of what was emitted.

A verify over [y, d1..dK] scores K+1 positions at once; position j must see the history as if d1..dj
were already accepted, which is what decoding one token at a time would have seen. So penalties are
applied per position: `repetition_penalty` (mlx-lm's rule, over the last REPETITION_CONTEXT tokens,
prompt included) first, then the additive ones: `logit_bias`, and `presence_penalty` /
`frequency_penalty` over the generated tokens (OpenAI's rule). Only the (row, position, token) triples
a rule touches are gathered and written back; the additive rules of the tokens already generated
are one dense row per request, kept on the device and updated with each round's tokens. Greedy
picks and sampling both read the processed logits, so greedy output equals non-speculative decoding
with the same settings and sampled output keeps its distribution.

Until `min_tokens` were generated, the tokens that end the sequence get -inf (vLLM's min_tokens), in
the MTP head's draft logits too (`draft_row`). A grammar (constraints.py) comes last: the tokens it
refuses at a position get -inf there.

Log-probabilities are those of the processed logits before temperature and the top-k/top-p/min-p
filters (what the model, with the request's biases and penalties, gives each token; under a grammar,
over the tokens it allows, so fewer than asked may be listed where it allows fewer).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .constraints import Constraint
from .protocol import SamplingParams

REPETITION_CONTEXT = 20


@dataclass
class PenaltyRow:
    """A row's additive processors as a dense row over the vocabulary, kept on the device: logit_bias,
    and the presence and frequency penalties of the generated tokens folded in so far. Each round folds
    in only its new tokens, so a round's host work does not grow with the generation."""

    row: mx.array  # [V]
    seen: Counter[int] = field(default_factory=Counter)  # the generated tokens folded in, counted
    upto: int = 0  # how many of the generated tokens are folded in

    def penalty(self, token: int, params: SamplingParams, also: Counter[int] | None = None) -> float:
        """What the penalties take from `token` once it has been generated again (after `also`, tokens
        not folded in yet)."""
        before = self.seen[token] + (also[token] if also is not None else 0)
        return params.frequency_penalty + (params.presence_penalty if not before else 0.0)


@dataclass
class History:
    """What a row's processors need: the tokens it generated, and the last tokens of its context."""

    generated: list[int] = field(default_factory=list)
    # prompt and generated, the last REPETITION_CONTEXT and one more: a sequence's state kept at its end
    # (prefixes.py) was never fed the last token it emitted, and looks back from the one before
    recent: list[int] = field(default_factory=list)
    length: int = 0  # tokens in the sequence: the position of the next one
    generated_from: int = 0  # a resumed sequence: its prompt's tokens from here on were generated (0: none)
    additive: PenaltyRow | None = None  # made by the first `apply` that needs it
    constraint: Constraint | None = None  # the grammar its output is held to
    ends: frozenset[int] = frozenset()  # the tokens that end it: refused before params.min_tokens were generated
    refused: mx.array | None = field(default=None, repr=False)  # -inf at `ends` over the vocabulary (`draft_row`)

    def extend_prompt(self, tokens: list[int], ends: tuple[int, ...] | None = None) -> None:
        """A prompt chunk taken in; the last one names the tokens that end the row (`ends`)."""
        if ends is not None:
            self.ends = frozenset(ends)
        if self.generated_from:
            again = list(tokens)[max(0, self.generated_from - self.length) :]
            self.generated += again
            if self.constraint is not None:
                self.constraint.take(again)
        self.recent = (self.recent + list(tokens))[-REPETITION_CONTEXT - 1 :]
        self.length += len(tokens)

    def emit(self, tokens: list[int]) -> None:
        if self.constraint is not None:
            self.constraint.take(tokens)
        self.generated += tokens
        self.recent = (self.recent + list(tokens))[-REPETITION_CONTEXT - 1 :]
        self.length += len(tokens)

    def additive_row(self, params: SamplingParams, vocab: int) -> PenaltyRow:
        """The dense additive row, with every generated token folded in."""
        if self.additive is None:
            self.additive = PenaltyRow(bias_vector(params, vocab))
        add = self.additive
        if add.upto < len(self.generated) and (params.presence_penalty or params.frequency_penalty):
            delta: Counter[int] = Counter()
            for t in self.generated[add.upto :]:
                delta[t] -= add.penalty(t, params)
                add.seen[t] += 1
            add.row = add.row.at[mx.array(list(delta))].add(mx.array(list(delta.values())))
        add.upto = len(self.generated)
        return add


def has_additive(params: SamplingParams) -> bool:
    return bool(params.logit_bias) or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def has_processors(params: SamplingParams, history: History | None = None) -> bool:
    """Whether a row's logits are processed: for penalties, a bias or a grammar always; for min_tokens while
    it holds back a token that would end the row (known from its `history`; without one, whenever asked)."""
    holds = params.min_tokens > 0 if history is None else \
        params.min_tokens > len(history.generated) and bool(history.ends)
    return has_additive(params) or params.repetition_penalty != 1.0 or params.grammar is not None or holds


def apply(logits: mx.array, rows: list[tuple[int, SamplingParams, History, list[int]]]) -> mx.array:
    """Processed `logits` [B, T, V] (float32): for each (row index, params, history, drafts),
    position j sees the history followed by drafts[:j]. Rows not listed are left as they are."""
    out = logits.astype(mx.float32)
    vocab = logits.shape[-1]
    rep: list[tuple[int, int, int, float]] = []  # (row, position, token, factor)
    adds: list[tuple[int, mx.array]] = []  # (row, dense additive row)
    extra: list[tuple[int, int, int, float]] = []  # (row, position, token, add): the drafts' own penalties
    allowed: list[tuple[int, np.ndarray]] = []  # (row, [positions, V]): what its grammar allows (constraints.py)
    early: list[tuple[int, int, int]] = []  # (row, position, token): an end before min_tokens were generated
    for b, params, history, drafts in rows:
        positions = min(len(drafts), logits.shape[1] - 1) + 1
        short = min(positions, params.min_tokens - len(history.generated))
        early += [(b, j, t) for j in range(short) for t in history.ends]
        if history.constraint is not None:
            allowed.append((b, history.constraint.masks(drafts, positions)))
        if params.repetition_penalty != 1.0:
            for j in range(positions):
                for t in set((history.recent + drafts[:j])[-REPETITION_CONTEXT:]):
                    rep.append((b, j, t, params.repetition_penalty))
        if not has_additive(params):
            continue
        add = history.additive_row(params, vocab)
        adds.append((b, add.row))
        if params.presence_penalty or params.frequency_penalty:
            before: Counter[int] = Counter()
            for i, t in enumerate(drafts[: positions - 1]):  # seen by positions i+1..
                step = add.penalty(t, params, before)
                before[t] += 1
                extra += [(b, j, t, -step) for j in range(i + 1, positions)]
    if rep:
        b, j, t, factor = (mx.array(list(c)) for c in zip(*rep))
        values = out[b, j, t]
        out[b, j, t] = mx.where(values > 0, values / factor, values * factor)
    if adds:  # a broadcast add: a scatter of whole rows is far slower on the CPU
        by_row, none = dict(adds), mx.zeros((vocab,), mx.float32)
        out = out + mx.stack([by_row.get(b, none) for b in range(out.shape[0])])[:, None, :]
    if extra:
        b, j, t, value = (mx.array(list(c)) for c in zip(*extra))
        out = out.at[b, j, t].add(value)
    if early:
        b, j, t = (mx.array(list(c)) for c in zip(*early))
        out[b, j, t] = -mx.inf
    if allowed:  # last: a token the grammar refuses stays refused whatever the penalties
        mask = np.ones((len(allowed), *out.shape[1:]), dtype=bool)  # (only the rows a grammar holds)
        for i, (_, rows_allowed) in enumerate(allowed):
            mask[i, : rows_allowed.shape[0]] = rows_allowed
        held = mx.array([b for b, _ in allowed])
        out[held] = mx.where(mx.array(mask), out[held], -mx.inf)
    return out


def bias_vector(params: SamplingParams, vocab: int) -> mx.array:
    """logit_bias as a dense row over the vocabulary (ids past it are ignored: validated upstream)."""
    row = mx.zeros((vocab,), mx.float32)
    pairs = [(t, v) for t, v in params.logit_bias if t < vocab]
    if pairs:
        row[mx.array([t for t, _ in pairs])] = mx.array([v for _, v in pairs])
    return row


def draft_row(bias: mx.array | None, params: SamplingParams, history: History, ahead: int,
              vocab: int) -> mx.array | None:
    """What a row's draft `ahead` tokens past its emitted ones adds to the MTP head's logits: its logit_bias
    (`bias`, its dense row: drafts from the biased distribution are accepted as often), and -inf for the
    tokens that end it while min_tokens were not generated there (the verify refuses them: a greedy draft
    is then the token the verify picks instead). Whatever a draft is drawn from is also what its
    acceptance reads, so output is unchanged. None: nothing to add."""
    if len(history.generated) + ahead >= params.min_tokens:
        return bias
    if history.refused is None:  # (made once: the same row for every draft step it holds back)
        if not (ends := sorted(t for t in history.ends if t < vocab)):
            return bias
        history.refused = mx.zeros((vocab,), mx.float32)
        history.refused[mx.array(ends)] = -mx.inf
    return history.refused if bias is None else bias + history.refused


@dataclass
class LogprobTable:
    """Log-probabilities of a round's positions, still lazy: built behind the round's logits, before any
    later round is queued, so they compute with it; read on the host once the emitted tokens are known,
    in one wait for every row that waits on nothing queued after them. On a GPU the table is computed
    on the device; on the CPU backend only the logits are (`on_host`), and the host normalizes the
    emitted positions alone when it reads them: numpy's `exp` is vectorized where the CPU backend's is
    not, and a verify's rejected positions need none."""

    lp: mx.array  # [R, T, V]: normalized on the device; for the host, the logits (float32)
    ids: mx.array | None  # [R, T, top]: the most likely tokens (unordered), None when no row asks or on the host
    vals: mx.array | None
    rows: list[int] | None = None  # the batch rows it holds, in order (None: every row)
    on_host: bool = False

    def arrays(self) -> list[mx.array]:
        return [self.lp] if self.ids is None else [self.lp, self.ids, self.vals]


def on_host() -> bool:
    """Whether log-probabilities are computed on the host: where MLX computes on the CPU anyway."""
    return mx.default_device() == mx.cpu


def logprob_table(logits: mx.array, top: int, rows: list[int] | None = None) -> LogprobTable:
    """The table of `logits` [B, T, V] (only `rows` of them, if given) with the `top` most likely
    tokens per position (0: none)."""
    if rows is not None and len(rows) < logits.shape[0]:
        logits = logits[mx.array(rows)]
    else:
        rows = None
    lp = logits.astype(mx.float32)
    if on_host():
        return LogprobTable(lp, None, None, rows, on_host=True)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    top = min(top, logits.shape[-1])
    if top <= 0:
        return LogprobTable(lp, None, None, rows)
    ids = mx.argpartition(-lp, top - 1, axis=-1)[..., :top]
    return LogprobTable(lp, ids, mx.take_along_axis(lp, ids, axis=-1), rows)


def _normalized(logits: np.ndarray, tokens: list[int], top: int
                ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Host side of a table, for positions' logits [T, V] (float32) and the token emitted at each: the
    tokens' log-probabilities [T], and the `top` most likely tokens [T, top] (unordered) with theirs."""
    peak = logits.max(axis=-1, keepdims=True)
    norm = peak + np.log(np.exp(logits - peak).sum(axis=-1, keepdims=True))  # [T, 1]
    lp = logits[np.arange(len(tokens)), tokens] - norm[:, 0]
    top = min(top, logits.shape[-1])
    if top <= 0:
        return lp, None, None
    ids = np.argpartition(-logits, top - 1, axis=-1)[:, :top]
    return lp, ids, np.take_along_axis(logits, ids, axis=-1) - norm


def read_logprobs(table: LogprobTable, rows: list[tuple[int, list[int], int]]
                  ) -> list[list[tuple[float, list[tuple[int, float]]]]]:
    """For each (batch row, tokens emitted at its positions 0.., top): per token, its log-probability
    and the `top` most likely tokens with theirs, most likely first. Indexed on the host: a gather
    queued now would run after whatever was queued since the table."""
    mx.eval(*table.arrays())
    at = {b: i for i, b in enumerate(table.rows)} if table.rows is not None else None
    lp_all = np.asarray(table.lp)
    ids_all, vals_all = (np.asarray(table.ids), np.asarray(table.vals)) if table.ids is not None else (None, None)
    out = []
    for b, tokens, top in rows:
        r = at[b] if at is not None else b
        if table.on_host:
            lp, ids, vals = _normalized(lp_all[r, : len(tokens)], tokens, top)
        else:
            lp = lp_all[r, np.arange(len(tokens)), tokens]
            ids, vals = (ids_all[r], vals_all[r]) if ids_all is not None else (None, None)
        per_row = []
        for j in range(len(tokens)):
            best = []
            if top > 0 and ids is not None:
                best = sorted(((t, v) for t, v in zip(ids[j].tolist(), vals[j].tolist()) if v > -np.inf),
                              key=lambda p: (-p[1], p[0]))[:top]  # (none a grammar refuses: constraints.py)
            per_row.append((float(lp[j]), best))
        out.append(per_row)
    return out
