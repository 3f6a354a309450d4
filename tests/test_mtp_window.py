"""Drafting over the MTP layer's last entries only (models/mtp.py `window`): the attention reads
exactly the window, alone and in ragged batch rows alike, the cache keeps every entry, and the
output stays that of decoding without drafts."""

from __future__ import annotations

import queue

import mlx.core as mx
import pytest
from helpers import PROMPTS
from mlx_lm.models.cache import KVCache

from mtpipe.coordinator.engine.batch import END
from mtpipe.coordinator.engine.build import batch_engine, local_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.models.loading import load_shard
from mtpipe.models.ragged import RaggedKV
from mtpipe.models.registry import DEMO_MODEL

TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return load_shard(DEMO_MODEL, dtype=mx.float32).model


def inputs(model, n: int, seed: int) -> tuple[mx.array, mx.array]:
    hidden_size = model.layers[0].input_layernorm.weight.shape[0]
    hid = mx.random.normal((1, n, hidden_size), key=mx.random.key(seed))
    emb = model.embed(mx.random.randint(0, 1000, (1, n), key=mx.random.key(seed + 1)))
    return hid, emb


def filled(model, n: int, seed: int) -> KVCache:
    cache = KVCache()
    model.mtp.extend(*inputs(model, n, seed), cache)
    return cache


def masked_reference(model, hid: mx.array, emb: mx.array, cache: KVCache, window: int) -> mx.array:
    """The layer over the whole cache with an explicit mask: query t (at position offset + t) sees
    positions offset - window .. offset + t."""
    offset, T = cache.offset, hid.shape[1]
    keys = mx.arange(offset + T)[None, :]
    queries = offset + mx.arange(T)[:, None]
    mask = (keys <= queries) & (keys >= offset - window)
    u = model.mtp.layers[0](model.mtp.fuse(hid, emb), mask=mask, cache=cache)
    return model.mtp.norm(u)


def max_diff(a: mx.array, b: mx.array) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return mx.abs(a - b).max().item()


@pytest.mark.parametrize("T", [1, 3])
def test_a_window_reads_exactly_its_entries_and_the_cache_keeps_them_all(model, T: int) -> None:
    hid, emb = inputs(model, T, 7)
    windowed, reference, whole = filled(model, 40, 0), filled(model, 40, 0), filled(model, 40, 0)
    got = model.mtp(hid, emb, windowed, window=8)
    want = masked_reference(model, hid, emb, reference, 8)
    assert max_diff(got, want) <= TOL
    assert windowed.offset == 40 + T  # every entry written, none dropped: rollback trims as before
    assert max_diff(windowed.keys[..., : 40 + T, :], reference.keys[..., : 40 + T, :]) <= TOL
    # The window does change what the head computes, and a window past the context changes nothing.
    assert max_diff(got, model.mtp(hid, emb, whole)) > 1e-3
    wide, full = filled(model, 40, 0), filled(model, 40, 0)
    assert max_diff(model.mtp(hid, emb, wide, window=40), model.mtp(hid, emb, full)) == 0.0


@pytest.mark.parametrize(("lengths", "real"), [
    ([40, 12, 25], [3, 1, 2]),  # ragged rows: one under the window, two over it
    ([30, 30], [2, 2]),  # level rows: a slice and a causal mask
    ([30, 30], [1, 2]),
])
def test_ragged_rows_read_the_window_a_sequence_alone_reads(model, lengths: list[int], real: list[int]) -> None:
    window = 16
    caches = [filled(model, n, 10 * i) for i, n in enumerate(lengths)]
    rows = RaggedKV.concat([RaggedKV.from_cache(c) for c in caches])
    width = max(real)
    pairs = [inputs(model, width, 100 + i) for i in range(len(lengths))]
    hid = mx.concatenate([h for h, _ in pairs])
    emb = mx.concatenate([e for _, e in pairs])
    got = model.mtp.rows(hid, emb, rows, real, window=window)
    assert rows.lengths == [n + r for n, r in zip(lengths, real)]
    for i, (cache, r) in enumerate(zip(caches, real)):
        alone = model.mtp(hid[i : i + 1, :r], emb[i : i + 1, :r], cache, window=window)
        assert max_diff(got[i : i + 1, :r], alone) <= TOL
        for a, b in zip(rows.row(i), (cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :])):
            assert max_diff(a, b) <= TOL


def batch_run(engine, reqs: list[GenerationRequest]) -> list[tuple[list[int], tuple[int, int, int]]]:
    """Requests decoding side by side in a batch engine: each one's tokens and (rounds, drafted, accepted)."""
    sinks = [queue.SimpleQueue() for _ in reqs]
    for req, sink in zip(reqs, sinks):
        engine.open(req, sink.put)
    out = []
    for sink in sinks:
        chunks = []
        while (item := sink.get(timeout=60)) is not END:
            assert not isinstance(item, BaseException), item
            chunks.append(item)
        stats = chunks[-1].stats
        out.append(([t for c in chunks for t in c.tokens], (stats.rounds, stats.drafted, stats.accepted)))
    return out


def test_windowed_drafts_keep_the_output_and_batch_rows_draft_what_they_draft_alone() -> None:
    """A 4-entry window on the demo model (which accepts most drafts): outputs equal decoding without
    drafts; rows of a batch (prompts of different lengths, so ragged MTP caches) accept exactly what
    they accept alone; and the window is in effect (acceptance moves against the whole context)."""
    single = local_engine(DEMO_MODEL, dtype=mx.float32, mtp_window=4)
    whole = local_engine(DEMO_MODEL, dtype=mx.float32, mtp_window=0)
    batch = batch_engine(DEMO_MODEL, dtype=mx.float32, mtp_window=4)
    try:
        assert single.pipeline.stages[-1].describe()["mtp_window"] == 4
        assert whole.pipeline.stages[-1].describe()["mtp_window"] == 0
        prompts = [single.tokenizer.encode(t) for t in (PROMPTS[0] + PROMPTS[1], PROMPTS[2])]
        reqs = [GenerationRequest(p, max_tokens=40, mtp_depth=3) for p in prompts]
        alone = []
        for req in reqs:
            plain = single.complete(GenerationRequest(req.prompt_tokens, max_tokens=40)).tokens
            out = single.complete(req)
            assert out.tokens == plain == whole.complete(req).tokens
            assert out.stats.accepted > 0
            alone.append((out.tokens, (out.stats.rounds, out.stats.drafted, out.stats.accepted)))
        assert batch_run(batch, reqs) == alone
        assert any(whole.complete(r).stats.accepted != a[1][2] for r, a in zip(reqs, alone))
    finally:
        batch.close()
