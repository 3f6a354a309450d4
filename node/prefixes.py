"""Prompt prefixes kept on a stage, so a later prompt that starts with one skips prefilling it.

A GatedDeltaNet state exists only for the position it was taken at, so a prefix is kept at one
position: where the prompt's last token was about to go in (its own step, see the batch engine). The
stage copies then what its layers hold at that point: each GatedDeltaNet layer's conv and recurrent
state, and on the last stage the MTP head's pending hidden and cache length. Attention keys and values
(and the MTP cache's) are taken once the row joins the batch, cut to that position; on a node, whose
prompts go in one sequence at a time, all of it is taken at once (`prefix_of_sequence`). A batch row that
finished is kept the same way, at the position before the last token it emitted (`prefix_at_end`): a
chat's next turn starts with its prompt and reply. Copies, not views:
nothing written later into a row's caches reaches a kept prefix, and a kept prefix never holds a
batch's buffers alive. Which prefix a prompt reuses, and which are dropped, the engine decides
(coordinator/engine/scheduler.py); a stage only keeps and hands out what it is told.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from ..models.ragged import RaggedKV, rows_cache
from .head import DraftState
from .protocol import StageError


@dataclass
class Mark:
    """A row's state as its prompt's last token is about to go in (the attention part comes later)."""

    position: int
    gdn: dict[int, tuple[mx.array, mx.array]]  # layer index -> (conv, state), [1, ...] copies
    pending: mx.array | None = None  # the MTP head's: hidden of the last position, [1, 1, hidden]
    mtp_len: int = 0
    recent: tuple[int, ...] = ()  # the tokens the logits processors look back on


@dataclass
class Prefix:
    """What one stage keeps of a prompt's first `length` tokens."""

    length: int
    kv: dict[int, tuple[mx.array, mx.array]]  # attention layer index -> keys, values [1, heads, length, dim]
    gdn: dict[int, tuple[mx.array, mx.array]]  # GatedDeltaNet layer index -> conv, state
    mtp: tuple[mx.array, mx.array] | None  # the MTP cache's keys and values, `mtp_len` entries
    mtp_len: int
    pending: mx.array | None
    recent: tuple[int, ...]

    def arrays(self) -> list[mx.array]:
        out = [a for pair in (*self.kv.values(), *self.gdn.values()) for a in pair] + list(self.mtp or ())
        return out + ([self.pending] if self.pending is not None else [])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    @property
    def drafts(self) -> bool:
        """It carries the MTP head's part: a sequence that drafts can go on from it."""
        return self.pending is not None


def row_states(cache: list, i: int) -> dict[int, tuple[mx.array, mx.array]]:
    """Copies of row i's GatedDeltaNet states (conv, recurrent) out of a batch's caches, by layer."""
    return {j: (mx.contiguous(c[0][i : i + 1]), mx.contiguous(c[1][i : i + 1]))
            for j, c in enumerate(cache) if not isinstance(c, RaggedKV)}


def mark_row(cache: list, i: int, position: int, draft: DraftState | None) -> Mark:
    """Copy row i's GatedDeltaNet states (and its MTP head's pending part) out of a batch's caches."""
    gdn = row_states(cache, i)
    mark = _marked(position, gdn, draft)
    mx.eval(list(gdn.values()), mark.pending if mark.pending is not None else [])
    return mark


def _marked(position: int, gdn: dict[int, tuple[mx.array, mx.array]], draft: DraftState | None) -> Mark:
    mark = Mark(position, gdn)
    if draft is not None:
        mark.recent = tuple(draft.history.recent)
        if draft.mtp_cache is not None and draft.pending_hidden is not None:
            mark.pending, mark.mtp_len = mx.contiguous(draft.pending_hidden), draft.mtp_len
    return mark


def prefix_of(mark: Mark, row: list, draft: DraftState | None) -> Prefix:
    """The prefix at `mark`, its attention entries cut from the row's caches once it joined the batch."""
    n = mark.position
    kv = {j: (mx.contiguous(c.keys[:, :, :n]), mx.contiguous(c.values[:, :, :n]))
          for j, c in enumerate(row) if isinstance(c, RaggedKV)}
    return _with_head(mark, kv, draft.mtp_cache if draft is not None else None)


def prefix_of_sequence(cache: list, position: int, draft: DraftState | None) -> Prefix:
    """What a sequence of the per-sequence path (KVCache / ArraysCache per layer) holds now, copied:
    the state its first `position` tokens left, as its prompt's last token is about to go in."""
    kv = {j: (mx.contiguous(c.keys[:, :, :position]), mx.contiguous(c.values[:, :, :position]))
          for j, c in enumerate(cache) if isinstance(c, KVCache)}
    gdn = {j: (mx.contiguous(c[0]), mx.contiguous(c[1])) for j, c in enumerate(cache) if not isinstance(c, KVCache)}
    return _with_head(_marked(position, gdn, draft), kv, draft.mtp_cache if draft is not None else None)


