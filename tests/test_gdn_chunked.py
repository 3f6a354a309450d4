"""The chunked GatedDeltaNet recurrence (prefill on the CPU) against mlx-lm's stepped one."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import gated_delta_ops, normalize_qk

from mtpipe.models.gdn_chunked import CHUNK, chunked_delta_rule, prefill_layer
from mtpipe.models.loading import load_shard

TOL = 1e-5


def max_diff(a: mx.array, b: mx.array) -> float:
    assert a.shape == b.shape
    return mx.abs(a - b).max().item()


@pytest.mark.parametrize(("B", "T", "Hk", "Hv", "masked", "strong"), [
    (1, 1, 2, 2, False, False),  # one position
    (1, CHUNK, 2, 4, False, False),  # exactly one chunk, key heads repeated
    (2, 2 * CHUNK + 37, 2, 2, False, True),  # several chunks, the last padded; decays near 0
    (3, CHUNK + 5, 1, 2, True, False),  # padding of shorter rows masked out
])
def test_chunked_equals_stepped(B: int, T: int, Hk: int, Hv: int, masked: bool, strong: bool) -> None:
    mx.random.seed(T)
    Dk, Dv = 16, 8
    q, k = normalize_qk(mx.random.normal((B, T, Hk, Dk)), mx.random.normal((B, T, Hk, Dk)), inv_scale=Dk**-0.5,
                        eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv))
    log_g = -mx.random.uniform(0, 30 if strong else 1, (B, T, Hv))
    beta = mx.random.uniform(0, 1, (B, T, Hv))
    state = 0.5 * mx.random.normal((B, Hv, Dv, Dk))
    mask = None
    if masked:  # row i has T - 20 i real positions, then padding
        mask = mx.arange(T)[None, :] < mx.array([T - 20 * i for i in range(B)])[:, None]
    y, s = gated_delta_ops(q, k, v, mx.exp(log_g), beta, state, mask)
    if mask is not None:  # (the chunked rule takes masked positions as b = 0, g = 1)
        beta, log_g = mx.where(mask[..., None], beta, 0), mx.where(mask[..., None], log_g, 0)
    got_y, got_s = chunked_delta_rule(q, k, v, log_g, beta, state)
    assert got_y.dtype == got_s.dtype == mx.float32
    keep = mx.ones((B, T), dtype=mx.bool_) if mask is None else mask
    assert mx.abs(mx.where(keep[..., None, None], got_y - y, 0)).max().item() <= TOL
    assert max_diff(got_s, s) <= TOL


@pytest.mark.parametrize("ragged", [False, True])
def test_prefill_layer_equals_mlx_lm_layer(dense_ckpt: Path, ragged: bool) -> None:
    """A whole layer over a prompt: the output, the conv window each row ends on and the state."""
    layer = next(layer for layer in load_shard(dense_ckpt, dtype=mx.float32).model.layers if layer.is_linear)
    mx.random.seed(1)
    h = mx.random.normal((2, 90, layer.linear_attn.hidden_size))
    lengths = [90, 61] if ragged else [90, 90]
    mask = mx.arange(90)[None, :] < mx.array(lengths)[:, None] if ragged else None
    caches = []
    for _ in range(2):
        c = ArraysCache(size=2)
        c.lengths = mx.array(lengths) if ragged else None
        caches.append(c)
    want = layer(h, mask=mask, cache=caches[0])
    got = prefill_layer(layer, h, caches[1], mask)
    for row, n in enumerate(lengths):
        assert max_diff(got[row, :n], want[row, :n]) <= TOL
    assert mx.array_equal(caches[1][0], caches[0][0]).item()
    assert max_diff(caches[1][1], caches[0][1]) <= TOL
