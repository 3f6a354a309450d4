"""After commit(n), every cache equals the cache of a fresh forward over the accepted tokens."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from mtpipe.coordinator.engine.engine import Engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.coordinator.pipeline.local import LocalPipeline
from mtpipe.models.loading import load_shard
from mtpipe.node.protocol import StepKind, StepRequest
from mtpipe.node.stage import StageWorker

K = 3
TOL = 1e-5


def prefill(worker: StageWorker, seq: str, prompt: list[int], depth: int, split: int | None = None):
    """Two prefill steps, split before the last token unless told where."""
    split = len(prompt) - 1 if split is None else split
    worker.step(StepRequest(seq, 0, StepKind.PREFILL, prompt[:split], mtp_depth=depth))
    return worker.step(StepRequest(seq, 1, StepKind.PREFILL, prompt[split:], final=True))


def max_diff(a: mx.array, b: mx.array) -> float:
    assert a.shape == b.shape
    return mx.abs(a - b).max().item()


def assert_caches_equal(got, ref) -> None:
    for i, (c, r) in enumerate(zip(got, ref)):
        if hasattr(c, "offset"):
            assert c.offset == r.offset, f"layer {i} KV length"
            assert max_diff(c.keys[..., : c.offset, :], r.keys[..., : r.offset, :]) <= TOL
            assert max_diff(c.values[..., : c.offset, :], r.values[..., : r.offset, :]) <= TOL
        else:
            assert max_diff(c[0], r[0]) <= TOL, f"layer {i} conv state"
            assert max_diff(c[1], r[1]) <= TOL, f"layer {i} recurrent state"


@pytest.mark.parametrize("overlap", [True, False])
def test_a_prompt_chunk_after_the_final_one_is_refused_and_changes_nothing(dense_ckpt: Path, dense_engine,
                                                                           overlap: bool) -> None:
    """A PREFILL after the prompt's final step (before any decode) is refused, and the sequence goes on
    as if it had never come: its first decode gives what an untouched one gives."""
    from mtpipe.node.protocol import StageError

    shard = load_shard(dense_ckpt, dtype=mx.float32)
    prompt = dense_engine.tokenizer.encode("def parse(line):\n    return line.split(")
    outs = []
    for poke in (False, True):
        worker = StageWorker(shard, overlap=overlap)
        first = prefill(worker, "s", prompt, 2)
        seq = worker.sequences["s"]
        before = (seq.position, seq.next_step, seq.lookahead, [getattr(c, "offset", None) for c in seq.cache])
        if poke:
            with pytest.raises(StageError, match="after the prompt's final step"):
                worker.step(StepRequest("s", 2, StepKind.PREFILL, [5, 6]))
        assert (seq.position, seq.next_step, seq.lookahead, [getattr(c, "offset", None) for c in seq.cache]) == before
        outs.append(worker.step(StepRequest("s", 2, StepKind.DECODE, first.tokens + first.drafts)).tokens)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("accepted", list(range(K + 1)))
def test_commit_equals_fresh_forward(ckpt: Path, dense_engine, accepted: int) -> None:
    shard = load_shard(ckpt, dtype=mx.float32)
    worker = StageWorker(shard, overlap=False)  # the commit is applied here, by hand, below
    prompt = dense_engine.tokenizer.encode("def parse(line):\n    return line.split(")
    plain = Engine(LocalPipeline([StageWorker(shard)]), dense_engine.tokenizer, set(), 4096)
    greedy = plain.complete(GenerationRequest(prompt, max_tokens=K + 2)).tokens
    y = greedy[0]
    out = prefill(worker, "s", prompt, K)
    assert out.tokens == [y]
    # Force the drafts: the first `accepted` follow the greedy path, the next one does not.
    V = shard.config.args.vocab_size
    drafts = greedy[1 : 1 + accepted] + [(greedy[1 + accepted] + 1) % V] + [7] * K
    seq = worker.sequences["s"]
    seq.draft.drafts = drafts[:K]
    out = worker.step(StepRequest("s", 2, StepKind.DECODE, [y] + drafts[:K]))
    assert out.accepted == accepted and out.commit.trim == K - accepted
    assert out.tokens == greedy[1 : accepted + 2]
    worker._apply_commit(seq, out.commit)

    # Reference: a fresh stage fed prompt + [y, d1..dn], then the correction token sampled the same way.
    # Its prompt chunk is the one above, so the positions after it run the recurrence stepped as a
    # verify does (a longer prefill chunk runs it chunked: the same arithmetic in another order).
    fresh = StageWorker(shard, overlap=False)
    ref_out = prefill(fresh, "r", prompt + greedy[: accepted + 1], K, split=len(prompt) - 1)
    assert ref_out.tokens == out.tokens[-1:]
    ref = fresh.sequences["r"]
    assert seq.position == ref.position == len(prompt) + accepted + 1
    assert_caches_equal(seq.cache, ref.cache)
    # MTP cache: entries built from true hiddens agree; the next drafts agree too.
    d, rd = seq.draft, ref.draft
    assert d.mtp_len == rd.mtp_len == len(prompt) + accepted + 1
    n = d.mtp_len
    assert max_diff(d.mtp_cache.keys[..., :n, :], rd.mtp_cache.keys[..., :n, :]) <= TOL
    assert max_diff(d.mtp_cache.values[..., :n, :], rd.mtp_cache.values[..., :n, :]) <= TOL
    assert out.drafts == ref_out.drafts


@pytest.mark.parametrize("which", ["dense", "demo"])
def test_queued_rounds_match_rounds_run_on_request(dense_ckpt: Path, which: str) -> None:
    """A single stage applies a round's commit as soon as it decides it and queues the next verify. Round
    after round its outputs equal those of a stage that applies each commit when the next request brings
    it (the path the test above checks against a fresh forward), and so do its caches and snapshots."""
    from mtpipe.models.registry import DEMO_MODEL

    shard = load_shard(dense_ckpt if which == "dense" else DEMO_MODEL, dtype=mx.float32)
    queued, reference = StageWorker(shard), StageWorker(shard, overlap=False)
    issue, lazy = queued._issue_verify, []

    def issued(seq, out, drafts):  # each verify is queued behind its drafts, before the host reads them
        lazy.append(drafts is not None and out.drafts == [])
        issue(seq, out, drafts)

    queued._issue_verify = issued
    prompt = list(range(3, 40))
    out = prefill(queued, "s", prompt, K)
    assert prefill(reference, "s", prompt, K) == out
    trims = 0
    for step in range(2, 10):
        req = StepRequest("s", step, StepKind.DECODE, out.tokens[-1:] + out.drafts, commit=out.commit)
        out = queued.step(req)
        assert reference.step(req) == out
        trims += out.commit.trim > 0
    q, r = queued.sequences["s"], reference.sequences["s"]
    assert q.early_commit == out.commit and q.lookahead is not None and trims > 0
    assert len(lazy) >= 8 and all(lazy)
    nxt = StepRequest("s", 10, StepKind.DECODE, out.tokens[-1:] + out.drafts, commit=out.commit)
    reference.step(nxt)  # now both hold round 10's verify, its commit not yet applied
    assert q.position + len(nxt.tokens) == r.position
    assert_caches_equal(q.cache, r.cache)
    for i, snap in r.snapshots.items():
        for a, b in zip(q.lookahead[1][i].states, snap.states):
            assert max_diff(a, b) <= TOL


def test_rounds_without_drafts_keep_their_queuing_time(dense_ckpt: Path) -> None:
    """A round without drafts of a sequence that may draft (auto at depth 0) queues the next round on its
    token: that time is charged to the next round, never taken off this round's drafting time."""
    shard = load_shard(dense_ckpt, dtype=mx.float32)
    worker = StageWorker(shard)
    out = prefill(worker, "s", list(range(3, 40)), K)
    d = worker.sequences["s"].draft
    d.depth = 0
    queued = []
    for step in range(2, 8):
        out = worker.step(StepRequest("s", step, StepKind.DECODE, out.tokens[-1:] + out.drafts, commit=out.commit))
        assert d.draft_seconds >= 0 and not out.drafts
        queued.append(d.ahead_done)
    assert all(q > 0 for q in queued[1:])  # every round after the one that verified the prompt's drafts


