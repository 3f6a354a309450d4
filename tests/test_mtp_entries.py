"""MTP cache entries written without the layer (a prompt, positions decoded without drafts): the same
entries, the same drafts and the same output as running the layer over every position."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import PROMPTS
from mlx_lm.models.cache import KVCache

from mtpipe.coordinator.engine.build import batch_engine, local_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.models import mtp as mtp_module
from mtpipe.models.loading import load_shard
from mtpipe.models.ragged import RaggedKV
from mtpipe.models.registry import DEMO_MODEL
from mtpipe.node.batch_head import BatchHead
from mtpipe.node.depth import DepthChooser, StageCosts
from mtpipe.node.head import DraftState, Head
from mtpipe.node.protocol import SamplingParams

TOL = 1e-5
# Long stretches without drafts, then drafting again: many positions to catch up at once.
SCHEDULE = [0, 0, 0, 0, 0, 0, 0, 3, 3, 0, 0, 0, 0, 2, 1, 0, 0, 0, 0, 0, 3]


def max_diff(a: mx.array, b: mx.array) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return mx.abs(a - b).max().item()


def test_entries_only_equal_the_layer_over_every_position() -> None:
    model = load_shard(DEMO_MODEL, dtype=mx.float32).model
    hidden_size = model.layers[0].input_layernorm.weight.shape[0]
    hid = mx.random.normal((1, 40, hidden_size), key=mx.random.key(0))
    emb = model.embed(mx.random.randint(0, 1000, (1, 40), key=mx.random.key(1)))

    whole, split = KVCache(), KVCache()
    g = model.mtp(hid, emb, whole)
    model.mtp.extend(hid[:, :30], emb[:, :30], split)
    model.mtp.extend(hid[:, 30:39], emb[:, 30:39], split)
    last = model.mtp(hid[:, 39:], emb[:, 39:], split)
    assert whole.offset == split.offset == 40
    assert max_diff(whole.keys[..., :40, :], split.keys[..., :40, :]) <= TOL
    assert max_diff(whole.values[..., :40, :], split.values[..., :40, :]) <= TOL
    assert max_diff(g[:, -1:], last) <= TOL

    # Rows of a batch, each adding its own number of entries at its own length.
    hid2, emb2 = mx.concatenate([hid, hid[:, ::-1]]), mx.concatenate([emb, emb[:, ::-1]])
    whole_rows, split_rows = RaggedKV(lengths=[0, 0]), RaggedKV(lengths=[0, 0])
    g2 = model.mtp.rows(hid2, emb2, whole_rows, [40, 25])
    model.mtp.extend(hid2[:, :39], emb2[:, :39], split_rows, [39, 24])
    at = mx.array([39, 24])
    rows = mx.arange(2)
    last2 = model.mtp.rows(hid2[rows, at][:, None], emb2[rows, at][:, None], split_rows, [1, 1])
    assert whole_rows.lengths == split_rows.lengths == [40, 25]
    for i, n in enumerate((40, 25)):
        assert max_diff(whole_rows.row(i)[0], split_rows.row(i)[0]) <= TOL
        assert max_diff(whole_rows.row(i)[1], split_rows.row(i)[1]) <= TOL
        assert max_diff(g2[i, n - 1], last2[i, 0]) <= TOL


def test_entries_only_pays_for_long_catch_ups_and_contexts() -> None:
    pays = mtp_module.entries_only_pays
    assert not pays(1, 100_000)  # one pair: its output drafts, nothing to split
    assert not pays(4, 64)  # a round's few pairs at a short context: one call is cheaper
    assert pays(64, 64) and pays(2, 8192)


def forced_sequence(monkeypatch: pytest.MonkeyPatch, calls: dict[str, int]) -> None:

    def forced(self: DepthChooser, costs: StageCosts, context: int) -> int:
        calls["n"] += 1
        return SCHEDULE[(calls["n"] - 1) % len(SCHEDULE)]

    monkeypatch.setattr(DepthChooser, "next_depth", forced)


def forced_batch(monkeypatch: pytest.MonkeyPatch, calls: dict[str, int]) -> None:

    def forced(self: BatchHead, rows: list, positions: list[int]) -> None:
        calls["n"] += 1
        for d in self.states:
            if d.chooser is not None:
                d.depth = SCHEDULE[(calls["n"] - 1) % len(SCHEDULE)]

    monkeypatch.setattr(BatchHead, "_choose", forced)


@pytest.mark.parametrize("kind", ["sequence", "batch"])
def test_catch_up_by_entries_keeps_drafts_and_output(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo model accepts most drafts: equal acceptance with and without the split means equal drafts."""
    engine = (local_engine(DEMO_MODEL, dtype=mx.float32) if kind == "sequence"
              else batch_engine(DEMO_MODEL, dtype=mx.float32))
    calls = {"n": 0}  # rounds so far: each run starts the schedule anew
    (forced_sequence if kind == "sequence" else forced_batch)(monkeypatch, calls)
    try:
        for text in PROMPTS[:2]:
            prompt = engine.tokenizer.encode(text)
            req = GenerationRequest(prompt, max_tokens=48, mtp_depth=3, mtp_auto=True)
            plain = engine.complete(GenerationRequest(prompt, max_tokens=48)).tokens
            runs = {}
            for work in (10**9, 1):  # never split; split whenever more than one pair
                monkeypatch.setattr(mtp_module, "ENTRIES_ONLY_WORK", work)
                calls["n"] = 0
                out = engine.complete(req)
                runs[work] = (out.tokens, out.stats.accepted_per_position, out.stats.depths)
            assert runs[1] == runs[10**9]
            tokens, accepted, depths = runs[1]
            assert tokens == plain and sum(accepted) > 0 and depths.get(0, 0) > 0
    finally:
        if kind == "batch":
            engine.close()


