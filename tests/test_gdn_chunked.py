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


@pytest.mark.parametrize(("B", "T", "Hk", "Hv", "masked", "decays"), [
    (1, 1, 2, 2, False, "weak"),  # one position
    (1, CHUNK, 2, 4, False, "weak"),  # exactly one chunk, key heads repeated
    (2, 2 * CHUNK + 37, 2, 2, False, "strong"),  # several chunks, the last padded; decays near 0
    (1, 2 * CHUNK, 1, 1, False, "strong_then_weak"),  # small decays after large ones in a chunk
    (3, CHUNK + 5, 1, 2, True, "weak"),  # padding of shorter rows masked out
    (3, 40, 1, 1, True, "weak"),  # the last row masked out whole: its state passes unchanged
])
def test_chunked_equals_stepped(B: int, T: int, Hk: int, Hv: int, masked: bool, decays: str) -> None:
    mx.random.seed(T)
    Dk, Dv = 16, 8
    q, k = normalize_qk(mx.random.normal((B, T, Hk, Dk)), mx.random.normal((B, T, Hk, Dk)), inv_scale=Dk**-0.5,
                        eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv))
    log_g = -mx.random.uniform(0, 30 if decays == "strong" else 1, (B, T, Hv))
    if decays == "strong_then_weak":  # the first positions of each chunk decay hard, the rest barely
        log_g = mx.where((mx.arange(T) % CHUNK < 4)[None, :, None], -50.0, -0.01 * mx.ones_like(log_g))
    beta = mx.random.uniform(0, 1, (B, T, Hv))
    state = 0.5 * mx.random.normal((B, Hv, Dv, Dk))
    mask = None
    if masked:  # row i has T - 20 i real positions (none in the last of three 40-position rows), then padding
        mask = mx.arange(T)[None, :] < mx.array([T - 20 * i for i in range(B)])[:, None]
    y, s = gated_delta_ops(q, k, v, mx.exp(log_g), beta, state, mask)
    if mask is not None:  # (the chunked rule takes masked positions as b = 0, g = 1)
        beta, log_g = mx.where(mask[..., None], beta, 0), mx.where(mask[..., None], log_g, 0)
    got_y, got_s = chunked_delta_rule(q, k, v, log_g, beta, state)
    assert got_y.dtype == got_s.dtype == mx.float32
    if masked and T == 40:
        assert mx.array_equal(got_s[-1], state[-1]).item()
    keep = mx.ones((B, T), dtype=mx.bool_) if mask is None else mask
    assert mx.abs(mx.where(keep[..., None, None], got_y - y, 0)).max().item() <= TOL
    assert max_diff(got_s, s) <= TOL


@pytest.mark.parametrize(("ragged", "dtype"), [(False, mx.float32), (True, mx.float32), (True, mx.bfloat16)])
def test_prefill_layer_equals_mlx_lm_layer(dense_ckpt: Path, ragged: bool, dtype: mx.Dtype) -> None:
    """A whole layer over a prompt: the output (in the model's dtype), the conv window each row ends
    on and the state."""
    layer = next(layer for layer in load_shard(dense_ckpt, dtype=dtype).model.layers if layer.is_linear)
    mx.random.seed(1)
    h = mx.random.normal((2, 90, layer.linear_attn.hidden_size)).astype(dtype)
    tol = TOL if dtype == mx.float32 else 2e-2  # (one bfloat16 rounding of outputs near 1)
    lengths = [90, 61] if ragged else [90, 90]
    mask = mx.arange(90)[None, :] < mx.array(lengths)[:, None] if ragged else None
    caches = []
    for _ in range(2):
        c = ArraysCache(size=2)
        c.lengths = mx.array(lengths) if ragged else None
        caches.append(c)
    want = layer(h, mask=mask, cache=caches[0])
    got = prefill_layer(layer, h, caches[1], mask)
    assert got.dtype == want.dtype == dtype and caches[1][0].dtype == caches[0][0].dtype == dtype
    for row, n in enumerate(lengths):
        assert max_diff(got[row, :n].astype(mx.float32), want[row, :n].astype(mx.float32)) <= tol
    assert mx.array_equal(caches[1][0], caches[0][0]).item()
    assert max_diff(caches[1][1], caches[0][1]) <= TOL
