"""The committed demo checkpoint, checked independently: MLX (mtpipe) against transformers (torch).

Backbone logits over a few hundred held-out tokens, and the MTP head's logits against the training
script's torch MTP module, in float32. Also: the engine's greedy MTP output on it is exact.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtpipe.coordinator.engine.build import local_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.models.loading import load_shard
from mtpipe.models.registry import DEMO_MODEL
from mtpipe.training.corpus import heldout_prompts

torch = pytest.importorskip("torch", reason="the reference check needs the [train] extra (torch==2.13.0)")

TOL = 1e-3


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(DEMO_MODEL)
    ids = tok.encode(heldout_prompts(1, chars=1500)[0])[:300]
    assert len(ids) >= 200
    return ids


def test_demo_checkpoint_size_and_card() -> None:
    weights = DEMO_MODEL / "model.safetensors"
    assert weights.stat().st_size <= 25 * 1024 * 1024
    card = (DEMO_MODEL / "README.md").read_text()
    assert "python -m training.train_demo" in card and "held-out" in card.lower()
    names = mx.load(str(weights)).keys()
    assert any(k.startswith("model.language_model.layers.") for k in names)
    assert any(k.startswith("mtp.layers.0.") for k in names)


def test_backbone_and_mtp_logits_match_torch(tokens: list[int]) -> None:
    from mtpipe.training.train_demo import load_demo

    backbone, mtp = load_demo(DEMO_MODEL, dtype=torch.float32)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        # The text model's last_hidden_state is after the final norm: what the MTP head reads.
        hidden = backbone.model(ids).last_hidden_state
        ref_logits = backbone.lm_head(hidden)[0].numpy()
        ref_mtp = mtp(hidden[:, :-1], ids[:, 1:])[0].numpy()

    shard = load_shard(DEMO_MODEL, dtype=mx.float32).model
    x = mx.array([tokens])
    h, _ = shard.run_layers(shard.embed(x), shard.make_cache())
    normed = shard.final_norm(h)
    logits = np.array(shard.lm_logits(normed)[0])
    assert np.abs(logits - ref_logits).max() <= TOL

    from mlx_lm.models.cache import KVCache

    g = shard.mtp(normed[:, :-1], shard.embed(x[:, 1:]), KVCache())
    mtp_logits = np.array(shard.lm_logits(g)[0])
    assert np.abs(mtp_logits - ref_mtp).max() <= TOL
    # The head is trained: its top-1 agrees with the next-next token well above chance.
    agree = (mtp_logits[:-1].argmax(-1) == np.array(tokens[2:])).mean()
    assert agree > 0.3


def test_demo_greedy_mtp_exact_and_accepting() -> None:
    engine = local_engine(DEMO_MODEL, dtype=mx.float32)
    for text in heldout_prompts(2, chars=400):
        prompt = engine.tokenizer.encode(text)
        plain = engine.complete(GenerationRequest(prompt, max_tokens=48)).tokens
        for depth in (1, 3):
            r = engine.complete(GenerationRequest(prompt, max_tokens=48, mtp_depth=depth))
            assert r.tokens == plain
            assert r.stats.accepted > 0


def test_drafts_accepted_past_a_requests_end_are_not_counted() -> None:
    """On the demo model (whose drafts are accepted): a request that ends inside a round reports as
    accepted only the drafts it handed out, in every engine."""
    from helpers import PROMPTS

    from mtpipe.coordinator.engine.build import batch_engine

    batch, single = batch_engine(DEMO_MODEL, dtype=mx.float32), local_engine(DEMO_MODEL, dtype=mx.float32)
    try:
        prompts = [list(batch.tokenizer.encode(PROMPTS[i])) for i in (11, 13, 15)]  # (rounds past the end there)
        seen = 0
        for engine in (batch, single):
            for prompt in prompts:
                for m in (2, 3):
                    r = engine.complete(GenerationRequest(prompt, max_tokens=m, mtp_depth=3))
                    s = r.stats
                    # every round hands out its accepted drafts and one token more, the last maybe fewer
                    assert s.accepted <= s.generation_tokens - 1, (m, s)
                    assert sum(s.accepted_per_position) == s.accepted and s.accepted <= s.drafted
                    seen += s.accepted
        assert seen > 0  # (drafts were accepted: the check had something to check)
    finally:
        batch.close()
