"""Sampling on the device, for rows whose token the host need not draw.

A row without a seed, processors or drafts this round takes a plain sample of its filtered
distribution. Drawn on a GPU, that sample stays lazy like a greedy pick, so the next round can be
queued on it before the host reads it. The filters mean what `acceptance.filtered_probs` means
(temperature, then top_k, top_p and min_p), with ties at a cut kept whole, and in float32: top_p's
running sums then round differently, so over a large flat vocabulary the two may disagree on tokens
of the far tail (a draw's distribution, not a seed's tokens, is what these rows promise). Rows that
draft, or carry a seed, still draw on the host: their acceptance and their keyed noise are defined
there (acceptance.py). On the CPU backend the host draws every row: the device's scalar kernels
and sort take as long or longer, and queuing ahead overlaps little there.
"""

from __future__ import annotations

import mlx.core as mx

from .processors import on_host
from .protocol import SamplingParams


def samples_on_device(params: SamplingParams, drafted: bool) -> bool:
    """Whether a row's token this round is drawn on the device."""
    return not params.greedy and params.seed is None and not drafted and not on_host()


def filtered_logits(logits: mx.array, params: SamplingParams) -> mx.array:
    """A row of logits [V] over temperature, with -inf where top_k, top_p or min_p drop a token."""
    x = logits.astype(mx.float32) / params.temperature
    V = x.shape[-1]
    if 0 < params.top_k < V:
        kth = mx.partition(x, V - params.top_k)[V - params.top_k]
        x = mx.where(x >= kth, x, -mx.inf)
    if params.top_p < 1.0 or params.min_p > 0.0:
        p = mx.softmax(x, axis=-1, precise=True)
        keep = mx.ones(p.shape, mx.bool_)
        if params.top_p < 1.0:  # the most likely tokens while the mass strictly above each is under top_p
            ranked = mx.sort(p)[::-1]
            kept = (mx.cumsum(ranked) - ranked < params.top_p).sum()
            keep = p >= mx.take(ranked, kept - 1)
        if params.min_p > 0.0:
            keep = keep & (p >= params.min_p * p.max())
        x = mx.where(keep, x, -mx.inf)
    return x


def sample(logits: mx.array, params: SamplingParams, key: mx.array) -> mx.array:
    """One token of a row of logits [V], lazy."""
    return mx.random.categorical(filtered_logits(logits, params), key=key).astype(mx.uint32)
