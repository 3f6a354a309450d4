"""The speculative sampler's output distribution equals plain sampling, and a seeded request's tokens do
not depend on the drafts; filters behave as documented."""

from __future__ import annotations

import itertools
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpipe.coordinator.engine.build import local_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.models.loading import load_shard
from mtpipe.node.acceptance import (
    TOP_P_CANDIDATES,
    accept_coupled,
    accept_greedy,
    accept_sampled,
    draw,
    filtered_probs,
    gumbel_pick,
    top_p_row,
)
from mtpipe.node.device_sampling import draw_drafts, filtered_logits, sample
from mtpipe.node.protocol import SamplingParams

# Every goodness-of-fit test here rejects at significance ALPHA: the statistic must stay below the
# chi-square distribution's upper ALPHA quantile for its degrees of freedom (cells - 1). The quantiles
# are computed by chi2_critical below (scipy is not a dependency) and checked against published
# tables in test_chi2_critical_values_match_published_tables. Seeds are fixed: no test flakes.
ALPHA = 0.001


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square with an integer number of degrees of freedom, in closed form
    (Abramowitz & Stegun, section 26.4): even df, a Poisson sum; odd df, the normal tail plus a
    finite sum."""
    if x <= 0:
        return 1.0
    if df % 2 == 0:
        term = total = 1.0
        for i in range(1, df // 2):
            term *= x / 2 / i
            total += term
        return math.exp(-x / 2) * total
    term, total = math.sqrt(x), 0.0
    for r in range(1, (df - 1) // 2 + 1):
        total += term
        term *= x / (2 * r + 1)
    return math.erfc(math.sqrt(x / 2)) + 2 * math.exp(-x / 2) / math.sqrt(2 * math.pi) * total


def chi2_critical(alpha: float, df: int) -> float:
    """The x with P(X > x) = alpha, by bisection on chi2_sf (decreasing in x)."""
    lo, hi = 0.0, df + 40.0 * math.sqrt(2 * df) + 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return (lo + hi) / 2


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
    assert chi_square(counts, p[0]) < chi2_critical(ALPHA, 4)  # 5 cells: 4 degrees of freedom


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
    # The 4 x 4 pairs of tokens with p > 0 are the cells: 15 degrees of freedom.
    assert keep.sum() == 16
    assert chi_square(counts.reshape(-1)[keep], joint.reshape(-1)[keep]) < chi2_critical(ALPHA, 15)


def test_chi2_critical_values_match_published_tables() -> None:
    # Upper-tail critical values from the NIST/SEMATECH e-Handbook of Statistical Methods, table
    # 1.3.6.7.4 (scipy.stats.chi2.ppf(1 - alpha, df) gives the same to the digits shown).
    published = {(0.05, 1): 3.841, (0.05, 10): 18.307, (0.001, 1): 10.828, (0.001, 4): 18.467,
                 (0.001, 9): 27.877, (0.001, 15): 37.697, (0.001, 24): 51.179, (0.001, 99): 148.230}
    for (alpha, df), value in published.items():
        assert abs(chi2_critical(alpha, df) - value) < 6e-4, (alpha, df)


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


def sorted_top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    """top_p by the definition: sort the whole row (ties by index), keep each token while the mass
    strictly above it is under top_p of the row's."""
    order = np.argsort(-p, kind="stable")
    sorted_p = p[order]
    keep = np.zeros(len(p), bool)
    keep[order] = np.cumsum(sorted_p) - sorted_p < top_p * p.sum()
    return np.where(keep, p, 0.0)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 3000), st.floats(0.01, 0.999), st.integers(0, 64), st.floats(0.1, 8.0), st.integers(0, 2**32 - 1),
       st.booleans())
def test_top_p_sorts_only_what_it_may_keep_and_keeps_what_a_whole_sort_keeps(
        V: int, top_p: float, top_k: int, spread: float, seed: int, ties: bool) -> None:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=V) * spread
    if ties:  # many tokens of exactly equal probability, also across the candidates' edge
        logits = np.round(logits)
    logits = mx.array(logits[None].astype(np.float32))
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=top_k))[0]
    assert np.array_equal(top_p_row(p, top_p), sorted_top_p(p, top_p))
    # Rows of a round are filtered each on its own.
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    both = filtered_probs(mx.concatenate([logits, logits[:, ::-1]]), params)
    assert np.array_equal(both, np.concatenate([filtered_probs(logits, params), filtered_probs(logits[:, ::-1], params)]))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=4),
                                    SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=0.9, min_p=0.2),
                                    SamplingParams(temperature=1.0, top_k=6, top_p=0.8, min_p=0.05)])
