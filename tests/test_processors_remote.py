"""Logits processors and logprobs over a pipeline of nodes (gRPC on loopback): the last node applies
them from step 0's parameters and returns the logprobs with its results, rounds it starts itself
included; greedy tokens and logprobs equal the in-process engine's, and nothing extra crosses the
wire when logprobs are not asked for."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import node_servers
from test_pipeline_grpc import accepting_checkpoint

from mtpipe.coordinator.engine.build import batch_engine, local_engine, remote_engine
from mtpipe.coordinator.engine.engine import Engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.node.protocol import SamplingParams
from mtpipe.node.wire import params_from_pb, params_to_pb
from mtpipe.proto import mtpipe_pb2 as pb

TEXT = "def add(a, b):\n    return a"
MAX_TOKENS = 20
PROCESSED = SamplingParams(presence_penalty=0.9, logit_bias=((5, 4.0), (7, -100.0)))


@pytest.fixture(scope="module")
def ckpt(dense_ckpt: Path) -> Path:  # MTP drafts are often accepted: the per-position processing matters
    return accepting_checkpoint(dense_ckpt, dense_ckpt.with_name(dense_ckpt.name + "-accepting"))


@pytest.fixture(scope="module")
def engines(ckpt: Path) -> Iterator[tuple[Engine, Engine]]:
    with node_servers(2) as nodes:
        remote = remote_engine(ckpt, [s.address for s in nodes], dtype="float32")
        try:
            yield local_engine(ckpt, dtype=mx.float32), remote
        finally:
            remote.pipeline.close()


def run(engine: Engine, params: SamplingParams, depth: int, auto: bool = False):
    """Tokens, logprobs and stats of one generation."""
    req = GenerationRequest(engine.tokenizer.encode(TEXT), max_tokens=MAX_TOKENS, params=params,
                            mtp_depth=depth, mtp_auto=auto)
    tokens, lps = [], []
    for chunk in engine.generate(req):
        tokens += chunk.tokens
        lps += chunk.logprobs or []
        stats = chunk.stats
    return tokens, lps, stats


def record_events(engine: Engine) -> list[pb.StepResult]:
    """Every StepResult the coordinator receives from here on, as it came off the wire."""
    pipeline = engine.pipeline
    seen: list[pb.StepResult] = []
    dispatch = pipeline._dispatch

    def recording(event: pb.Event) -> None:
        if event.WhichOneof("kind") == "result":
            copy = pb.StepResult()
            copy.CopyFrom(event.result)
            seen.append(copy)
        dispatch(event)

    pipeline._dispatch = recording
    return seen


def test_sampling_round_trips_the_wire() -> None:
    for p in [SamplingParams(), PROCESSED, SamplingParams(top_logprobs=0, repetition_penalty=1.3, seed=7),
              SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, frequency_penalty=-0.5, top_logprobs=20),
              SamplingParams(min_tokens=3, prompt_logprobs=0)]:
        assert params_from_pb(params_to_pb(p)) == p
    assert not params_to_pb(SamplingParams()).HasField("top_logprobs")  # unset: none asked
    assert params_to_pb(SamplingParams(top_logprobs=0)).HasField("top_logprobs")  # 0: asked, no alternatives


@pytest.mark.parametrize("depth,auto", [(0, False), (2, False), (3, True)], ids=["depth0", "depth2", "auto"])
def test_greedy_with_processors_equals_in_process(engines: tuple[Engine, Engine], depth: int, auto: bool) -> None:
    local, remote = engines
    plain = run(local, SamplingParams(), 0)[0]
    want = run(local, PROCESSED, 0)[0]
    assert want != plain  # the processors change what a greedy decode emits
    got, _, stats = run(remote, PROCESSED, depth, auto)
    assert got == want
    if depth == 2:
        assert stats.drafted > 0 and stats.accepted > 0  # speculation ran, and drafts passed the processed verify


@pytest.mark.parametrize("depth,auto", [(0, False), (3, True)], ids=["depth0", "auto"])
def test_min_tokens_over_nodes(engines: tuple[Engine, Engine], depth: int, auto: bool) -> None:
    """EOS, pushed to the top of every position, is refused on the last node until min_tokens were generated."""
    local, remote = engines
    eos = sorted(local.eos)[0]
    params = SamplingParams(logit_bias=((eos, 100.0),), min_tokens=4)
    want = run(local, params, 0)[0]
    assert len(want) == 5 and eos not in want[:4] and want[4] == eos  # (then the EOS, which ends it)
    assert run(remote, params, depth, auto)[0] == want


@pytest.mark.parametrize("depth", [0, 2])
def test_logprobs_equal_in_process(engines: tuple[Engine, Engine], depth: int) -> None:
    local, remote = engines
    asked = SamplingParams(logit_bias=((5, 2.0),), top_logprobs=3)
    ref_tokens, ref_lps, _ = run(local, asked, 0)
    results = record_events(remote)
    try:
        tokens, lps, _ = run(remote, asked, depth)
    finally:
        del remote.pipeline._dispatch
    assert tokens == ref_tokens and len(lps) == len(tokens) == len(ref_lps)
    for tok, (lp, top), (rlp, rtop) in zip(tokens, lps, ref_lps):
        assert abs(lp - rlp) <= 1e-5
        assert len(top) == 3 and [i for i, _ in top] == [i for i, _ in rtop]
        assert max(abs(a - b) for (_, a), (_, b) in zip(top, rtop)) <= 1e-5
        assert top[0][0] == tok  # greedy: the emitted token is the most likely
    assert all(len(r.logprobs) == len(r.tokens) for r in results)
    # The rounds the last node started itself (ring path) carried theirs too.
    assert any(r.continued for r in results) and all(r.logprobs for r in results if r.tokens)


def test_no_logprobs_on_the_wire_unless_asked(engines: tuple[Engine, Engine]) -> None:
    _, remote = engines
    for params in (SamplingParams(), PROCESSED):
        results = record_events(remote)
        try:
            tokens, lps, _ = run(remote, params, 2)
        finally:
            del remote.pipeline._dispatch
        assert tokens and lps == [] and results
        assert all(len(r.logprobs) == 0 for r in results)


@pytest.mark.parametrize("where", ["in-process", "nodes", "batch"])
def test_drafts_leave_out_what_min_tokens_refuses(engines: tuple[Engine, Engine], ckpt: Path, where: str) -> None:
    """EOS pushed to the top is not drafted before min_tokens (the verify would refuse it): the head drafts
    the token the verify picks instead, so drafts are accepted, and the tokens are those of depth 0."""
    local, remote = engines
    eos = sorted(local.eos)[0]
    params = SamplingParams(logit_bias=((eos, 100.0),), min_tokens=MAX_TOKENS)
    want = run(local, params, 0)[0]
    assert len(want) == MAX_TOKENS and eos not in want
    engine = {"in-process": local, "nodes": remote}.get(where) or batch_engine(ckpt, dtype=mx.float32)
    try:
        got, _, stats = run(engine, params, 2)
    finally:
        if where == "batch":
            engine.close()
    assert got == want
    assert stats.drafted > 0 and stats.accepted > stats.drafted // 2
