"""Compiled GatedDeltaNet layers, and attention layers compiled around their caches, compute exactly what
mlx-lm's layers compute; decode and verify use them, and a failed trace costs the layer nothing."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import ArraysCache, KVCache

from mtpipe.models import blas
from mtpipe.models.attention import attention_layer, cache_update
from mtpipe.models.gdn_snapshots import COMPILED_MAX_TOKENS, CompiledLayers, gdn_layer
from mtpipe.models.loading import load_shard
from mtpipe.models.ragged import RaggedKV, ragged_layer


def run(layer, h, conv, state, compiled):
    cache = ArraysCache(size=2)
    cache[0], cache[1] = conv, state
    out, snaps = gdn_layer(layer, h, cache, compiled)
    return [out, snaps.conv_input, *snaps.states, cache[0], cache[1]]


cpu_only = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="layers are compiled on the CPU only")


@cpu_only
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows,tokens", [(1, 1), (1, 4), (3, 2), (3, 4)])
def test_compiled_layer_is_bit_identical(ckpt: Path, rows: int, tokens: int, dtype: mx.Dtype) -> None:
    if dtype != mx.float32 and ckpt.name.startswith("moe"):  # (refused as it loads: test_loader.py)
        pytest.skip("MLX's gather_mm runs float32 only on the CPU (MoE layers, compiled or not)")
    shard = load_shard(ckpt, dtype=dtype).model
    layers = [layer for layer in shard.layers if layer.is_linear]
    gdn = layers[0].linear_attn
    key = mx.random.key(rows * 10 + tokens)
    k1, k2, k3 = mx.random.split(key, 3)
    h = mx.random.normal((rows, tokens, shard.config.args.hidden_size), key=k1).astype(dtype)
    conv = mx.random.normal((rows, gdn.conv_kernel_size - 1, gdn.conv_dim), key=k2).astype(dtype)
    state = 0.1 * mx.random.normal((rows, gdn.num_v_heads, gdn.head_v_dim, gdn.head_k_dim), key=k3)
    compiled = CompiledLayers()
    assert compiled.applies(h)
    for layer in layers:
        for start in ((conv, state), (None, None)):  # a running sequence, and a first input
            want = run(layer, h, *start, None)
            got = run(layer, h, *start, compiled)
            mx.eval(want, got)
            assert len(got) == len(want)
            for a, b in zip(got, want):
                assert a.shape == b.shape and a.dtype == b.dtype
                assert mx.array_equal(a, b).item()
    assert len(compiled._fns) == len(layers)


def kept(cache: KVCache) -> tuple[mx.array, mx.array]:
    """A single-sequence cache's keys and values up to its offset."""
    return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]


@cpu_only
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 2, 4])
def test_compiled_attention_layer_is_mlx_lms_layer_bit_for_bit(ckpt: Path, tokens: int, dtype: mx.Dtype) -> None:
    """One sequence through mlx-lm's cache (after a prompt), and rows through a RaggedKV, at their own
    lengths or level: compiled around the cache or not, the layer's output and cache are what mlx-lm's
    layer computes (each row alone, for the rows: see row_matches)."""
    if dtype != mx.float32 and ckpt.name.startswith("moe"):  # (refused as it loads: test_loader.py)
        pytest.skip("MLX's gather_mm runs float32 only on the CPU (MoE layers, compiled or not)")
    shard = load_shard(ckpt, dtype=dtype).model
    layers = [layer for layer in shard.layers if not layer.is_linear] + [shard.mtp.layers[0]]
    hidden = shard.config.args.hidden_size
    k1, k2 = mx.random.split(mx.random.key(tokens), 2)
    x = mx.random.normal((3, tokens, hidden), key=k2).astype(dtype)
    compiled = CompiledLayers()
    assert compiled.applies(x)
    for lengths in ((9, 5, 13), (9, 9, 9)):
        prompts = [mx.random.normal((1, n, hidden), key=k).astype(dtype) for n, k in zip(lengths, mx.random.split(k1, 3))]
        for layer in layers:
            want, caches = [], []
            for i, prompt in enumerate(prompts):  # mlx-lm's layer, each row alone
                cache = prompted(layer, prompt)
                want.append(layer(x[i : i + 1], mask=create_attention_mask(x[i : i + 1], cache), cache=cache))
                caches.append(kept(cache))
            for parts in (None, compiled):
                for i, prompt in enumerate(prompts):
                    cache = prompted(layer, prompt)
                    mask = create_attention_mask(x[i : i + 1], cache)
                    got = attention_layer(layer, x[i : i + 1], cache.offset, cache_update(cache, mask), parts)
                    assert mx.array_equal(got, want[i]).item()
                    assert all(mx.array_equal(a, b).item() for a, b in zip(kept(cache), caches[i]))
                rows = ragged_rows(layer, prompts)
                got, _ = ragged_layer(layer, x, rows, [tokens] * 3, parts)
                for i in range(3):
                    keys, values = rows.row(i)
                    for a, b in ((got[i : i + 1], want[i]), (keys, caches[i][0]), (values, caches[i][1])):
                        assert row_matches(a, b), mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
    assert len(compiled._fns) == 2 * len(layers)
    # one trace per part and input shape, whatever the positions: rows level or not, and one sequence
    assert len(compiled._traced) == 2 * len(layers) * 2