def test_draws_on_the_device_follow_the_filtered_distribution(params: SamplingParams) -> None:
    """What a row drawn on the device (device_sampling.py) keeps is what the host keeps, and its
    draws follow those probabilities (logits without ties: the device keeps ties at a cut whole)."""
    logits = mx.array(np.random.default_rng(5).normal(size=10).astype(np.float32) * 1.5)
    host = filtered_probs(logits[None], params)[0]
    device = np.array(mx.softmax(filtered_logits(logits, params), precise=True))
    assert np.array_equal(device > 0, host > 0) and np.allclose(device, host, atol=1e-6)
    # 4000 draws at once: the same row 4000 times (each row is drawn on its own, as a batch's rows are)
    draws = sample(mx.broadcast_to(logits, (4000, 10)), params, mx.random.key(11))
    counts = np.bincount(np.array(draws), minlength=10).astype(float)
    support = host > 0
    assert counts[~support].sum() == 0
    assert chi_square(counts, host) < chi2_critical(ALPHA, int(support.sum()) - 1)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_p=0.6),
                                    SamplingParams(temperature=1.0, top_k=6, top_p=0.8, min_p=0.05)])
def test_drafts_drawn_on_the_device_follow_the_probabilities_they_report(params: SamplingParams) -> None:
    """A batch of rows' drafts drawn on the device follow the probabilities handed to their acceptance
    (which, over few tokens, are the target's filter)."""
    logits = mx.array(np.random.default_rng(6).normal(size=(2, 10)).astype(np.float32) * 1.5)
    _, q = draw_drafts(logits, params, mx.random.key(0))
    q = np.array(q, dtype=np.float64)
    assert np.allclose(q, filtered_probs(logits, params), atol=1e-6)
    # 4000 draws of each row at once: the two rows 4000 times over (each row is drawn on its own)
    drawn = np.array(draw_drafts(mx.tile(logits, (4000, 1)), params, mx.random.key(12))[0]).reshape(4000, 2)
    for row in range(2):
        counts = np.bincount(drawn[:, row], minlength=10).astype(float)
        assert chi_square(counts, q[row]) < chi2_critical(ALPHA, int((q[row] > 0).sum()) - 1)


def test_top_p_over_candidates_keeps_them_all_when_they_fall_short() -> None:
    """Drafts filter top_p over their most likely tokens only: the target's set when those reach the
    mass, else all of them (a narrower distribution is still a distribution to draft from)."""
    rng = np.random.default_rng(2)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    peaked = mx.array((rng.normal(size=(1, 1000)) * 4).astype(np.float32))
    flat = mx.array((rng.normal(size=(1, 1000)) * 0.1).astype(np.float32))

    def kept(x: mx.array, candidates: int) -> np.ndarray:
        return np.isfinite(np.array(filtered_logits(x, params, candidates)))[0]

    assert kept(peaked, 16).sum() < 16 and np.array_equal(kept(peaked, 16), kept(peaked, 0))
    assert kept(flat, 0).sum() > 16
    assert set(np.flatnonzero(kept(flat, 16))) == set(np.argsort(-np.array(flat)[0])[:16])  # the most likely
    # Rows filter each on its own.
    both = filtered_logits(mx.concatenate([peaked, flat]), params, 16)
    assert mx.array_equal(both, mx.concatenate([filtered_logits(peaked, params, 16), filtered_logits(flat, params, 16)]))
    # Drafts drawn so follow what they report: the TOP_P_CANDIDATES most likely tokens of the flat row.
    _, q = draw_drafts(flat, params, mx.random.key(0))
    q = np.array(q, dtype=np.float64)[0]
    assert set(np.flatnonzero(q)) == set(np.argsort(-np.array(flat)[0])[:TOP_P_CANDIDATES])
    draws = draw_drafts(mx.tile(flat, (4000, 1)), params, mx.random.key(4))[0]  # (4000 rows at once)
    counts = np.bincount(np.array(draws), minlength=1000).astype(float)
    assert chi_square(counts, q) < chi2_critical(ALPHA, TOP_P_CANDIDATES - 1)