def _with_head(mark: Mark, kv: dict[int, tuple[mx.array, mx.array]], mtp_cache: KVCache | None) -> Prefix:
    n = mark.position
    mtp, pending = None, mark.pending
    if pending is not None and mtp_cache is not None and mark.mtp_len:
        k, v = mtp_cache.keys, mtp_cache.values
        mtp = (mx.contiguous(k[:, :, : mark.mtp_len]), mx.contiguous(v[:, :, : mark.mtp_len]))
    prefix = Prefix(n, kv, mark.gdn, mtp, mark.mtp_len, pending, mark.recent)
    mx.eval(prefix.arrays())
    return prefix


def prefix_at_end(cache: list, i: int, position: int, draft: DraftState | None, mtp_cache: KVCache | None,
                  model: object) -> Prefix:
    """What row i of a batch's caches holds once its last round was committed, copied: the state its
    first `position` tokens left. The last token it emitted was never fed, so this is a prefix whose
    next token is still to go in, as at a prompt's end: the MTP head's entries stop one position short
    and the last position's hidden waits for its next token. Pairs kept from rounds without drafts go
    into the entries first (on `mtp_cache`, a view of the row's entries that grows into new arrays)."""
    kv = {j: (mx.contiguous(c.keys[i : i + 1, :, :position]), mx.contiguous(c.values[i : i + 1, :, :position]))
          for j, c in enumerate(cache) if isinstance(c, RaggedKV)}
    gdn = row_states(cache, i)
    mark = Mark(position, gdn)
    if draft is None:
        return _with_head(mark, kv, None)
    mark.recent = tuple(draft.history.recent[:-1])
    whole = draft.mtp_len + len(draft.idle_tokens) == position  # (else no MTP part: it cannot be lined up)
    if mtp_cache is None or draft.last_hidden is None or not whole or position < 2:
        return _with_head(mark, kv, None)
    if len(draft.idle_tokens) > 1:
        hidden = mx.concatenate(draft.idle_hidden, axis=1)
        model.mtp.extend(hidden[:, :-1], model.embed(mx.array([draft.idle_tokens[:-1]])), mtp_cache)
    mark.pending, mark.mtp_len = mx.contiguous(draft.last_hidden), position - 1
    return _with_head(mark, kv, mtp_cache)


def row_from(prefix: Prefix, layers: int) -> list:
    """One batch row's caches at the prefix's end (`sequence_cache`'s, as a row)."""
    return rows_cache(sequence_cache(prefix, layers))


def sequence_cache(prefix: Prefix, layers: int) -> list:
    """A per-sequence path's caches at the prefix's end. Views of the kept arrays: the first write into
    attention grows it into new arrays (a KVCache, or a batch row, exactly full), and GatedDeltaNet
    states are replaced, never written into, so nothing reaches the kept ones."""
    cache: list = []
    for j in range(layers):
        if j in prefix.kv:
            c = KVCache()
            c.keys, c.values = prefix.kv[j]
            c.offset = prefix.length
        else:
            c = ArraysCache(size=2)
            c[0], c[1] = prefix.gdn[j]
        cache.append(c)
    return cache


def check_resumed(prefix: Prefix | None, resumed_at: int) -> None:
    """A resumed sequence (its prompt's tokens from `resumed_at` on were generated) goes on from a prefix
    within its prompt only: its penalties count the generated tokens it is sent, and the prefix's own
    tokens are not kept."""
    if prefix is not None and resumed_at and prefix.length > resumed_at:
        raise StageError(f"a resumed sequence goes on from a kept prefix within its prompt only "
                         f"(the prefix has {prefix.length} tokens, the prompt {resumed_at})")


def resume_draft(draft: DraftState, prefix: Prefix) -> None:
    """A new sequence's head state continued from the prefix: its MTP cache, pending hidden, history."""
    if draft.mtp_cache is not None and prefix.drafts:
        if prefix.mtp is not None:  # (its first write grows it into new arrays: it is exactly full)
            cache = draft.mtp_cache
            cache.keys, cache.values, cache.offset = prefix.mtp[0][:, :, :], prefix.mtp[1][:, :, :], prefix.mtp_len
        draft.mtp_len, draft.pending_hidden = prefix.mtp_len, prefix.pending
    history = draft.history
    history.recent, history.length = list(prefix.recent), prefix.length