@cpu_only
@pytest.mark.parametrize("tokens", [1, 3])
def test_compiled_attention_with_a_window_computes_the_same(dense_ckpt: Path, tokens: int) -> None:
    """The MTP head drafting over a window (one sequence, and rows, some adding fewer tokens than the
    widest): compiled around the cache or not, the same outputs and caches."""
    shard = load_shard(dense_ckpt, dtype=mx.float32).model
    mtp = shard.mtp
    hidden = shard.config.args.hidden_size
    keys = mx.random.split(mx.random.key(7 + tokens), 6)
    prompts = [mx.random.normal((1, n, hidden), key=k) for n, k in zip((9, 5, 13), keys[:3])]
    h, e = (mx.random.normal((3, tokens, hidden), key=k) for k in keys[3:5])
    real = [tokens, 1, tokens]
    results = []
    for parts in (None, CompiledLayers()):
        mtp.compiled = parts  # (None: the uncompiled path)
        got = []
        for i, prompt in enumerate(prompts):
            cache = prompted(mtp.layers[0], prompt)
            got += [mtp(h[i : i + 1], e[i : i + 1], cache, window=4), *kept(cache)]
        rows = ragged_rows(mtp.layers[0], prompts)
        got += [mtp.rows(h, e, rows, real, window=4), rows.keys, rows.values]
        mx.eval(got)
        results.append(got)
    mtp.compiled = CompiledLayers()
    assert len(results[0]) == len(results[1]) == 12
    assert all(mx.array_equal(a, b).item() for a, b in zip(*results))


def row_matches(got: mx.array, alone: mx.array) -> bool:
    """A row of a batch against the row run alone: bit for bit where each row's products are summed alone
    (the reference BLAS); an optimized BLAS blocks a product by the rows of the whole batch, which moves
    the low bits (by a few ulps: an ulp is 1.2e-7 of the value)."""
    if mx.array_equal(got, alone).item():
        return True
    return blas.info().optimized and got.dtype == mx.float32 and mx.allclose(got, alone, rtol=4e-6, atol=1e-6).item()


def prompted(layer, prompt: mx.array) -> KVCache:
    """mlx-lm's cache after the layer took `prompt`."""
    cache = KVCache()
    layer(prompt, mask="causal", cache=cache)
    return cache


def ragged_rows(layer, prompts: list[mx.array]) -> RaggedKV:
    """One row per prompt, each with the entries mlx-lm's layer cached for it."""
    rows = [RaggedKV.from_cache(prompted(layer, p)) for p in prompts]
    return RaggedKV.concat(rows)


@cpu_only
def test_decode_and_verify_run_compiled_and_prefill_does_not(dense_engine) -> None:
    shard = dense_engine.pipeline.stages[-1].model
    parts = sum(1 if layer.is_linear else 2 for layer in shard.layers)  # (an attention layer: two parts)
    cache = shard.make_cache()
    try:
        for tokens, capture, traced in (([1] * (COMPILED_MAX_TOKENS + 2), False, 0), ([11], False, parts),
                                        ([12, 13, 14], True, parts)):
            shard.compiled = CompiledLayers()
            mx.eval(shard.run_layers(shard.embed(mx.array([tokens])), cache, capture=capture)[0])
            assert len(shard.compiled._traced) == traced
    finally:
        shard.compiled = CompiledLayers()


@cpu_only
def test_a_failed_trace_leaves_the_layer_whole(dense_ckpt: Path) -> None:
    """MLX swaps a layer's weights for placeholders while it traces: a bad input must not lose them."""
    shard = load_shard(dense_ckpt, dtype=mx.float32).model
    layer = next(layer for layer in shard.layers if layer.is_linear)
    hidden = shard.config.args.hidden_size
    compiled = CompiledLayers()
    with pytest.raises(ValueError):
        run(layer, mx.zeros((1, 1, hidden + 1)), None, None, compiled)
    h = mx.ones((1, 2, hidden))
    want = run(layer, h, None, None, None)
    got = run(layer, h, None, None, compiled)
    mx.eval(want, got)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))