def test_seeded_sampling_is_reproducible_and_mtp_matches_distribution(dense_ckpt: Path) -> None:
    engine = local_engine(dense_ckpt, dtype=mx.float32)
    prompt = engine.tokenizer.encode("def main():\n")
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=42)
    a = engine.complete(GenerationRequest(prompt, max_tokens=24, params=params, mtp_depth=2))
    b = engine.complete(GenerationRequest(prompt, max_tokens=24, params=params, mtp_depth=2))
    assert a.tokens == b.tokens
    other = SamplingParams(temperature=0.8, top_p=0.95, seed=43)
    assert engine.complete(GenerationRequest(prompt, max_tokens=24, params=other, mtp_depth=2)).tokens != a.tokens

    # The distribution: tokens from speculative decoding (depth 2: accepted drafts and, on a rejection,
    # draws from the residual) against plain sampling from the model. Seeded, so this is the
    # Gumbel-max path (acceptance.py); the unseeded rule is checked above on fixed rows and below end
    # to end. The requests run as rows of batches, eight at a time; a seeded request's tokens do not
    # depend on the batch around it, so the per-sequence engine gives the same (checked on two of them
    # here, and in test_seeded_tokens_do_not_depend_on_depth_or_batch).
    from mtpipe.coordinator.engine.build import batch_engine

    params = [SamplingParams(temperature=0.5, top_p=0.95, seed=seed) for seed in range(20)]
    batch = batch_engine(dense_ckpt, dtype=mx.float32)
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(batch.complete, pit_requests(prompt, params)))
    finally:
        batch.close()
    assert [engine.complete(r).tokens for r in pit_requests(prompt, params[:2])] == [r.tokens for r in results[:2]]
    assert_plain_sampling(dense_ckpt, prompt, results, 0.5, 0.95)


PIT_TOKENS, PIT_BINS = 64, 10  # (12 to 20 requests: 768 to 1280 tokens, with the suite's time in mind)


def pit_requests(prompt: list[int], params: list[SamplingParams]) -> list[GenerationRequest]:
    """Depth 2, PIT_TOKENS tokens each, EOS ignored: every request yields all its tokens (stopping at EOS
    would condition the last ones on not being EOS)."""
    return [GenerationRequest(prompt, max_tokens=PIT_TOKENS, params=p, mtp_depth=2, ignore_eos=True) for p in params]


def assert_plain_sampling(ckpt: Path, prompt: list[int], results: list, temperature: float, top_p: float) -> None:
    """The results' tokens are plain samples of the model at `temperature` and `top_p`, computed here
    without the stage or the acceptance code. Each emitted token's randomized probability integral
    transform (PIT) under the plain distribution given the tokens before it is U(0, 1), independently
    of the others, exactly when the sampler draws every token from that distribution; a chi-square
    test over PIT_BINS equal bins checks the PITs' uniformity (critical value 27.9 at ALPHA)."""
    model = load_shard(ckpt, dtype=mx.float32).model
    pit_rng = np.random.default_rng(0)
    pits: list[float] = []
    drafted = accepted = 0
    for r in results:
        assert len(r.tokens) == PIT_TOKENS
        drafted, accepted = drafted + r.stats.drafted, accepted + r.stats.accepted
        target = plain_sampling_probs(model, prompt + r.tokens[:-1], temperature, top_p)[len(prompt) - 1 :]
        for row, token in zip(target, r.tokens):
            assert row[token] > 0, "a token outside the filtered distribution was emitted"
            pits.append(randomized_pit(row, token, pit_rng.random()))
    assert 0.1 < accepted / drafted < 0.9  # both paths made tokens: accepted drafts and residual draws
    counts = np.bincount(np.minimum((np.array(pits) * PIT_BINS).astype(int), PIT_BINS - 1), minlength=PIT_BINS)
    assert chi_square(counts, np.full(PIT_BINS, 1 / PIT_BINS)) < chi2_critical(ALPHA, PIT_BINS - 1)