@pytest.mark.parametrize("positions", [[2, 2, 2], [0, 3, 3, 1], [3, 0, 0, 0, 2]])
def test_batch_rows_take_their_own_positions_states(positions: list[int]) -> None:
    """A batch's rows each get exactly the state and conv window their own snapshot has at their
    position, whether rows share positions (sliced together) or not."""
    from mlx_lm.models.cache import ArraysCache

    from mtpipe.models.gdn_snapshots import GDNSnapshots
    from mtpipe.models.ragged import restore_rows

    B, T, kernel = len(positions), 4, 4
    snaps = GDNSnapshots(conv_input=mx.random.normal((B, kernel - 1 + T, 8)),
                         states=[mx.random.normal((B, 2, 3, 5)) for _ in range(T)], kernel=kernel)
    batch = ArraysCache(size=2)
    restore_rows(snaps, batch, positions)
    for i, p in enumerate(positions):
        row = GDNSnapshots(snaps.conv_input[i : i + 1], [s[i : i + 1] for s in snaps.states], kernel)
        alone = ArraysCache(size=2)
        row.restore(alone, p)
        assert mx.array_equal(batch[1][i : i + 1], alone[1]) and mx.array_equal(batch[0][i : i + 1], alone[0]), (i, p)
    assert batch[0].shape == (B, kernel - 1, 8) and batch[1].shape == (B, 2, 3, 5)
