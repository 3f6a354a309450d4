"""Drafting over the MTP layer's last entries only (models/mtp.py `window`): the attention reads
exactly the window, alone and in ragged batch rows alike, the cache keeps every entry, and the
output stays that of decoding without drafts."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import PROMPTS, batch_chunks
from mlx_lm.models.cache import KVCache

from mtpipe.coordinator.engine.build import batch_engine, local_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.models.loading import load_shard
from mtpipe.models.mtp import DEFAULT_WINDOW
from mtpipe.models.ragged import RaggedKV
from mtpipe.models.registry import DEMO_MODEL
from mtpipe.node.head import Head

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
    """The layer over the whole cache with an explicit mask: the query at position p sees p - window .. p."""
    offset, T = cache.offset, hid.shape[1]
    keys = mx.arange(offset + T)[None, :]
    queries = offset + mx.arange(T)[:, None]
    mask = (keys <= queries) & (keys >= queries - window)
    u = model.mtp.layers[0](model.mtp.fuse(hid, emb), mask=mask, cache=cache)
    return model.mtp.norm(u)


def max_diff(a: mx.array, b: mx.array) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return mx.abs(a - b).max().item()


@pytest.mark.parametrize(("T", "window"), [(1, 8), (3, 8), (3, 1), (3, 41), (5, 2)])
def test_a_window_reads_exactly_its_entries_and_the_cache_keeps_them_all(model, T: int, window: int) -> None:
    """(3, 41) over 40 entries: only the last query's window leaves out the first key."""
    hid, emb = inputs(model, T, 7)
    windowed, reference, whole = filled(model, 40, 0), filled(model, 40, 0), filled(model, 40, 0)
    got = model.mtp(hid, emb, windowed, window=window)
    want = masked_reference(model, hid, emb, reference, window)
    assert max_diff(got, want) <= TOL
    assert windowed.offset == 40 + T  # every entry written, none dropped: rollback trims as before
    assert max_diff(windowed.keys[..., : 40 + T, :], reference.keys[..., : 40 + T, :]) <= TOL
    assert max_diff(got[:, -1], model.mtp(hid, emb, whole)[:, -1]) > 1e-4  # the window does change it


@pytest.mark.parametrize("window", [4, 16])
def test_a_position_reads_the_same_keys_however_a_call_is_split(model, window: int) -> None:
    """Entries written alone (`extend`) then the last position through the layer, as drafting does
    after a long catch-up, give the last position what one call over every position gives it."""
    hid, emb = inputs(model, 6, 3)
    whole, split = filled(model, 40, 0), filled(model, 40, 0)
    once = model.mtp(hid, emb, whole, window=window)[:, -1:]
    model.mtp.extend(hid[:, :-1], emb[:, :-1], split)
    assert max_diff(model.mtp(hid[:, -1:], emb[:, -1:], split, window=window), once) <= TOL


@pytest.mark.parametrize(("lengths", "real"), [
    ([40, 12, 25], [3, 1, 2]),  # ragged rows: one under the window, two over it
    ([40, 25, 30], [3, 1, 2]),  # every row over it: keys before the shortest row's window are not read
    ([30, 30], [2, 2]),  # level rows: a slice and a band mask
    ([30, 30], [1, 2]),
    ([40, 0, 30], [2, 0, 1]),  # a row that does not draft (no MTP entries) beside long ones
])
def test_ragged_rows_read_the_window_a_sequence_alone_reads(model, lengths: list[int], real: list[int]) -> None:
    window = 16
    caches = [filled(model, n, 10 * i) if n else KVCache() for i, n in enumerate(lengths)]
    rows = RaggedKV.concat([RaggedKV.from_cache(c) for c in caches])
    width = max(real)
    pairs = [inputs(model, width, 100 + i) for i in range(len(lengths))]
    hid = mx.concatenate([h for h, _ in pairs])
    emb = mx.concatenate([e for _, e in pairs])
    got = model.mtp.rows(hid, emb, rows, real, window=window)
    assert not mx.isnan(got).any().item()  # rows adding nothing still see a key
    assert rows.lengths == [n + r for n, r in zip(lengths, real)]
    for i, (cache, r) in enumerate(zip(caches, real)):
        if not r:
            continue
        alone = model.mtp(hid[i : i + 1, :r], emb[i : i + 1, :r], cache, window=window)
        assert max_diff(got[i : i + 1, :r], alone) <= TOL
        for a, b in zip(rows.row(i), (cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :])):
            assert max_diff(a, b) <= TOL


def test_ragged_keys_start_at_the_earliest_window_of_the_rows_that_add() -> None:
    """A row adding nothing (a sequence without drafts) does not hold every row to the whole cache."""
    heads, dim = 2, 4
    cache = RaggedKV(mx.zeros((3, heads, 64, dim)), mx.zeros((3, heads, 64, dim)), [50, 0, 40])
    new = mx.ones((3, 2, heads, dim))
    keys, values, mask = cache.update(new, new, [2, 0, 1], window=8)
    assert keys.shape[2] == values.shape[2] == 52 - (40 - 8)
    assert mask.shape == (3, 1, 2, 52 - 32)
    level = RaggedKV(mx.zeros((1, heads, 64, dim)), mx.zeros((1, heads, 64, dim)), [30])
    keys, _, mask = level.update(new[:1], new[:1], [2], window=8)
    assert keys.shape[2] == 32 - 22 and mask.shape == (2, 10)


def test_the_default_window_and_a_negative_one(model) -> None:
    assert Head(model).mtp_window == DEFAULT_WINDOW == 1024
    assert Head(model, mtp_window=0).mtp_window is None
    with pytest.raises(ValueError, match="mtp_window"):
        Head(model, mtp_window=-1)


def batch_run(engine, reqs: list[GenerationRequest]) -> list[tuple[list[int], tuple[int, int, int]]]:
    """Requests decoding side by side in a batch engine: each one's tokens and (rounds, drafted, accepted)."""
    out = []
    for chunks in batch_chunks(engine, reqs, timeout=60):
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