@pytest.mark.parametrize("kind", ["single", "batch"])
def test_unseeded_tokens_are_plain_samples_with_drafts_drawn_on_the_device(
        dense_ckpt: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unseeded request's drafts are drawn on the device (device_sampling.py: top_p over the most
    likely tokens only, from a draft vocabulary of DRAFT_VOCAB tokens) and the next verify is queued on
    them still lazy, then taken; its tokens are still plain samples. Through the per-sequence stage,
    and as rows of a batch (four at a time) beside rows of other kinds: a seeded one (whose drafts the
    host draws) and a greedy one, which decode what they decode alone, and unseeded ones with other
    filters and a logit bias."""
    from mtpipe.coordinator.engine.build import batch_engine
    from mtpipe.node import batch_head, head, stage
    from mtpipe.node.batch import BatchStage

    entropy = itertools.count(1)  # each request's RNG and device keys, reproducibly
    real_seed_sequence = np.random.SeedSequence
    monkeypatch.setattr(np.random, "SeedSequence", lambda *a: real_seed_sequence(*a) if a else
                        SimpleNamespace(entropy=next(entropy)))
    draws, lazy, rounds, taken = [0], [], [0], [0]
    for module in (head, batch_head):
        monkeypatch.setattr(module, "draw_drafts", counted(module.draw_drafts, draws))
    verify_one, verify_rows = stage.StageWorker._issue_verify, BatchStage._issue_verify
    run, decide = head.Head.run, batch_head.BatchHead.decide

    def spy_verify_rows(self: BatchStage, out: list, drafts: mx.array) -> None:
        lazy.append(all(not d.drafts for d in self.head.states))  # the host has not read them yet
        verify_rows(self, out, drafts)

    def spy_head(fn: Any) -> Any:
        def wrapper(self: Any, *args: Any, prepared: Any = None, **kwargs: Any) -> Any:
            rounds[0] += 1
            taken[0] += prepared is not None
            return fn(self, *args, prepared=prepared, **kwargs)

        return wrapper

    monkeypatch.setattr(stage.StageWorker, "_issue_verify",
                        lambda self, seq, out, drafts: (lazy.append(drafts is not None), verify_one(self, seq, out, drafts)))
    monkeypatch.setattr(BatchStage, "_issue_verify", spy_verify_rows)
    monkeypatch.setattr(head.Head, "run", spy_head(run))
    monkeypatch.setattr(batch_head.BatchHead, "decide", spy_head(decide))

    temperature, top_p = 0.5, 0.95
    # (a row alone costs a forward per round, rows of a batch share one: fewer tokens alone, for the suite's time)
    params = [SamplingParams(temperature=temperature, top_p=top_p) for _ in range(12 if kind == "single" else 20)]
    alone = local_engine(dense_ckpt, dtype=mx.float32, draft_vocab=DRAFT_VOCAB)
    prompt = alone.tokenizer.encode("def main():\n")
    if kind == "single":
        results = [alone.complete(r) for r in pit_requests(prompt, params)]
    else:
        others = [GenerationRequest(prompt, max_tokens=40, params=SamplingParams(temperature=0.8, seed=5), mtp_depth=3),
                  GenerationRequest(prompt, max_tokens=40, mtp_depth=3),
                  GenerationRequest(prompt, max_tokens=40, params=SamplingParams(temperature=1.0), mtp_depth=1),
                  GenerationRequest(prompt, max_tokens=40, mtp_depth=2,
                                    params=SamplingParams(temperature=0.9, top_k=20, logit_bias=((7, 1.5),)))]
        expected = [alone.complete(r).tokens for r in others[:2]]
        lazy.clear()
        draws[0] = rounds[0] = taken[0] = 0  # (counted in the batch only)
        engine = batch_engine(dense_ckpt, dtype=mx.float32, draft_vocab=DRAFT_VOCAB)
        try:
            with ThreadPoolExecutor(4) as pool:
                done = list(pool.map(engine.complete, [*others, *pit_requests(prompt, params)]))
        finally:
            engine.close()
        results = done[len(others):]
        assert [r.tokens for r in done[:2]] == expected
    assert draws[0] >= rounds[0] // 2  # (a call per draft step, of a row alone or of the rows of a batch)
    assert len(lazy) >= rounds[0] // 2 and all(lazy)  # next verifies queued on the drafts still lazy
    assert taken[0] >= rounds[0] // 2  # and taken by the round after
    assert_plain_sampling(dense_ckpt, prompt, results, temperature, top_p)


DRAFT_VOCAB = 256  # of the tiny checkpoints' 512 tokens


def counted(fn: Any, calls: list[int]) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return fn(*args, **kwargs)

    return wrapper


def plain_sampling_probs(model, tokens: list[int], temperature: float, top_p: float) -> np.ndarray:
    """[len(tokens), V]: the plain-sampling distribution of the token after each prefix of `tokens`.
    One forward over the whole sequence from an empty cache; softmax at `temperature`; top_p keeps
    the most likely tokens while the mass above each is below top_p; renormalised."""
    h, _ = model.run_layers(model.embed(mx.array([tokens])), model.make_cache())
    logits = np.array(model.lm_logits(model.final_norm(h))[0].astype(mx.float32), dtype=np.float64)
    z = logits / temperature
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    for row in p:
        order = np.argsort(-row, kind="stable")
        above = np.cumsum(row[order]) - row[order]
        row[order[above >= top_p]] = 0.0
        row /= row.sum()
    return p


def randomized_pit(row: np.ndarray, token: int, u: float) -> float:
    """The token's place in `row` (most likely tokens first): F(before token) + u * p(token). U(0, 1)
    when the token is drawn from `row` and u ~ U(0, 1)."""
    order = np.argsort(-row, kind="stable")
    before = row[order[: int(np.flatnonzero(order == token)[0])]].sum()
    return float(before + u * row[token])


def test_seeded_first_token_distribution_matches_target() -> None:
    """Gumbel-max picks keyed by (seed, position, token): over seeds, the emitted token follows p."""
    p = np.array([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.1, 0.2, 0.3, 0.3]])
    q = np.array([0.1, 0.6, 0.1, 0.1, 0.1])
    counts, accepted = np.zeros(5), 0
    for seed in range(20000):
        n, tokens = accept_coupled(p, [gumbel_pick(q, seed, 9)], seed, 9)
        counts[tokens[0]] += 1
        accepted += n
    assert chi_square(counts, p[0]) < chi2_critical(ALPHA, 4)
    assert accepted > 0.3 * 20000  # sum(min(p, q)) = 0.45 with the min(1, p/q) rule


def test_seeded_picks_accept_iff_the_target_picks_the_draft() -> None:
    """A position's token is its pick with that position's noise, whatever was drafted before it."""
    p = np.array([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6], [0.1, 0.1, 0.8]])
    for seed in range(200):
        alone = [gumbel_pick(p[i], seed, 40 + i) for i in range(3)]
        for drafts in ([], [0], [1, 2], [alone[0], 0], alone[:2]):
            n, tokens = accept_coupled(p[: len(drafts) + 1], drafts, seed, 40)
            assert tokens == alone[: len(tokens)] and tokens[:n] == drafts[:n]
            assert n == len(drafts) or tokens[n] != drafts[n]
    assert gumbel_pick(np.array([0.0, 1.0, 0.0]), 1, 2) == 1  # never a token outside the support


def test_rows_filtered_together_get_what_each_row_gets_alone() -> None:
    """A batch's rows without drafts that draw on the host get their probabilities in one pass: the
    same numbers, bit for bit, as row by row, tokens outside a row's support (top_k, min_p) included."""
    rng = np.random.default_rng(3)
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
                   SamplingParams(temperature=1.2, top_k=5, min_p=0.05)):
        logits = mx.array((4 * rng.standard_normal((6, 2, 300))).astype(np.float32))
        together = filtered_probs(logits[mx.array([0, 2, 3, 5]), 0], params)
        alone = np.stack([filtered_probs(logits[i, 0], params) for i in (0, 2, 3, 5)])
        assert np.array_equal(together, alone) and (params.top_k == 0 or (together == 0).any())


