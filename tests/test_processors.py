"""Logits processors and logprobs inside the verify: exact whatever the MTP depth, alone or in a batch."""

from __future__ import annotations

import functools
import queue
from collections import Counter
from itertools import pairwise
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtpipe.coordinator.engine.batch import END, BatchEngine
from mtpipe.coordinator.engine.build import batch_engine, local_engine
from mtpipe.coordinator.engine.request import GenerationRequest, RequestError
from mtpipe.node import processors
from mtpipe.node.processors import REPETITION_CONTEXT, History, apply, logprob_table, read_logprobs
from mtpipe.node.protocol import SamplingParams

DEPTHS = [(0, False), (1, False), (2, False), (3, False), (3, True)]
PROCESSED = [
    SamplingParams(presence_penalty=0.9, frequency_penalty=0.4),
    SamplingParams(repetition_penalty=1.5),
    SamplingParams(logit_bias=((5, 4.0), (7, -100.0)), presence_penalty=0.3, top_logprobs=3),
]


def reference(logits: np.ndarray, params: SamplingParams, history: History, drafts: list[int]) -> np.ndarray:
    """The processors one position at a time, written plainly."""
    out = logits.astype(np.float64).copy()
    for j in range(out.shape[0]):
        recent = (history.recent + drafts[:j])[-REPETITION_CONTEXT:]
        for t in set(recent):
            if params.repetition_penalty != 1.0:
                v = out[j, t]
                out[j, t] = v / params.repetition_penalty if v > 0 else v * params.repetition_penalty
        for t, n in Counter(history.generated + drafts[:j]).items():
            out[j, t] -= params.presence_penalty + params.frequency_penalty * n
        for t, b in params.logit_bias:
            out[j, t] += b
    return out


def test_apply_matches_position_by_position_reference() -> None:
    rng = np.random.default_rng(0)
    V, K = 12, 3
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=0.2, repetition_penalty=1.3,
                            logit_bias=((2, 1.5), (9, -3.0)))
    history = History()
    history.extend_prompt([1, 2, 3, 3])
    history.emit([4, 4, 2])
    drafts = [4, 9, 11]
    raw = rng.normal(size=(2, K + 1, V)).astype(np.float32)
    got = np.array(apply(mx.array(raw), [(1, params, history, drafts)]))
    np.testing.assert_allclose(got[1], reference(raw[1], params, history, drafts), atol=1e-5)
    np.testing.assert_array_equal(got[0], raw[0])  # a row without processors is untouched


def test_apply_round_after_round_matches_reference() -> None:
    """The additive rules are folded into a row kept across rounds: after every round's tokens, each
    row of a batch (different rules each) still matches the plain reference."""
    rng = np.random.default_rng(2)
    V, K = 16, 3
    rows = [(0, SamplingParams(logit_bias=((3, 2.0),)), History()),
            (1, SamplingParams(presence_penalty=0.6, frequency_penalty=0.3, repetition_penalty=1.2,
                               logit_bias=((1, -1.0),)), History()),
            (2, SamplingParams(repetition_penalty=1.4), History()),  # beside the additive rows
            (3, SamplingParams(frequency_penalty=0.5), History(generated_from=2))]  # resumed: its prompt's
    for _, _, history in rows:  # tokens from position 2 on were generated, and are penalized
        history.extend_prompt([1, 2, 2])
    assert rows[3][2].generated == [2]
    for _ in range(12):
        drafts = [[int(t) for t in rng.integers(0, V, size=int(rng.integers(0, K + 1)))] for _ in rows]
        raw = rng.normal(size=(len(rows), K + 1, V)).astype(np.float32)
        got = np.array(apply(mx.array(raw), [(b, p, h, d) for (b, p, h), d in zip(rows, drafts)]))
        for (b, params, history), d in zip(rows, drafts):
            n = len(d) + 1
            np.testing.assert_allclose(got[b, :n], reference(raw[b, :n], params, history, d), atol=1e-5)
            history.emit([int(t) for t in rng.integers(0, 4, size=int(rng.integers(1, K + 2)))])  # repeats


