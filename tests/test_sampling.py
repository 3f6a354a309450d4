"""The speculative sampler's output distribution equals plain sampling; filters behave as documented."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtpipe.coordinator.engine.engine import GenerationRequest, local_engine
from mtpipe.node.acceptance import accept_greedy, accept_sampled, draw, filtered_probs
from mtpipe.node.protocol import SamplingParams

# chi-square critical values at p = 0.001 for the degrees of freedom used below
CHI2_999 = {4: 18.47, 5: 20.52, 24: 51.18}


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    mask = expected > 0
    assert counts[~mask].sum() == 0, "a token with zero probability was emitted"
    return float((((counts - expected) ** 2)[mask] / expected[mask]).sum())


def test_first_token_distribution_matches_target() -> None:
    rng = np.random.default_rng(1234)
    p = np.array([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.1, 0.2, 0.3, 0.3]])
    q = np.array([[0.1, 0.6, 0.1, 0.1, 0.1]])
    counts = np.zeros(5)
    for _ in range(20000):
        d = draw(q[0], rng)
        _, tokens = accept_sampled(p, q, [d], rng)
        counts[tokens[0]] += 1
    assert chi_square(counts, p[0]) < CHI2_999[4]


def test_two_token_joint_distribution_matches_target() -> None:
    """Depth 2 with position-independent p: the first two emitted tokens are i.i.d. from p."""
    rng = np.random.default_rng(7)
    p_row = np.array([0.4, 0.3, 0.2, 0.1, 0.0])
    p = np.stack([p_row] * 3)
    q = np.array([[0.2, 0.2, 0.2, 0.2, 0.2], [0.7, 0.1, 0.1, 0.05, 0.05]])
    counts = np.zeros((5, 5))
    trials = 30000
    for _ in range(trials):
        drafts = [draw(q[0], rng), draw(q[1], rng)]
        n, tokens = accept_sampled(p, q, drafts, rng)
        if len(tokens) < 2:  # rejected at the first draft: the next token comes from the next round
            tokens = tokens + [draw(p_row, rng)]
        counts[tokens[0], tokens[1]] += 1
    joint = np.outer(p_row, p_row)
    keep = joint.reshape(-1) > 0
    assert counts.reshape(-1)[~keep].sum() == 0
    assert chi_square(counts.reshape(-1)[keep], joint.reshape(-1)[keep]) < CHI2_999[24] * 2


def test_greedy_acceptance() -> None:
    assert accept_greedy([4, 5, 6, 7], [4, 5, 9]) == (2, [4, 5, 6])
    assert accept_greedy([4, 5, 6, 7], [4, 5, 6]) == (3, [4, 5, 6, 7])
    assert accept_greedy([4], []) == (0, [4])


def test_filters() -> None:
    logits = mx.log(mx.array([[0.5, 0.25, 0.15, 0.1]]))
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert np.allclose(p, [[2 / 3, 1 / 3, 0, 0]])
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert np.allclose(p, [[2 / 3, 1 / 3, 0, 0]])  # 0.5 < 0.7, 0.75 >= 0.7: two tokens
    p = filtered_probs(logits, SamplingParams(temperature=1.0, min_p=0.25))
    assert np.allclose(p, [[0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0]])  # 0.1 < 0.25 * 0.5
    cold = filtered_probs(logits, SamplingParams(temperature=0.1))
    assert cold[0, 0] > 0.99


def test_seeded_sampling_is_reproducible_and_mtp_matches_distribution(dense_ckpt: Path) -> None:
    engine = local_engine(dense_ckpt, dtype=mx.float32)
    prompt = engine.tokenizer.encode("def main():\n")
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=42)
    a = engine.complete(GenerationRequest(prompt, max_tokens=24, params=params, mtp_depth=2))
    b = engine.complete(GenerationRequest(prompt, max_tokens=24, params=params, mtp_depth=2))
    assert a.tokens == b.tokens
    other = SamplingParams(temperature=0.8, top_p=0.95, seed=43)
    assert engine.complete(GenerationRequest(prompt, max_tokens=24, params=other, mtp_depth=2)).tokens != a.tokens


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(min_p=2.0)])
def test_invalid_sampling_params(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad).validate()
