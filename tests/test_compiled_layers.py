"""Compiled GatedDeltaNet layers compute exactly what the uncompiled layers compute, and decode uses them."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache

from mtpipe.models.gdn_snapshots import COMPILED_MAX_TOKENS, CompiledLayers, gdn_layer
from mtpipe.models.loading import load_shard


def run(layer, h, conv, state, compiled):
    cache = ArraysCache(size=2)
    cache[0], cache[1] = conv, state
    out, snaps = gdn_layer(layer, h, cache, compiled)
    return [out, snaps.conv_input, *snaps.states, cache[0], cache[1]]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows,tokens", [(1, 1), (1, 4), (3, 2), (3, 4)])
def test_compiled_layer_is_bit_identical(ckpt: Path, rows: int, tokens: int, dtype: mx.Dtype) -> None:
    shard = load_shard(ckpt, dtype=dtype).model
    if dtype != mx.float32 and shard.config.is_moe and mx.default_device() == mx.cpu:
        pytest.skip("MLX's gather_mm runs float32 only on the CPU (MoE layers, compiled or not)")
    layers = [layer for layer in shard.layers if layer.is_linear]
    gdn = layers[0].linear_attn
    key = mx.random.key(rows * 10 + tokens)
    k1, k2, k3 = mx.random.split(key, 3)
    h = mx.random.normal((rows, tokens, shard.config.args.hidden_size), key=k1).astype(dtype)
    conv = mx.random.normal((rows, gdn.conv_kernel_size - 1, gdn.conv_dim), key=k2).astype(dtype)
    state = 0.1 * mx.random.normal((rows, gdn.num_v_heads, gdn.head_v_dim, gdn.head_k_dim), key=k3)
    compiled = CompiledLayers()
    for layer in layers:
        for start in ((conv, state), (None, None)):  # a running sequence, and a first input
            want = run(layer, h, *start, None)
            got = run(layer, h, *start, compiled)
            mx.eval(want, got)
            assert len(got) == len(want)
            for a, b in zip(got, want):
                assert a.shape == b.shape and a.dtype == b.dtype
                assert mx.array_equal(a, b).item()
    assert compiled.applies(h) == (mx.default_device() == mx.cpu)
    assert not compiled.applies(mx.zeros((1, COMPILED_MAX_TOKENS + 1, 4)))


def test_decode_runs_the_shards_compiled_layers(dense_engine) -> None:
    """A decode and a verify go through the shard's compiled layers (one per GatedDeltaNet layer)."""
    if mx.default_device() != mx.cpu:
        pytest.skip("layers are compiled on the CPU only")
    shard = dense_engine.pipeline.stages[-1].model
    cache = shard.make_cache()
    mx.eval(shard.run_layers(shard.embed(mx.array([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])), cache)[0])
    shard.compiled = CompiledLayers()
    try:
        shard.run_layers(shard.embed(mx.array([[11]])), cache)
        shard.run_layers(shard.embed(mx.array([[12, 13, 14]])), cache, capture=True)
        assert len(shard.compiled._fns) == sum(layer.is_linear for layer in shard.layers)
    finally:
        shard.compiled = CompiledLayers()