@pytest.mark.parametrize("host", [True, False], ids=["on-host", "on-device"])
def test_logprobs_are_sorted_and_consistent(host: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same whether the table is computed on the device (a GPU) or on the host (the CPU backend)."""
    monkeypatch.setattr(processors, "on_host", lambda: host)
    rng = np.random.default_rng(1)
    raw = rng.normal(size=(2, 3, 20)).astype(np.float32)
    tokens = [[int(np.argmax(raw[0, 0])), 4, 7], [3]]
    # rows of one batch read together, each with its own number of top tokens and emitted positions
    out = read_logprobs(logprob_table(mx.array(raw), 5), [(0, tokens[0], 5), (1, tokens[1], 2)])
    ref = raw - np.log(np.exp(raw).sum(axis=-1, keepdims=True))
    assert [len(o) for o in out] == [3, 1]
    # a table of only the rows that report gives the same, read by batch row
    assert read_logprobs(logprob_table(mx.array(raw), 2, rows=[1]), [(1, tokens[1], 2)]) == out[1:]
    for b, top in ((0, 5), (1, 2)):
        for (lp, best), row, t in zip(out[b], ref[b], tokens[b]):
            assert abs(lp - row[t]) < 1e-5
            assert [i for i, _ in best] == list(np.argsort(-row, kind="stable")[:top])
            assert all(x[1] >= y[1] for x, y in pairwise(best))
    assert out[0][0][1][0][0] == tokens[0][0] and abs(out[0][0][1][0][1] - out[0][0][0]) < 1e-6
    [[(lp, best)]] = read_logprobs(logprob_table(mx.array(raw), 0), [(1, [2], 0)])  # no top tokens asked
    assert best == [] and abs(lp - ref[1, 0, 2]) < 1e-5


@pytest.fixture(scope="module")
def engines(dense_ckpt: Path) -> tuple[BatchEngine, BatchEngine]:
    one, two = batch_engine(dense_ckpt, dtype=mx.float32), batch_engine(dense_ckpt, stages=2, dtype=mx.float32)
    yield one, two
    one.close()
    two.close()


def prompt(engine: BatchEngine) -> list[int]:
    return list(engine.tokenizer.encode("def add(a, b):\n    return a"))


@pytest.mark.parametrize("params", PROCESSED, ids=["presence+frequency", "repetition", "bias+logprobs"])
def test_greedy_identical_whatever_the_depth(engines: tuple[BatchEngine, BatchEngine], dense_ckpt: Path,
                                             params: SamplingParams) -> None:
    one, two = engines
    p = prompt(one)
    n = 48  # long enough that the greedy decode repeats itself, for the penalties to act on
    plain = one.complete(GenerationRequest(p, max_tokens=n)).tokens
    base = one.complete(GenerationRequest(p, max_tokens=n, params=params))
    assert base.tokens != plain  # the processors change what a greedy decode emits
    # The per-sequence head processes the same way, at every depth.
    per_sequence = local_engine(dense_ckpt, dtype=mx.float32)
    for depth, auto in DEPTHS:
        r = per_sequence.complete(GenerationRequest(p, n, params, mtp_depth=depth, mtp_auto=auto))
        assert r.tokens == base.tokens, ("per-sequence", depth, auto)
    # Rows of every depth at once, in one stage and over two: each row's processors see its own tokens only.
    for engine in (one, two):
        rows = collect(engine, [GenerationRequest(p, max_tokens=n, params=params, mtp_depth=depth, mtp_auto=auto)
                                for depth, auto in DEPTHS])
        assert [tokens for tokens, _ in rows] == [base.tokens] * len(DEPTHS)


def collect(engine: BatchEngine, reqs: list[GenerationRequest]) -> list[tuple[list[int], list]]:
    sinks = [queue.SimpleQueue() for _ in reqs]
    for r, s in zip(reqs, sinks):
        engine.open(r, s.put)
    out = []
    for s in sinks:
        tokens, lps = [], []
        while (item := s.get(timeout=120)) is not END:
            assert not isinstance(item, BaseException), item
            tokens += item.tokens
            lps += item.logprobs or []
        out.append((tokens, lps))
    return out


def test_logprobs_equal_across_depths_in_a_mixed_batch(engines: tuple[BatchEngine, BatchEngine]) -> None:
    one, two = engines
    p = prompt(one)
    asked = SamplingParams(top_logprobs=4)
    ref_tokens, ref_lps = collect(one, [GenerationRequest(p, max_tokens=16, params=asked)])[0]
    assert len(ref_lps) == len(ref_tokens)
    for tok, (lp, top) in zip(ref_tokens, ref_lps):
        assert top[0][0] == tok and abs(top[0][1] - lp) < 1e-6  # greedy: the emitted token is the most likely
    for engine in (one, two):
        reqs = [GenerationRequest(p, max_tokens=16, params=asked, mtp_depth=d, mtp_auto=a) for d, a in DEPTHS]
        reqs += [GenerationRequest(p[:5], max_tokens=16, params=PROCESSED[0], mtp_depth=2),  # rows without logprobs
                 GenerationRequest(p, max_tokens=16, mtp_depth=3)]
        results = collect(engine, reqs)
        for tokens, lps in results[: len(DEPTHS)]:
            assert tokens == ref_tokens
            for (lp, top), (rlp, rtop) in zip(lps, ref_lps):
                assert abs(lp - rlp) <= 1e-5 and [i for i, _ in top] == [i for i, _ in rtop]
                assert max(abs(a - b) for (_, a), (_, b) in zip(top, rtop)) <= 1e-5
        assert results[-1][1] == []  # nobody asked: nothing computed or sent


def test_bad_processor_values_are_refused(engines: tuple[BatchEngine, BatchEngine]) -> None:
    one, _ = engines
    p = prompt(one)
    for params, field in [(SamplingParams(presence_penalty=3.0), "presence_penalty"),
                          (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
                          (SamplingParams(logit_bias=((10**6, 1.0),)), "logit_bias"),
                          (SamplingParams(top_logprobs=21), "top_logprobs")]:
        with pytest.raises(RequestError) as e:
            one.open(GenerationRequest(p, max_tokens=4, params=params), lambda item: None)
        assert e.value.param == field
    assert one.complete(GenerationRequest(p, max_tokens=4)).tokens  # still serving


def test_per_sequence_engine_checks_logit_bias_ids(dense_ckpt: Path) -> None:
    engine = local_engine(dense_ckpt, dtype=mx.float32)
    p = list(engine.tokenizer.encode("x = 1"))
    with pytest.raises(RequestError) as e:
        engine.validate(GenerationRequest(p, max_tokens=4, params=SamplingParams(logit_bias=((10**6, 1.0),))))
    assert e.value.param == "logit_bias"
    engine.validate(GenerationRequest(p, max_tokens=4, params=SamplingParams(logit_bias=((3, 1.0),))))


def test_logprobs_of_reporting_rows_of_bfloat16_logits_agree_on_host_and_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A table holds only the rows that report; the host reads logits of a model's own dtype as float32."""
    rng = np.random.default_rng(3)
    raw = np.stack([rng.permutation(50) / 8 for _ in range(12)]).reshape(3, 4, 50)  # distinct, exact in bf16
    logits = mx.array(raw).astype(mx.bfloat16)
    asks = [(0, [1, 2], 3), (2, [5, 6, 7, 8], 0)]
    got = {}
    for host in (True, False):
        monkeypatch.setattr(processors, "on_host", lambda host=host: host)
        table = logprob_table(logits, 3, rows=[0, 2])
        assert table.on_host == host and table.lp.shape[0] == 2
        got[host] = read_logprobs(table, asks)
    ref = raw - np.log(np.exp(raw).sum(axis=-1, keepdims=True))
    for (b, tokens, top), on_host, on_device in zip(asks, got[True], got[False]):
        for j, ((lp, best), (lp_d, best_d)) in enumerate(zip(on_host, on_device)):
            assert lp == pytest.approx(ref[b, j, tokens[j]], abs=1e-5) and lp_d == pytest.approx(lp, abs=1e-5)
            assert [i for i, _ in best] == [i for i, _ in best_d] == list(np.argsort(-raw[b, j])[:top])


@pytest.mark.parametrize("depth", [0, 3])  # (auto: the two stages would time and choose depths apart)
def test_processed_rounds_are_queued_ahead_and_match(dense_ckpt: Path, depth: int) -> None:
    """A single stage queues a processed greedy sequence's next round as soon as the tokens before it
    are known (its penalties depend on them); round after round its tokens, logprobs and commits equal
    those of a stage that runs each round when it is asked for."""
    from mtpipe.models.loading import load_shard
    from mtpipe.node.protocol import StepKind, StepRequest
    from mtpipe.node.stage import StageWorker

    shard = load_shard(dense_ckpt, dtype=mx.float32)
    queued, reference = StageWorker(shard), StageWorker(shard, overlap=False)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.3,
                            logit_bias=((5, 0.5),), top_logprobs=3)
    req = StepRequest("s", 0, StepKind.PREFILL, list(range(3, 30)), final=True, params=params, mtp_depth=depth)
    out = queued.step(req)
    assert reference.step(req) == out
    for step in range(1, 16):
        req = StepRequest("s", step, StepKind.DECODE, out.tokens[-1:] + out.drafts, commit=out.commit)
        out = queued.step(req)
        assert reference.step(req) == out and out.logprobs
        assert queued.sequences["s"].lookahead is not None  # the next round is computing already
        assert reference.sequences["s"].lookahead is None


