"""The tokens drafts are drawn from: the most frequent part of the vocabulary (FR-Spec, Zhao et al. 2025;
EAGLE-3's draft vocabulary).

A draft step is one MTP layer and the output projection over the whole vocabulary. On Qwen3.5/3.6 the
projection (248k rows) outweighs the layer, several times over on the MoE models, so each draft reads
mostly weights of tokens that almost never come. Drafting over the `size` most frequent tokens reads a
fraction of them. Verification still scores every token, so greedy output is unchanged and sampled
output keeps its distribution (a draft distribution that is zero outside the subset is still a draft
distribution); only drafts of rare tokens are lost.

Which tokens: at first the lowest ids (byte-level BPE ids follow merge order, which follows frequency),
then the tokens this stage sees, prompts and outputs, counted; the subset is ranked again now and then,
less often as the counts settle.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

SIZE_MAX = 32768  # FR-Spec and EAGLE-3 draft over 32k tokens of 128k-152k vocabularies
SIZE_MIN = 2048
RANK_FIRST = 512  # tokens counted before the first ranking by counts
RANK_MAX_GAP = 65536  # the longest wait between rankings (the gap doubles from RANK_FIRST up to this)
CHANGED_MIN = 0.005  # a new ranking replaces the subset when at least this share of it changed


def default_size(vocab: int) -> int:
    """Half the vocabulary, between SIZE_MIN and SIZE_MAX tokens; 0 (the whole vocabulary) when that
    would not leave out a quarter of it."""
    size = min(SIZE_MAX, max(SIZE_MIN, vocab // 2))
    return 0 if size > vocab * 3 // 4 else size


def top_tokens(counts: np.ndarray, size: int) -> np.ndarray:
    """The `size` most counted token ids (ties: lower ids first), ascending."""
    vocab = len(counts)
    score = counts.astype(np.int64) * vocab + (vocab - 1 - np.arange(vocab, dtype=np.int64))
    return np.sort(np.argpartition(-score, size - 1)[:size]).astype(np.int32)


class DraftVocab:
    """Output-projection rows for drafting, and the map from their index to token ids. With `size` 0
    (or not smaller than the vocabulary) drafts score every token through the model's own projection."""

    def __init__(self, model: Any, size: int):
        self.model = model
        self.projection = model.embed_tokens if model.config.args.tie_word_embeddings else model.lm_head
        self.vocab = int(self.projection["weight"].shape[0])
        self.size = size if 0 < size < self.vocab else 0
        self.counts = np.zeros(self.vocab, dtype=np.int64)
        self.counted = 0
        self.next_rank = RANK_FIRST
        self.rankings = 0  # rankings that replaced the subset
        self.ids: mx.array | None = None
        self._ids_host = np.arange(0, dtype=np.int32)
        self.rows: dict[str, mx.array] = {}
        if self.size:
            self._use(np.arange(self.size, dtype=np.int32))

    @property
    def whole(self) -> bool:
        return not self.size

    def logits(self, g: mx.array) -> mx.array:
        """Draft logits [..., size] (or [..., vocab] over the whole vocabulary)."""
        if self.whole:
            return self.model.lm_logits(g)
        p, rows = self.projection, self.rows
        if "scales" in rows:
            out = mx.quantized_matmul(g, rows["weight"], scales=rows["scales"], biases=rows.get("biases"),
                                      transpose=True, group_size=p.group_size, bits=p.bits,
                                      mode=getattr(p, "mode", "affine"))
        else:
            out = g @ rows["weight"].T
        return out + rows["bias"] if "bias" in rows else out

    def tokens(self, index: mx.array) -> mx.array:
        """Token ids of indices into `logits`' last axis (lazy)."""
        return index if self.whole else self.ids[index]

    def narrow(self, row: mx.array) -> mx.array:
        """A [..., vocab] row (a logit bias) restricted to the draft tokens."""
        return row if self.whole else mx.take(row, self.ids, axis=-1)

    def widen(self, logits: mx.array) -> mx.array:
        """Draft logits over the whole vocabulary: -inf for tokens outside the subset (sampled drafts)."""
        if self.whole:
            return logits
        full = mx.full((*logits.shape[:-1], self.vocab), -mx.inf, dtype=logits.dtype)
        full[..., self.ids] = logits
        return full

    def widen_probs(self, p: np.ndarray) -> np.ndarray:
        """Probabilities over the draft tokens [..., size] as rows over the whole vocabulary (0 for
        tokens outside the subset), in float64, summing to 1."""
        p = p.astype(np.float64)
        if not self.whole:
            full = np.zeros((*p.shape[:-1], self.vocab))
            full[..., self._ids_host] = p
            p = full
        return p / p.sum(axis=-1, keepdims=True)

    def observe(self, tokens: list[int]) -> None:
        """Tokens this stage saw (a prompt's, a round's output); the subset is ranked again when due."""
        if self.whole or not tokens:
            return
        np.add.at(self.counts, np.asarray(tokens, dtype=np.int64), 1)
        self.counted += len(tokens)
        if self.counted >= self.next_rank:
            self.next_rank = min(2 * self.counted, self.counted + RANK_MAX_GAP)
            self.rank()

    def rank(self) -> bool:
        """Rank the tokens by their counts; the subset is replaced if enough of it changed."""
        new = top_tokens(self.counts, self.size)
        changed = self.size - int(np.isin(new, self._ids_host, assume_unique=True).sum())
        if changed < max(1, CHANGED_MIN * self.size):
            return False
        self._use(new)
        self.rankings += 1
        log.debug("draft vocabulary ranked again: %d of %d tokens changed", changed, self.size)
        return True

    def _use(self, ids: np.ndarray) -> None:
        self._ids_host = ids
        self.ids = mx.array(ids)
        rows = {name: self.projection[name] for name in ("weight", "scales", "biases", "bias")
                if name in self.projection}
        self.rows = {name: mx.contiguous(a[self.ids]) for name, a in rows.items()}  # all per token
        mx.eval(self.ids, list(self.rows.values()))

    @property
    def row_bytes(self) -> int:
        """Bytes of the projection rows copied for drafting (placement counts them on the last stage)."""
        return sum(a.nbytes for a in self.rows.values())

    def describe(self) -> dict[str, int]:
        return {"size": self.size or self.vocab, "vocab": self.vocab, "rankings": self.rankings}
