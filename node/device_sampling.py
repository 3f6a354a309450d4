"""Sampling on the device, for tokens and drafts the host need not draw.

Drafts of a sampled row without a seed are drawn on the device, on every backend: they stay lazy like
greedy drafts, so the next verify is queued on them before the host reads them (and a GPU is not made
to wait for the host at every draft step). Their acceptance needs only the probabilities each was
drawn from (acceptance.py), whatever those are, so their top_p looks at the most likely tokens only.

A row without a seed, processors or drafts this round takes a plain sample of its filtered
distribution, on a GPU: that sample stays lazy like a greedy pick, so the next round can be queued on
it before the host reads it. The filters mean what `acceptance.filtered_probs` means (temperature,
then top_k, top_p and min_p), with ties at a cut kept whole, and in float32: top_p's running sums then
round differently, so over a large flat vocabulary the two may disagree on tokens of the far tail (a
draw's distribution, not a seed's tokens, is what these rows promise). On the CPU backend the host
draws these tokens: the device's scalar kernels and its sort of a whole row take as long or longer.
Rows with a seed draw tokens and drafts on the host, with its keyed noise (acceptance.py).
"""

from __future__ import annotations

import mlx.core as mx

from .acceptance import TOP_P_CANDIDATES
from .processors import on_host
from .protocol import SamplingParams

DRAFT_SPAN = 15.0  # nats below a row's most likely token that a draft may lie (`draw_drafts`)


def samples_on_device(params: SamplingParams, drafted: bool) -> bool:
    """Whether a row's token this round is drawn on the device."""
    return not params.greedy and params.seed is None and not drafted and not on_host()


def drafts_on_device(params: SamplingParams) -> bool:
    """Whether a row's drafts are drawn on the device: sampled without a seed (a seed's drafts take the
    host's keyed noise). The draws stay lazy like greedy drafts, so the next verify is queued on them."""
    return not params.greedy and params.seed is None


def filtered_logits(logits: mx.array, params: SamplingParams, candidates: int = 0) -> mx.array:
    """Rows of logits [..., V] over temperature, with -inf where top_k, top_p or min_p drop a token.
    With `candidates`, top_p looks only at that many most likely tokens of a row, and keeps them all
    when their mass falls short of it (a sort of the whole row is slow on the CPU backend)."""
    x = logits.astype(mx.float32) / params.temperature
    V = x.shape[-1]
    if 0 < params.top_k < V:
        kth = mx.partition(x, V - params.top_k, axis=-1)[..., V - params.top_k, None]
        x = mx.where(x >= kth, x, -mx.inf)
    if params.top_p < 1.0 or params.min_p > 0.0:
        p = mx.softmax(x, axis=-1, precise=True)
        keep = mx.ones(p.shape, mx.bool_)
        if params.top_p < 1.0:  # the most likely tokens while the mass strictly above each is under top_p
            ranked = mx.sort(mx.topk(p, candidates, axis=-1) if 0 < candidates < V else p, axis=-1)[..., ::-1]
            kept = (mx.cumsum(ranked, axis=-1) - ranked < params.top_p).sum(axis=-1, keepdims=True)
            keep = p >= mx.take_along_axis(ranked, kept - 1, axis=-1)
        if params.min_p > 0.0:
            keep = keep & (p >= params.min_p * p.max(axis=-1, keepdims=True))
        x = mx.where(keep, x, -mx.inf)
    return x


def draw_drafts(logits: mx.array, params: SamplingParams, key: mx.array) -> tuple[mx.array, mx.array]:
    """A draft from each row of draft logits [n, S], lazy: their indices [n], and the probabilities
    [n, S] they were drawn from, which their acceptance compares the target's with. Any such
    distribution keeps the output exact (acceptance.py), so top_p here looks only at the most likely
    tokens, and tokens more than DRAFT_SPAN below a row's most likely are dropped: `categorical` draws
    with float32 Gumbel noise, whose range (about 20) keeps tokens far below the top from being drawn
    at their rate, or at all."""
    x = filtered_logits(logits, params, TOP_P_CANDIDATES)
    x = mx.where(x >= x.max(axis=-1, keepdims=True) - DRAFT_SPAN, x, -mx.inf)
    return mx.random.categorical(x, key=key), mx.softmax(x, axis=-1, precise=True)


def sample(logits: mx.array, params: SamplingParams, key: mx.array) -> mx.array:
    """One token of a row of logits [V], lazy."""
    return mx.random.categorical(filtered_logits(logits, params), key=key).astype(mx.uint32)