def test_sampled_joint_distribution_with_penalties_matches_plain_sampling() -> None:
    """Tiny vocabulary, logits fixed per position: the first two tokens of a speculative round with a
    presence and frequency penalty (the second position scored as if the draft were accepted) have the
    joint distribution of sampling one token at a time with the penalty."""
    from test_sampling import ALPHA, chi2_critical, chi_square

    from mtpipe.node.acceptance import accept_sampled, draw, filtered_probs

    rng = np.random.default_rng(11)
    base = np.array([[1.0, 0.5, 0.0, -0.5, 0.2], [0.3, 1.2, -0.2, 0.0, 0.4]], dtype=np.float32)
    params = SamplingParams(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.4)
    q0 = np.array([0.1, 0.5, 0.2, 0.1, 0.1])

    @functools.cache  # (the same few cases over and over: each computed once)
    def probs(position: int, generated: tuple[int, ...], drafts: tuple[int, ...]) -> np.ndarray:
        history = History()
        history.emit(list(generated))
        logits = mx.array(base[None, position : position + len(drafts) + 1])
        return filtered_probs(apply(logits, [(0, params, history, list(drafts))])[0], params)

    def target(position: int, generated: list[int], drafts: list[int]) -> np.ndarray:
        return probs(position, tuple(generated), tuple(drafts))

    reference = np.zeros((5, 5))
    p0 = target(0, [], [])[0]
    for a in range(5):
        reference[a] = p0[a] * target(1, [a], [])[0]
    counts = np.zeros((5, 5))
    for _ in range(20000):
        d = draw(q0, rng)
        _, tokens = accept_sampled(target(0, [], [d]), q0[None], [d], rng)
        if len(tokens) < 2:  # rejected: the next round scores position 1 after the corrected token
            tokens = tokens + [draw(target(1, tokens, [])[0], rng)]
        counts[tokens[0], tokens[1]] += 1
    assert chi_square(counts.reshape(-1), reference.reshape(-1)) < chi2_critical(ALPHA, 24)


def test_min_tokens_processes_a_row_only_while_it_holds_an_end_back() -> None:
    """A row with min_tokens is processed (its next round waits for its token) while an end token is
    masked, not for its whole life; with nothing to mask (ignore_eos, no stop ids) never."""
    has_processors = processors.has_processors
    params = SamplingParams(min_tokens=2)
    history = History(ends=frozenset({5}))
    assert has_processors(params) and has_processors(params, history)
    history.emit([1])
    assert has_processors(params, history)
    history.emit([2])
    assert not has_processors(params, history)
    assert not has_processors(params, History())
    assert has_processors(SamplingParams(min_tokens=2, logit_bias=((1, 1.0),)), History())
