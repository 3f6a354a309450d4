"""Token selection and speculative acceptance (Leviathan et al. 2023; Chen et al. 2023).

Target p and draft q are built with the same temperature and filters, in float32. Greedy accepts a
draft iff it is the target argmax; sampling accepts d with probability min(1, p(d)/q(d)) and on the
first rejection draws from max(p - q, 0) / Z, so the output distribution equals plain sampling.

A seeded request draws instead by the Gumbel-max trick with noise keyed by (seed, position, token):
a position's token is argmax(log p + g), its draft argmax(log q + g) with the same noise, and a draft
is accepted iff the target picks it (on the first rejection the target's pick is emitted). Each token
is still a plain sample of p, and which token it is depends only on the seed, the position and the
context, never on the drafts: the same seed gives the same tokens at every MTP depth, alone or in a
batch, over one machine or many, and after a request resumes. This coupling accepts a little less
often than min(1, p/q), at least (1 - TV) / (1 + TV) where the rule above accepts 1 - TV.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .protocol import SamplingParams

MASK64 = (1 << 64) - 1
TOP_P_CANDIDATES = 256  # the most likely tokens top_p sorts first


def filtered_probs(logits: mx.array, params: SamplingParams) -> np.ndarray:
    """Rows of logits [..., V] -> float64 probabilities after temperature, top_k, top_p, min_p."""
    x = np.asarray(logits.astype(mx.float32), dtype=np.float64) / params.temperature
    x = x - x.max(axis=-1, keepdims=True)
    p = np.exp(x)
    p /= p.sum(axis=-1, keepdims=True)
    V = p.shape[-1]
    if 0 < params.top_k < V:
        kth = np.partition(p, V - params.top_k, axis=-1)[..., V - params.top_k : V - params.top_k + 1]
        p = np.where(p >= kth, p, 0.0)
    if params.top_p < 1.0:
        p = np.stack([top_p_row(row, params.top_p) for row in p.reshape(-1, V)]).reshape(p.shape)
    if params.min_p > 0.0:
        p = np.where(p >= params.min_p * p.max(axis=-1, keepdims=True), p, 0.0)
    return p / p.sum(axis=-1, keepdims=True)


def top_p_row(p: np.ndarray, top_p: float) -> np.ndarray:
    """A probability row [V] keeping the most likely tokens, in order (ties by index), while the mass
    strictly above each is under top_p of the row's. Sorting all V tokens would take longer than a
    decode step at a real vocabulary: only the m most likely are sorted, m growing until their mass
    reaches the limit (or the whole row, for a flat one). The tokens past them then have at least that
    mass above, so none is kept; the ones sorted get the same cumulative sums as in a sort of the
    whole row."""
    limit = top_p * p.sum()
    support = np.flatnonzero(p)  # (tokens filtered out before are 0 and stay 0)
    n, m = len(support), TOP_P_CANDIDATES
    while True:
        candidates = support if m >= n else support[p[support] >= np.partition(p[support], n - m)[n - m]]
        order = candidates[np.argsort(-p[candidates], kind="stable")]
        sorted_p = p[order]
        mass = np.cumsum(sorted_p)
        if m >= n or mass[-1] >= limit:
            break
        m = m * 8 if m * 8 <= n // 8 else n  # (a flat row keeps most of it: one sort of all beats more rounds)
    keep = order[mass - sorted_p < limit]  # the mass strictly above each token
    out = np.zeros_like(p)
    out[keep] = p[keep]
    return out


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a probability row, by inverse CDF (exact, reproducible with the rng)."""
    cdf = np.cumsum(p)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(p) - 1))


def kept_of_round(tokens: list[int], left: int | None, stops: frozenset[int]) -> int:
    """How many of a round's tokens a sequence keeps: through its first stop token, and at most the
    `left` it may still emit (None: not known). The rest were accepted past its end: cutting them there
    leaves its state where its output ends (a state kept at a request's end, prefixes.py)."""
    n = len(tokens) if left is None else max(1, min(len(tokens), left))
    for j, t in enumerate(tokens[:n]):
        if t in stops:
            return j + 1
    return n


def accept_greedy(target_argmax: list[int], drafts: list[int]) -> tuple[int, list[int]]:
    """target_argmax: argmax of p0..pK. Returns (accepted count, emitted tokens)."""
    n = 0
    while n < len(drafts) and drafts[n] == target_argmax[n]:
        n += 1
    return n, drafts[:n] + [target_argmax[n]]


def accept_sampled(
    p: np.ndarray, q: np.ndarray, drafts: list[int], rng: np.random.Generator
) -> tuple[int, list[int]]:
    """p: [K+1, V] target probs, q: [K, V] draft probs the drafts were drawn from."""
    for i, d in enumerate(drafts):
        if rng.random() * q[i, d] < p[i, d]:  # accept with probability min(1, p/q)
            continue
        residual = np.maximum(p[i] - q[i], 0.0)
        z = residual.sum()
        return i, drafts[:i] + [draw(residual / z if z > 0 else p[i], rng)]
    return len(drafts), drafts + [draw(p[len(drafts)], rng)]


def gumbel_pick(p: np.ndarray, seed: int, position: int) -> int:
    """The token of a probability row at `position` of a seeded sequence: argmax over its support of
    log p + Gumbel noise that depends only on (seed, position, token)."""
    support = np.flatnonzero(p)
    return int(support[np.argmax(np.log(p[support]) + _gumbel(seed, position, support))])


def accept_coupled(p: np.ndarray, drafts: list[int], seed: int, position: int) -> tuple[int, list[int]]:
    """p: [K+1, V] target probs at positions position..position+K; the drafts were picked from their
    own rows with gumbel_pick at the same positions."""
    for i, d in enumerate(drafts):
        token = gumbel_pick(p[i], seed, position + i)
        if token != d:
            return i, drafts[:i] + [token]
    return len(drafts), drafts + [gumbel_pick(p[len(drafts)], seed, position + len(drafts))]


def _mix(z: int) -> int:
    """SplitMix64's finalizer on a Python int."""
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def _gumbel(seed: int, position: int, tokens: np.ndarray) -> np.ndarray:
    """Standard Gumbel noise for `tokens`, the same for the same (seed, position, token) everywhere."""
    z = tokens.astype(np.uint64) ^ np.uint64(_mix(_mix(seed) ^ position))
    z = z + np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's finalizer, vectorized (uint64 arithmetic wraps)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    u = ((z >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53  # in (0, 1)
    return -np.log(-np.log(u))
