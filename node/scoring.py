"""A prompt's own tokens scored: each one's log-probability given the tokens before it (prompt logprobs).

What lm-eval's loglikelihood and perplexity read, through OpenAI's `echo` with `logprobs` and vLLM's
`prompt_logprobs`. The last stage reads every position of a prompt chunk through the LM head: position
i's distribution scores token i + 1, and a chunk's last position waits for the next chunk's first token
(`Pending`). The distribution is the model's own, before temperature, penalties or a grammar, as vLLM
reports it. Logits are made a slice of positions at a time, so a long chunk over a large vocabulary
never holds [positions, vocabulary] at once.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from .processors import on_host
from .protocol import Scored

SLICE_FLOATS = 1 << 24  # logits made at once: a slice of positions takes this many floats at most


class PromptScores:
    """A sequence's prompt scored chunk by chunk on the last stage."""

    def __init__(self, top: int):
        self.top = top  # alternatives reported per position
        self.pending: mx.array | None = None  # the last position fed, which scores the next chunk's first token

    def read(self, model: object, normed: mx.array, tokens: list[int], final: bool) -> list[Scored]:
        """The chunk's `tokens` scored, each by the position before it (`normed` [1, T, H], final-normed
        hidden states; the first by the chunk before's last, or at the prompt's start by nothing)."""
        rows = normed[:, :-1]
        if self.pending is not None:
            rows = mx.concatenate([self.pending, rows], axis=1)
        else:
            tokens = tokens[1:]
        self.pending = None if final else normed[:, -1:]
        out: list[Scored] = []
        step = max(1, SLICE_FLOATS // model.config.args.vocab_size)
        for i in range(0, len(tokens), step):
            out += _scored(model.lm_logits(rows[:, i : i + step])[0], tokens[i : i + step], self.top)
        return out


def _scored(logits: mx.array, tokens: list[int], top: int) -> list[Scored]:
    """Positions' logits [T, V] against the token that came after each: normalized on the host where MLX
    computes on the CPU anyway (numpy's `exp` is vectorized where the CPU backend's is not), else on the
    device, only the results read back."""
    logits = logits.astype(mx.float32)
    top = min(top, logits.shape[-1])
    lps, ranks, ids, vals = (_on_host(np.asarray(logits), tokens, top) if on_host()
                             else _on_device(logits, tokens, top))
    best: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if ids is not None:
        best = [sorted(zip(i, v), key=lambda p: (-p[1], p[0])) for i, v in zip(ids, vals)]
    return [Scored(lp, rk, b) for lp, rk, b in zip(lps, ranks, best)]


Columns = tuple[list[float], list[int], Optional[list[list[int]]], Optional[list[list[float]]]]


def _on_host(a: np.ndarray, tokens: list[int], top: int) -> Columns:
    """(log-probabilities, ranks, the `top` most likely tokens and theirs) of logits `a` [T, V]."""
    peak = a.max(axis=-1, keepdims=True)
    norm = peak + np.log(np.exp(a - peak).sum(axis=-1, keepdims=True))
    picked = a[np.arange(len(tokens)), tokens][:, None]
    ranks = 1 + (a > picked).sum(axis=-1)
    ids = vals = None
    if top == 1:  # (lm-eval's one alternative: an argmax, far cheaper than a partition)
        ids, vals = a.argmax(axis=-1)[:, None], peak - norm
    elif top > 1:
        ids = np.argpartition(-a, top - 1, axis=-1)[:, :top]
        vals = np.take_along_axis(a, ids, axis=-1) - norm
    return ((picked - norm)[:, 0].tolist(), ranks.tolist(), None if ids is None else ids.tolist(),
            None if vals is None else vals.tolist())


def _on_device(logits: mx.array, tokens: list[int], top: int) -> Columns:
    norm = mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(logits, mx.array(tokens)[:, None], axis=-1)  # [T, 1]
    arrays = [picked[:, 0] - norm[:, 0], 1 + (logits > picked).sum(axis=-1)]
    if top == 1:
        arrays += [mx.argmax(logits, axis=-1)[:, None], mx.max(logits, axis=-1, keepdims=True) - norm]
    elif top > 1:
        ids = mx.argpartition(-logits, top - 1, axis=-1)[:, :top]
        arrays += [ids, mx.take_along_axis(logits, ids, axis=-1) - norm]
    mx.eval(*arrays)
    out = [a.tolist() for a in arrays]
    return out[0], out[1], out[2] if top > 0 else None, out[3] if top > 0 else None