@cpu_only
def test_forwards_queue_each_layer_and_compute_the_same(dense_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU a forward queues each layer as it is built (the host builds the next while this one
    computes); what it computes, caches included, is what one submission computes."""
    from mlx.utils import tree_flatten

    from mtpipe.models import shard as shard_module
    from mtpipe.models.ragged import cache_arrays, rows_cache
    from mtpipe.node import filling
    from mtpipe.node.protocol import SamplingParams, StepKind, StepRequest

    model = load_shard(dense_ckpt, dtype=mx.float32).model
    queued: list[int] = []
    real_async_eval = mx.async_eval
    monkeypatch.setattr(shard_module.mx, "async_eval", lambda *a: (queued.append(1), real_async_eval(*a))[1])
    prompt = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    assert shard_module.queue_layers()  # the CPU default
    results = {}
    for queue in (False, True):
        monkeypatch.setattr(shard_module, "queue_layers", lambda queue=queue: queue)
        monkeypatch.setattr(filling, "queue_layers", lambda queue=queue: queue)
        queued.clear()
        cache = model.make_cache()
        h, _ = model.run_layers(model.embed(prompt), cache)
        h1, snaps = model.run_layers(model.embed(mx.array([[5, 3, 5]])), cache, capture=True)
        rows = rows_cache(cache)
        h2, _ = model.run_rows(model.embed(mx.array([[8]])), rows, [1])
        states = [a for _, a in tree_flatten([getattr(c, "state", None) for c in rows]) if isinstance(a, mx.array)]
        assert len(states) >= len(model.layers)
        # prompt chunks of rows not yet in a batch, in one forward
        fill = filling.FillGroup(model, None, first=True, dtype=mx.float32, max_context=64,
                                 vocab_size=model.config.args.vocab_size,
                                 hidden_size=model.config.args.hidden_size, has_mtp=False)
        h3 = fill.step([StepRequest(s, 0, StepKind.PREFILL, t, params=SamplingParams())
                        for s, t in (("a", [3, 1, 4, 1, 5]), ("b", [9, 2]))], None)
        results[queue] = [h, h1, h2, h3, *[s for snap in snaps.values() for s in snap.states], *states,
                          *cache_arrays(fill.cache)]
        mx.eval(results[queue])
        assert len(queued) == (4 * len(model.layers) if queue else 0)
    assert all(mx.array_equal(a, b).item() for a, b in zip(results[True], results[False]))


@cpu_only
def test_greedy_draft_steps_are_queued_as_built_and_draft_the_same(dense_ckpt: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU each greedy draft step is queued as it is built, in the per-sequence head and in a
    batch; sampled drafts are drawn on the host step by step, and nothing more is queued for them."""
    from mtpipe.coordinator.engine.build import batch_engine, local_engine
    from mtpipe.coordinator.engine.request import GenerationRequest
    from mtpipe.node import batch_head, head
    from mtpipe.node.protocol import SamplingParams

    queued: list[int] = []
    real_async_eval = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: (queued.append(1), real_async_eval(*a))[1])
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    single = local_engine(dense_ckpt, dtype=mx.float32)
    batch = batch_engine(dense_ckpt, dtype=mx.float32, prefix_cache=0)  # (each run prefills its prompt)
    sampled = SamplingParams(temperature=0.8, seed=7)
    try:
        runs = {}
        for queue in (False, True):
            monkeypatch.setattr(head, "queue_layers", lambda queue=queue: queue)
            monkeypatch.setattr(batch_head, "queue_layers", lambda queue=queue: queue)
            for name, engine, params in (("single", single, SamplingParams()), ("batch", batch, SamplingParams()),
                                         ("sampled", batch, sampled)):
                queued.clear()
                r = engine.complete(GenerationRequest(prompt, max_tokens=24, params=params, mtp_depth=3))
                runs[(name, queue)] = (r.tokens, len(queued), r.stats.drafted)
        for name in ("single", "batch", "sampled"):
            (tokens, plain, drafted), (same, queued_n, _) = runs[(name, False)], runs[(name, True)]
            assert tokens == same and drafted > 0, name
            if name == "sampled":
                assert queued_n == plain
            else:  # one per draft step: the drafts verified, and at most one round's not verified
                assert drafted <= queued_n - plain <= drafted + 3, name
    finally:
        batch.close()