def test_seeded_tokens_do_not_depend_on_depth_or_batch(dense_ckpt: Path) -> None:
    """The same seeded request gives the same tokens at every depth, auto included, and in a batch."""
    from mtpipe.coordinator.engine.build import batch_engine

    engine = local_engine(dense_ckpt, dtype=mx.float32)
    prompts = [engine.tokenizer.encode(t) for t in ("def main():\n", "import os\n")]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    reqs = [GenerationRequest(p, max_tokens=32, params=params, mtp_depth=k, mtp_auto=auto)
            for p in prompts for k, auto in ((0, False), (1, False), (3, False), (3, True))]
    results = [engine.complete(r) for r in reqs]
    for i in range(len(prompts)):
        mine = results[4 * i : 4 * i + 4]
        assert all(r.tokens == mine[0].tokens for r in mine) and any(r.stats.accepted for r in mine)
    batch = batch_engine(dense_ckpt, dtype=mx.float32)
    try:
        with ThreadPoolExecutor(len(reqs)) as pool:  # all at once: rows of the same rounds
            assert [r.tokens for r in pool.map(batch.complete, reqs)] == [r.tokens for r in results]
    finally:
        batch.close()


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(temperature=float("nan")), dict(temperature=float("inf")),
                                 dict(temperature=1e-320), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                 dict(min_p=2.0)])
def test_invalid_sampling_params(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad).validate()
