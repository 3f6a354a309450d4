"""Drafts over the most frequent tokens (models/draft_vocab.py): the same logits for those tokens as the
whole projection, dense and quantized; drafts only from the subset; the same greedy tokens, and the same
seeded sampled tokens, as without it, per sequence and batched, while the subset is ranked again."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import PROMPTS, batch_chunks

from mtpipe.coordinator.engine.build import batch_engine, local_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.models import draft_vocab
from mtpipe.models.convert import convert
from mtpipe.models.draft_vocab import DraftVocab, default_size, top_tokens
from mtpipe.models.loading import load_shard
from mtpipe.models.registry import DEMO_MODEL
from mtpipe.node.protocol import SamplingParams

SMALL = 256  # of the demo model's 4096 tokens: many drafts fall outside, so rejections are exercised


def test_default_size_and_ranking() -> None:
    assert default_size(248320) == 32768
    assert default_size(151936) == 32768
    assert default_size(4096) == 2048
    assert default_size(2048) == 0  # too little of the vocabulary left out to pay
    assert default_size(512) == 0
    counts = np.zeros(10, dtype=np.int64)
    assert top_tokens(counts, 4).tolist() == [0, 1, 2, 3]  # nothing counted: lowest ids
    counts[[7, 9]] = [5, 2]
    counts[3] = 2
    assert top_tokens(counts, 4).tolist() == [0, 3, 7, 9]  # counts first, ties to lower ids


@pytest.mark.parametrize("quantized", [False, True])
def test_subset_logits_equal_the_whole_projection(dense_ckpt: Path, tmp_path: Path, quantized: bool) -> None:
    path = convert(dense_ckpt, tmp_path / "q", quantize=True, bits=8, group_size=32, dtype="float32") \
        if quantized else dense_ckpt
    model = load_shard(path, dtype=mx.float32).model
    vocab = DraftVocab(model, 64)
    assert not vocab.whole and vocab.ids.tolist() == list(range(64))
    g = mx.random.normal((2, 1, model.config.args.hidden_size), key=mx.random.key(3))
    full = model.lm_logits(g)
    assert mx.abs(vocab.logits(g) - full[..., :64]).max().item() <= 1e-5
    ids = np.array([5, 9, 40, 100, 200], dtype=np.int32)
    vocab.counts[ids] = 10
    assert vocab.rank() and vocab.ids.tolist()[:5] == [0, 1, 2, 3, 4] and set(ids) <= set(vocab.ids.tolist())
    sub = vocab.logits(g)
    assert mx.abs(sub - mx.take(full, vocab.ids, axis=-1)).max().item() <= 1e-5
    widened = vocab.widen(sub)
    inside = np.zeros(vocab.vocab, dtype=bool)
    inside[np.array(vocab.ids)] = True
    assert np.isneginf(np.array(widened)[..., ~inside]).all()
    assert mx.abs(widened[..., vocab.ids] - sub).max().item() == 0
    probs = np.array(mx.softmax(sub[0, 0], precise=True))  # drafts drawn on the device report these
    wide = vocab.widen_probs(probs)
    assert wide.shape == (vocab.vocab,) and wide.dtype == np.float64 and wide[~inside].sum() == 0
    assert np.allclose(wide[np.array(vocab.ids)], probs, atol=1e-7) and abs(wide.sum() - 1.0) < 1e-12
    assert not vocab.rank()  # the same counts: nothing changes


def test_whole_vocabulary_is_the_projection(dense_ckpt: Path) -> None:
    model = load_shard(dense_ckpt, dtype=mx.float32).model
    vocab = DraftVocab(model, 0)
    g = mx.ones((1, 1, model.config.args.hidden_size))
    assert vocab.whole and mx.array_equal(vocab.logits(g), model.lm_logits(g))
    vocab.observe([1, 2, 3])  # counts nothing: there is nothing to rank
    assert vocab.counted == 0


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    engine = local_engine(DEMO_MODEL, dtype=mx.float32, mtp=False)
    return [engine.tokenizer.encode(p) for p in PROMPTS[:4]]


def _drafts_within(engine, vocab_of) -> None:
    """Every draft the last stage hands out is a token of its draft vocabulary at that moment."""
    head = vocab_of(engine)
    original = head._draft

    def checked(d, hid, toks, ahead=None):
        drafts = original(d, hid, toks, ahead)
        allowed = set(head.vocab.ids.tolist())
        assert set(drafts) <= allowed, (drafts, head.vocab.size)
        return drafts

    head._draft = checked


def test_greedy_tokens_unchanged_per_sequence(prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(draft_vocab, "RANK_FIRST", 64)  # ranked again several times over these prompts
    plain = local_engine(DEMO_MODEL, dtype=mx.float32, draft_vocab=0)
    small = local_engine(DEMO_MODEL, dtype=mx.float32, draft_vocab=SMALL)
    _drafts_within(small, lambda e: e.pipeline.stages[-1].head)
    vocab = small.pipeline.stages[-1].head.vocab
    drafted = accepted = 0
    for p in prompts:
        ref = plain.complete(GenerationRequest(prompt_tokens=p, max_tokens=48)).tokens
        for depth, auto in ((3, False), (3, True)):  # (every draft position, fixed and auto)
            r = small.complete(GenerationRequest(prompt_tokens=p, max_tokens=48, mtp_depth=depth, mtp_auto=auto))
            assert r.tokens == ref, (depth, auto)
            drafted, accepted = drafted + r.stats.drafted, accepted + r.stats.accepted
    assert vocab.rankings >= 1 and drafted > 0 and 0 < accepted < drafted
    described = small.pipeline.stages[-1].describe()["draft_vocab"]
    assert described == {"size": SMALL, "vocab": 4096, "rankings": vocab.rankings}


def test_seeded_sampled_tokens_unchanged(prompts: list[list[int]]) -> None:
    plain = local_engine(DEMO_MODEL, dtype=mx.float32, draft_vocab=0)
    small = local_engine(DEMO_MODEL, dtype=mx.float32, draft_vocab=SMALL)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, logit_bias=((17, 2.0),))
    for p in prompts[:2]:
        ref = plain.complete(GenerationRequest(prompt_tokens=p, max_tokens=40, params=params)).tokens
        got = small.complete(GenerationRequest(prompt_tokens=p, max_tokens=40, params=params, mtp_depth=3)).tokens
        assert got == ref


def test_batched_rows_unchanged(prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(draft_vocab, "RANK_FIRST", 64)
    plain = local_engine(DEMO_MODEL, dtype=mx.float32, draft_vocab=0)
    engine = batch_engine(DEMO_MODEL, dtype=mx.float32, draft_vocab=SMALL)
    try:
        seeded = SamplingParams(temperature=0.9, seed=11)
        reqs = [GenerationRequest(prompt_tokens=p, max_tokens=40, mtp_depth=d, mtp_auto=a, params=s)
                for p, (d, a, s) in zip(prompts, [(3, False, SamplingParams()), (1, False, SamplingParams()),
                                                  (3, True, SamplingParams()), (2, False, seeded)])]
        refs = [plain.complete(GenerationRequest(prompt_tokens=r.prompt_tokens, max_tokens=40, params=r.params)).tokens
                for r in reqs]
        outs = [[t for c in chunks for t in c.tokens] for chunks in batch_chunks(engine, reqs, timeout=120)]
        assert outs == refs
    finally:
        engine.close()