def test_prompt_entries_match_the_layer(ckpt: Path) -> None:
    """A prompt's MTP entries (prefill writes them without the layer) equal the layer's."""
    from mtpipe.node.protocol import StepKind, StepRequest
    from mtpipe.node.stage import StageWorker

    shard = load_shard(ckpt, dtype=mx.float32)
    worker = StageWorker(shard, overlap=False)
    prompt = list(range(3, 60))
    worker.step(StepRequest("s", 0, StepKind.PREFILL, prompt[:-1], mtp_depth=2))
    worker.step(StepRequest("s", 1, StepKind.PREFILL, prompt[-1:], final=True))
    d = worker.sequences["s"].draft
    model = shard.model
    cache = model.make_cache()
    h, _ = model.run_layers(model.embed(mx.array([prompt])), cache)
    reference = KVCache()
    model.mtp(model.final_norm(h)[:, :-1], model.embed(mx.array([prompt[1:]])), reference)
    n = len(prompt) - 1
    assert d.mtp_len >= n
    assert max_diff(d.mtp_cache.keys[..., :n, :], reference.keys[..., :n, :]) <= TOL
    assert max_diff(d.mtp_cache.values[..., :n, :], reference.values[..., :n, :]) <= TOL


@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize(("lengths", "depths", "drafting", "counts", "idle"), [
    # a row adding 4 pairs beside rows adding 1 and 2, one that never drafts, one catching up 20 idle pairs
    ([40, 5, 0, 30], [3, 2, 0, 1], [True, True, False, True], [4, 1, 1, 2], [0, 0, 0, 20]),
    ([70, 70], [2, 2], [True, True], [1, 3], [12, 0]),
    # a row at depth 0 keeps its pairs aside while the others draft
    ([10, 200, 3], [0, 3, 2], [True, True, True], [2, 1, 1], [5, 30, 0]),
])
def test_batch_drafts_with_entries_only_equal_the_layer(monkeypatch: pytest.MonkeyPatch, lengths: list[int],
                                                        depths: list[int], drafting: list[bool], counts: list[int],
                                                        idle: list[int], window: int) -> None:
    """BatchHead._draft over ragged rows (each with its own cache length, pairs and depth) gives the same
    drafts, MTP lengths and cache entries whether the pairs before each row's last are written alone,
    drafting over the whole context or over a window shorter than most rows' (models/mtp.py)."""
    model = load_shard(DEMO_MODEL, dtype=mx.float32).model
    hidden_size = model.layers[0].input_layernorm.weight.shape[0]

    def run(work: int) -> tuple[list[list[int]], list[int], RaggedKV]:
        monkeypatch.setattr(mtp_module, "ENTRIES_ONLY_WORK", work)
        batch = BatchHead(Head(model, mtp_window=window))
        for i, (n, depth, drafts) in enumerate(zip(lengths, depths, drafting)):
            cache = None
            if drafts:
                cache = KVCache()
                if n:
                    model.mtp(mx.random.normal((1, n, hidden_size), key=mx.random.key(10 + i)),
                              model.embed(mx.random.randint(0, 500, (1, n), key=mx.random.key(20 + i))), cache)
            state = DraftState(params=SamplingParams(), depth=depth, rng=np.random.default_rng(0), mtp_cache=cache,
                               mtp_len=n if drafts else 0)
            if idle[i]:
                state.idle_hidden = [mx.random.normal((1, idle[i], hidden_size), key=mx.random.key(50 + i))]
                state.idle_tokens = list(range(100, 100 + idle[i]))
            batch.join(str(i), state)
        pairs = [(mx.random.normal((1, c, hidden_size), key=mx.random.key(30 + i)), list(range(7, 7 + c)))
                 for i, c in enumerate(counts)]
        batch._draft(pairs)
        return [d.drafts for d in batch.states], [d.mtp_len for d in batch.states], batch.mtp

    whole, split = run(10**9), run(1)
    assert whole[0] == split[0] and whole[1] == split[1]
    assert any(whole[0])
    for i, n in enumerate(split[1]):
        if n:
            for a, b in zip(whole[2].row(i), split[2].row(i)):
                assert max_diff(a, b) <= TOL
