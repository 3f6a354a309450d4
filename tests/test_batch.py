"""The batch engine is exact (issue 12): a row's tokens never depend on the rows around it.

Greedy rows give the tokens of the same request run alone through the per-sequence engine, whatever
the batch (1, 3, 8 rows, rows joining mid-flight, mixed prompt lengths and depths, dense and MoE,
1 to 3 stages); the batch's caches after every commit are those of a fresh forward over each row's
accepted tokens; seeded sampled rows draw the same tokens alone or in a batch. And the engine
around the rounds: admission by memory, queue timeouts, cancellation, one MLX thread, refusals.

Engines are built once per module (module-scoped fixture), in float32, with short generations.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from batch_streams import Stream, encode, never_ends, request
from helpers import PROMPTS
from mlx_threads import record_mlx_threads

from mtpipe.coordinator.engine import scheduler as plan
from mtpipe.coordinator.engine.batch import BatchEngine
from mtpipe.coordinator.engine.build import batch_engine, local_engine
from mtpipe.coordinator.engine.engine import Engine
from mtpipe.coordinator.engine.request import GenerationRequest, RequestError
from mtpipe.coordinator.engine.sinks import END, ServerBusy
from mtpipe.models import blas
from mtpipe.models.config import load_config
from mtpipe.models.loading import load_shard
from mtpipe.models.ragged import CAPACITY_STEP, RaggedKV
from mtpipe.node import device_sampling
from mtpipe.node.batch import BatchStage, RowStep
from mtpipe.node.protocol import SamplingParams, StageError, StageUnavailable, StepKind, StepRequest
from mtpipe.node.stage import StageWorker
from mtpipe.node.sysinfo import gpu_limit

NEAR_TIE = 1e-4  # a top-2 logit gap below this may flip under batch arithmetic; above it, never
# Largest cache difference from the unbatched reference (issue 12: 1e-5): 0 exactly on the reference BLAS;
# an optimized BLAS computes a row of a [B, K+1]-row matmul and of a 1-row one differently, up to 4.7e-6
# measured on these random models (fresh_caches follows the path's arithmetic otherwise). Wrong
# positions, trims or restores show up as differences of 0.1 to 3.
CACHE_TOL = 1e-5
PREFILL_CHUNK = 40  # test 2: prompt chunks (the 106-token prompt takes three, long and short ones)
# Prompts of 89 to 113 tokens (the short ones are 6 to 22): prefilled in chunks between decode rounds.
LONG_TEXTS = ["".join(PROMPTS[0:8]), "".join(PROMPTS[8:16]), "".join(PROMPTS[14:22]), "".join(PROMPTS[3:11])]

near_ties: list[str] = []  # divergences at a near-tie, over the whole module


# -- engines, built once -------------------------------------------------------------------------


class Engines:
    """Batch engines per (model, stages), the per-sequence reference engine per model, and what a
    request gives run alone there (cached: several tests ask for the same requests)."""

    def __init__(self, paths: dict[str, Path]):
        self.paths = paths
        self._batch: dict[tuple[str, int], BatchEngine] = {}
        self._local: dict[str, Engine] = {}
        self._alone: dict[tuple, Any] = {}
        self._shards: dict[str, Any] = {}

    def batch(self, model: str, stages: int = 1) -> BatchEngine:
        key = (model, stages)
        if key not in self._batch:
            self._batch[key] = batch_engine(self.paths[model], stages=stages, dtype=mx.float32)
        return self._batch[key]

    def local(self, model: str) -> Engine:
        if model not in self._local:
            self._local[model] = local_engine(self.paths[model], dtype=mx.float32)
        return self._local[model]

    def alone(self, model: str, req: GenerationRequest):
        """The request alone through the per-sequence engine (single stage): its GenerationResult."""
        key = (model, tuple(req.prompt_tokens), req.max_tokens, req.params, req.mtp_depth, req.mtp_auto)
        if key not in self._alone:
            self._alone[key] = self.local(model).complete(req)
        return self._alone[key]

    def top2_gap(self, model: str, tokens: list[int], thread: Any) -> float:
        """Gap between the two largest logits after `tokens`, from a fresh forward of the whole model
        (on the given engine's MLX thread)."""

        def run() -> float:
            if model not in self._shards:
                self._shards[model] = load_shard(self.paths[model], dtype=mx.float32).model
            m = self._shards[model]
            h, _ = m.run_layers(m.embed(mx.array([tokens])), m.make_cache())
            top = mx.sort(m.lm_logits(m.final_norm(h[:, -1:])).reshape(-1))[-2:].tolist()
            return top[1] - top[0]

        return thread.call(run)

    def close(self) -> None:
        for e in self._batch.values():
            e.close()


@pytest.fixture(scope="module")
def engines(dense_ckpt: Path, moe_ckpt: Path):
    e = Engines({"dense": dense_ckpt, "moe": moe_ckpt})
    yield e
    e.close()




# -- 1. greedy rows are the sequence alone ---------------------------------------------------------


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_alone(engines: Engines, model: str, engine: BatchEngine, rows: list[Stream]) -> None:
    """Every row's tokens (and, at a fixed depth, its acceptance) are those of its request alone."""
    for i, s in enumerate(rows):
        got = s.finish()
        alone = engines.alone(model, s.req)
        assert s.chunks[-1].finish_reason in ("stop", "length") and s.stats.generation_tokens == len(got)
        if got != alone.tokens:
            at = first_divergence(got, alone.tokens)
            gap = engines.top2_gap(model, s.req.prompt_tokens + alone.tokens[:at], engine.thread)
            where = f"row {i} (depth {s.req.depth_label}, {len(s.req.prompt_tokens)}-token prompt) at token {at}"
            assert gap < NEAR_TIE, f"{where}: batch {got[at:at + 4]} vs alone {alone.tokens[at:at + 4]}, top-2 gap {gap:.3g}"
            near_ties.append(f"{model} {where}: gap {gap:.3g}")
            continue
        depth = s.req.mtp_depth
        if not s.req.mtp_auto:
            # The batch drafted what the sequence alone drafts: same rounds, same acceptance.
            assert (s.stats.rounds, s.stats.drafted, s.stats.accepted) == (
                alone.stats.rounds, alone.stats.drafted, alone.stats.accepted)
            assert set(s.stats.depths) <= {depth}
        else:
            assert set(s.stats.depths) <= set(range(depth + 1)) and sum(s.stats.depths.values()) == s.stats.rounds


CONFIGS = [("dense", 1), ("moe", 1), ("dense", 2), ("dense", 3), ("moe", 2), ("moe", 3)]


@pytest.mark.parametrize(("model", "stages"), CONFIGS, ids=[f"{m}-{n}stage" for m, n in CONFIGS])
def test_greedy_rows_equal_the_sequence_alone(engines: Engines, model: str, stages: int) -> None:
    engine = engines.batch(model, stages)
    short = [encode(engine, t) for t in PROMPTS]
    long = [encode(engine, t) for t in LONG_TEXTS]
    assert min(len(p) for p in long) >= 89 and max(len(p) for p in short) <= 22
    autos: list[Stream] = []

    # A batch of one: a long prompt, auto depth (the first auto sequence this engine sees).
    one = [Stream(engine, request(long[0], "auto", 32))]
    autos += one
    check_alone(engines, model, engine, one)

    # Three at once: short and long prompts, depths 0, 3 and auto, different lengths to generate.
    three = [Stream(engine, request(short[0], 0, 24)), Stream(engine, request(long[1], 3, 28)),
             Stream(engine, request(short[2], "auto", 32))]
    autos.append(three[2])
    check_alone(engines, model, engine, three)

    # Eight: four start together, two join once those decode, two more (long prompts, prefilled in
    # chunks between rounds) a round later; rows leave at different times (24 to 32 tokens).
    first = [Stream(engine, request(short[3], 0, 32)), Stream(engine, request(short[4], 1, 24)),
             Stream(engine, request(short[5], 2, 28)), Stream(engine, request(short[6], 3, 32))]
    for s in first:
        s.first()
    second = [Stream(engine, request(short[7], "auto", 28)), Stream(engine, request(short[8], 1, 32))]
    second[0].first()
    third = [Stream(engine, request(long[2], 2, 24)), Stream(engine, request(long[3], 0, 32))]
    eight = first + second + third
    autos.append(second[0])
    check_alone(engines, model, engine, eight)
    # The late rows really joined mid-flight: they started decoding while the first wave still did.
    assert all(s.stamps[0] < max(f.ended_at for f in first) for s in second + third)
    assert second[0].stamps[0] < min(f.ended_at for f in first)

    # Auto rows measure every depth on a fresh engine before settling: some rounds carried drafts.
    assert any(set(s.stats.depths) - {0} for s in autos), [s.stats.depths for s in autos]
    assert engine.thread.call(lambda: [st.sequences for st in engine.stages]) == [0] * stages
    print(f"near-ties so far: {len(near_ties)} {near_ties}")
    assert len(near_ties) == 0


# -- 2. the batch's caches after every commit ------------------------------------------------------


@dataclass
class Row:
    seq_id: str
    prompt: list[int]
    depth: int
    reference: list[int]  # the greedy tokens of this prompt (per-sequence engine, no drafts)
    emitted: list[int] = field(default_factory=list)
    next: list[int] = field(default_factory=list)  # the next round's [y, d1..dK]
    twin_step: int = 0
    twin_commit: Any = None


def prefill(step, row: Row, chunk: int = PREFILL_CHUNK):
    """The prompt as BatchEngine._prefill sends it: body chunks, then the last token alone, final;
    step 0 carries the sampling parameters and the depth."""
    body = row.prompt[:-1]
    pieces = [(body[i : i + chunk], False) for i in range(0, len(body), chunk)] + [(row.prompt[-1:], True)]
    out = None
    for n, (tokens, final) in enumerate(pieces):
        out = step(StepRequest(row.seq_id, n, StepKind.PREFILL, tokens, final=final,
                               params=SamplingParams() if n == 0 else None, mtp_depth=row.depth if n == 0 else 0))
    return out, len(pieces)


def fresh_caches(model: Any, prompt: list[int], decoded: list[int], chunk: int = PREFILL_CHUNK) -> list:
    """A single sequence's caches after `prompt` and then `decoded`, on fresh caches. One forward over
    all the tokens differs from the rounds' caches by up to ~2e-5 at the deepest attention layer under
    an optimized BLAS (chunked vs whole prompts, amplified layer after layer), so this forward does the
    arithmetic of the path under test without batching: the prompt in the chunks it was prefilled in,
    then every decoded token alone (T=1 steps: the decode arithmetic)."""
    cache = model.make_cache()
    body = prompt[:-1]
    pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)] + [prompt[-1:]] + [[t] for t in decoded]
    for tokens in pieces:
        h, _ = model.run_layers(model.embed(mx.array([tokens])), cache)
        mx.eval(h, [c.state for c in cache])
    return cache


def max_diff(a: mx.array, b: mx.array) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


def check_caches(stage: BatchStage, rows: dict[str, Row]) -> float:
    """Row i's caches hold its prompt and all its emitted tokens but the last (the next round's
    first input): stage.positions[i] of them. Compare them with a fresh forward over those tokens.
    A next round queued ahead has advanced the caches already: undo it first (its work is lost)."""
    stage.drop_ahead()
    worst = 0.0
    for i, seq_id in enumerate(stage.ids):
        row = rows[seq_id]
        seen = row.prompt + row.emitted
        assert stage.positions[i] == len(seen) - 1
        fresh = fresh_caches(stage.model, row.prompt, row.emitted[:-1])
        for layer, batch, ref in zip(stage.model.layers, stage.cache, fresh):
            if layer.is_linear:  # ArraysCache of the batch: [rows, ...] conv window and recurrent state
                diffs = [max_diff(batch[0][i : i + 1], ref[0]), max_diff(batch[1][i : i + 1], ref[1])]
            else:
                assert isinstance(batch, RaggedKV) and batch.lengths[i] == ref.offset == len(seen) - 1
                keys, values = batch.row(i)
                diffs = [max_diff(keys, ref.keys[:, :, : ref.offset]), max_diff(values, ref.values[:, :, : ref.offset])]
            worst = max(worst, *diffs)
            assert max(diffs) <= CACHE_TOL, f"{seq_id} layer {'GDN' if layer.is_linear else 'attention'}: {diffs}"
    return worst


def test_batch_caches_after_commits_equal_a_fresh_forward(engines: Engines, dense_ckpt: Path) -> None:
    shard = load_shard(dense_ckpt, dtype=mx.float32)
    stage = BatchStage(StageWorker(shard, overlap=False))
    # The same sequences through the per-sequence path, round for round: same tokens, drafts, commits.
    twin = StageWorker(shard, overlap=False)
    reference = engines.local("dense")
    vocab = shard.config.args.vocab_size
    specs = [("a", PROMPTS[0], 2), ("b", LONG_TEXTS[0], 0), ("c", PROMPTS[2], 3), ("d", PROMPTS[5], 1)]
    rows: dict[str, Row] = {}
    for seq_id, text, depth in specs:
        prompt = encode(reference, text)
        ref = engines.alone("dense", GenerationRequest(prompt, max_tokens=48)).tokens
        rows[seq_id] = Row(seq_id, prompt, depth, ref)

    def start(seq_id: str) -> None:
        row = rows[seq_id]
        out, steps = prefill(stage.prefill, row)
        twin_out, _ = prefill(twin.step, row)
        assert (out.tokens, out.drafts) == (twin_out.tokens, twin_out.drafts)
        stage.join(seq_id)
        row.twin_step = steps
        row.emitted = list(out.tokens)
        row.next = [out.tokens[-1], *out.drafts]
        assert len(out.drafts) == row.depth

    for seq_id in "abc":
        start(seq_id)
    worst = check_caches(stage, rows)
    accepted = 0
    for rnd in range(10):
        if rnd == 3:
            start("d")  # joins a batch that has decoded (its caches are longer)
        if rnd == 6:
            assert stage.release("b") and "b" not in stage  # leaves mid-batch
        if rnd in (2, 5, 8):
            # The random model's drafts are nearly always rejected: plant drafts from the greedy
            # reference (all but the last right) so rows also accept drafts and trim part of a round.
            for i, seq_id in enumerate(stage.ids):
                row = rows[seq_id]
                k = len(row.next) - 1
                if k:
                    true = row.reference[len(row.emitted) : len(row.emitted) + k]
                    planted = true[:-1] + [(true[-1] + 1) % vocab] if k > 1 else true
                    stage.head.states[i].drafts = list(planted)
                    twin.sequences[seq_id].draft.drafts = list(planted)
                    row.next = [row.next[0], *planted]
        outs = stage.forward([RowStep(s, rows[s].next) for s in stage.ids])
        stage.commit([o.output.commit for o in outs])
        for o in outs:
            row, out = rows[o.seq_id], o.output
            alone = twin.step(StepRequest(row.seq_id, row.twin_step, StepKind.DECODE, row.next, commit=row.twin_commit))
            row.twin_step += 1
            row.twin_commit = alone.commit
            assert (out.tokens, out.drafts, out.accepted, out.drafted) == (
                alone.tokens, alone.drafts, alone.accepted, alone.drafted)
            assert out.commit.trim == alone.commit.trim == out.drafted - out.accepted
            accepted += out.accepted
            row.emitted += out.tokens
            row.next = [out.tokens[-1], *out.drafts]
            assert row.emitted == row.reference[: len(row.emitted)]  # greedy: the reference's tokens
        worst = max(worst, check_caches(stage, rows))
        # A row that never drafts (depth 0, no auto) keeps nothing for the MTP head, round after round.
        assert all(not d.idle_hidden for d, s in zip(stage.head.states, stage.ids) if rows[s].depth == 0)
    assert accepted > 0  # acceptance and partial trims were exercised, not only full rejections
    assert stage.ids == ["a", "c", "d"] and stage.sequences == 3
    print(f"largest cache difference from the unbatched forward: {worst:.3g} (BLAS: {blas.info()})")


def test_rounds_queued_on_lazy_drafts_match_rounds_run_on_request(dense_ckpt: Path) -> None:
    """A whole-model stage queues each next round on the drafts still computing, after applying the
    round's commit itself; a stage that never queues ahead runs the same rounds on request. Every
    round's outcome and the caches after them match, and every queued round was the one run next."""
    shard = load_shard(dense_ckpt, dtype=mx.float32)
    queued, plain = BatchStage(StageWorker(shard, overlap=False)), BatchStage(StageWorker(shard, overlap=False))
    plain.lookahead = False
    lazy, restored = [], []
    issue, restore = queued._issue_verify, queued._restore

    def spy_issue(out: list, drafts: mx.array) -> None:
        # queued before the host read the drafts: the rows get them from their values right after
        lazy.append(isinstance(drafts, mx.array) and all(not d.drafts for d in queued.head.states))
        issue(out, drafts)

    queued._issue_verify = spy_issue  # type: ignore[method-assign]
    queued._restore = lambda ahead: (restored.append(True), restore(ahead))  # type: ignore[method-assign]
    nexts: dict[str, list[int]] = {}
    for seq_id, prompt, depth in [("a", list(range(5, 19)), 2), ("b", list(range(40, 47)), 0),
                                  ("c", list(range(90, 121)), 3)]:
        row = Row(seq_id, prompt, depth, [])
        for stage in (queued, plain):
            out, _ = prefill(stage.prefill, row)
            stage.join(seq_id)
        nexts[seq_id] = [out.tokens[-1], *out.drafts]
    trims = 0
    for _ in range(12):
        rows = [RowStep(s, nexts[s]) for s in queued.ids]
        outs_q, outs_p = queued.forward(rows), plain.forward(rows)
        for stage, outs in ((queued, outs_q), (plain, outs_p)):
            stage.commit([o.output.commit for o in outs])
        for q, p in zip(outs_q, outs_p):
            assert (q.output.tokens, q.output.drafts, q.output.commit) == (p.output.tokens, p.output.drafts, p.output.commit)
            nexts[q.seq_id] = [q.output.tokens[-1], *q.output.drafts]
            trims += q.output.commit.trim
    assert len(lazy) == 12 and all(lazy) and not restored  # every round queued on lazy drafts, and used
    assert trims > 0  # rounds were trimmed, from the commit the stage applied itself
    queued.drop_ahead()
    assert queued.positions == plain.positions
    for layer, a, b in zip(queued.model.layers, queued.cache, plain.cache):
        if layer.is_linear:
            assert max(max_diff(a[0], b[0]), max_diff(a[1], b[1])) <= CACHE_TOL
        else:
            assert a.lengths == b.lengths
            for i in range(len(queued.ids)):
                (ka, va), (kb, vb) = a.row(i), b.row(i)
                assert max(max_diff(ka, kb), max_diff(va, vb)) <= CACHE_TOL


def test_a_round_that_fails_after_its_commit_was_applied_leaves_no_commit_for_the_next(
        engines: Engines, dense_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A round can fail after the stage applied its commit ahead of the engine's word (the next round
    queued): its rows fail, and the next requests, whose first rounds confirm no such commit, decode
    as alone (they failed on "commits differ" with the stale one)."""
    from mtpipe.node import batch_head

    decide, calls = batch_head.BatchHead.decide, []

    def failing(self, *args, **kwargs):
        out = decide(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected: the round fails after it was decided")
        return out

    monkeypatch.setattr(batch_head.BatchHead, "decide", failing)
    engine = batch_engine(dense_ckpt, dtype=mx.float32)
    try:
        victim = Stream(engine, request(encode(engine, PROMPTS[0]), 2, 20))
        with pytest.raises(RuntimeError, match="injected"):
            victim.finish()
        for i in range(1, 4):
            req = request(encode(engine, PROMPTS[i]), 0, 12)
            assert Stream(engine, req).finish() == engines.alone("dense", req).tokens
    finally:
        engine.close()


def test_a_round_with_tokens_not_the_stages_leaves_the_caches_intact(dense_ckpt: Path) -> None:
    """The last stage refuses a round whose tokens are not the ones it made before it runs it: the
    rounds after it match a stage that never saw it."""
    shard = load_shard(dense_ckpt, dtype=mx.float32)
    tried, plain = BatchStage(StageWorker(shard, overlap=False)), BatchStage(StageWorker(shard, overlap=False))
    nexts: dict[str, list[int]] = {}
    for seq_id, prompt, depth in [("a", list(range(5, 19)), 2), ("b", list(range(40, 47)), 1)]:
        row = Row(seq_id, prompt, depth, [])
        for stage in (tried, plain):
            out, _ = prefill(stage.prefill, row)
            stage.join(seq_id)
        nexts[seq_id] = [out.tokens[-1], *out.drafts]
    for rnd in range(4):
        if rnd == 1:
            wrong = {**nexts, "b": [nexts["b"][0] + 1, *nexts["b"][1:]]}
            before = list(tried.positions)
            with pytest.raises(StageError, match="do not match"):
                tried.forward([RowStep(s, wrong[s]) for s in tried.ids])
            assert tried.positions == before
        rows = [RowStep(s, nexts[s]) for s in tried.ids]
        outs_t, outs_p = tried.forward(rows), plain.forward(rows)
        for stage, outs in ((tried, outs_t), (plain, outs_p)):
            stage.commit([o.output.commit for o in outs])
        for t, p in zip(outs_t, outs_p):
            assert (t.output.tokens, t.output.drafts, t.output.commit) == (p.output.tokens, p.output.drafts,
                                                                          p.output.commit)
            nexts[t.seq_id] = [t.output.tokens[-1], *t.output.drafts]
    tried.drop_ahead()
    plain.drop_ahead()
    assert tried.positions == plain.positions


def test_rows_drawn_on_the_device_queue_the_next_round_on_their_draws(engines: Engines,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU an unseeded sampled row's token is drawn on the device, so the next round is queued on
    it as on a greedy pick (forced here, on the CPU). Every such row emits its draw. A filter that
    leaves one token (top_k=1, a tiny top_p) makes the draw the greedy pick: those rows decode what
    the prompt decodes alone, greedy, beside greedy rows, a row at temperature 1, and a penalized
    row (whose logits the host processes: rounds are queued only once the host has its tokens)."""
    monkeypatch.setattr(device_sampling, "on_host", lambda: False)
    engine = engines.batch("dense", 1)
    stage = engine.stages[0]
    head = stage.head
    lazy: list[bool] = []
    drawn: list[tuple[int, int]] = []  # (token emitted, the device's draw) of rows drawn on the device
    issue, prepare, decide = stage._issue_ahead, head.prepare, head.decide
    made: list = []

    def spy_issue(tokens: Any, *args: Any) -> None:
        lazy.append(not isinstance(tokens, list))
        issue(tokens, *args)

    def spy_prepare(h: mx.array, real: list[int]) -> Any:
        made.append(prepare(h, real))
        return made[-1]

    def spy_decide(rows: list, h: mx.array, positions: list[int], prepared: Any = None, **kw: Any) -> Any:
        made.clear()
        out = decide(rows, h, positions, prepared=prepared, **kw)
        used = prepared if prepared is not None else made[0]  # (made[1:]: the round queued ahead)
        picks = used.picks.tolist()
        drawn.extend((o.output.tokens[0], picks[i][0]) for i, o in enumerate(out) if i in used.sampled)
        return out

    monkeypatch.setattr(stage, "_issue_ahead", spy_issue)
    monkeypatch.setattr(head, "prepare", spy_prepare)
    monkeypatch.setattr(head, "decide", spy_decide)
    prompts = [encode(engine, t) for t in PROMPTS[:4]]
    one = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.8, top_p=1e-6)]
    free, penalized = SamplingParams(temperature=1.0), SamplingParams(repetition_penalty=1.3)
    batches = {"queued ahead": [(prompts[0], one[0]), (prompts[1], one[1]), (prompts[2], SamplingParams()),
                                (prompts[3], free)],
               "a penalized row beside": [(prompts[3], one[0]), (prompts[0], penalized), (prompts[1], free)]}
    for name, batch in batches.items():
        lazy.clear()
        streams = [Stream(engine, request(p, 0, 20, params=params)) for p, params in batch]
        for s, (p, params) in zip(streams, batch):
            got = s.finish()
            if params is not free:
                alone = engines.alone("dense", request(p, 0, 20, params=params if params is penalized else SamplingParams()))
                assert got == alone.tokens, name
        if name == "queued ahead":
            assert sum(lazy) >= 15, lazy  # rounds queued on the draws still lazy
    # the three rows filtered to one token draw 19 tokens each (the first comes with the prompt); the
    # rows at temperature 1 add theirs, as many as they draw before an end token
    assert len(drawn) > 3 * 19 and all(token == draw for token, draw in drawn)


# -- 3. seeded sampling does not depend on the batch ------------------------------------------------


def test_seeded_sampled_rows_do_not_depend_on_the_batch(engines: Engines) -> None:
    engine = engines.batch("dense", 1)
    short = [encode(engine, t) for t in PROMPTS]
    sampled = request(short[0], 2, 32, params=SamplingParams(temperature=0.8, seed=7))
    auto = request(short[1], "auto", 32, params=SamplingParams(temperature=0.8, seed=7))
    alone = [Stream(engine, r).finish() for r in (sampled, auto)]
    assert alone[0] != engines.alone("dense", request(short[0], 0, 32)).tokens  # it does sample

    others = [request(short[9], 0), request(short[10], 1, params=SamplingParams(temperature=1.0, seed=3)),
              request(encode(engine, LONG_TEXTS[1]), 3), request(short[11], 2, params=SamplingParams(temperature=0.7))]
    batch = [Stream(engine, others[0]), Stream(engine, others[1])]
    batch[0].first()
    mine = [Stream(engine, sampled), Stream(engine, auto)]  # join rows that already decode
    batch += [Stream(engine, others[2]), Stream(engine, others[3])]
    assert [s.finish() for s in mine] == alone
    for s in batch:
        s.finish()
    # And the per-sequence engine draws the same tokens too (same RNG use, same drafts).
    assert [engines.alone("dense", r).tokens for r in (sampled, auto)] == alone
    assert mine[0].stats.drafted > 0 and set(mine[0].stats.depths) == {2}


# -- 4. admission by memory --------------------------------------------------------------------------


def test_every_row_pays_for_the_longest_reach() -> None:
    """A batch's KV is as long as its longest row, so a long request beside short ones costs what
    all of them at its length cost; the queue stays first in, first out."""
    dims = plan.ModelDims(kv_bytes_per_token=10, state_bytes=1000)
    short, long = plan.footprint(100, 0), plan.footprint(10_000, 0)
    assert plan.batch_bytes(dims, [short, short]) == 2 * 10 * 100 + 2 * 2000
    assert plan.batch_bytes(dims, [long, short]) == 2 * 10 * 10_000 + 2 * 2000
    # A round is as wide as its deepest row: every row's states are captured at that many positions.
    deep = plan.footprint(100, 8)
    assert plan.batch_bytes(dims, [deep] + [short] * 7) == 8 * 10 * 108 + 8 * 1000 * (2 + 8)
    # KV grows in steps: a batch holds the longest row's reach rounded up to one.
    stepped = plan.ModelDims(kv_bytes_per_token=10, state_bytes=1000, kv_step=256)
    assert plan.batch_bytes(stepped, [short, short]) == 2 * 10 * 256 + 2 * 2000
    queue = [plan.Waiting("long", long, 0.0), plan.Waiting("short", short, 0.0)]
    budget = plan.batch_bytes(dims, [short] * 4)
    assert plan.admit(queue, [], dims, budget, max_rows=8) == ["long"]  # alone, whatever it costs
    assert plan.admit(queue, [short], dims, budget, max_rows=8) == []  # never overtaken
    assert plan.admit(queue[1:], [short] * 2, dims, budget, max_rows=8) == ["short"]
    assert plan.admit(queue[1:], [short] * 2, dims, budget, max_rows=2) == []


def test_rows_taken_keep_only_the_kv_they_need() -> None:
    """A long row that leaves takes its share of the batch's KV with it: the rows taken are as long
    as the longest of them needs, their entries unchanged."""
    kv, heads, dim = RaggedKV(None, None, [0, 0, 0]), 2, 4
    new = mx.random.normal((3, 600, heads, dim))
    kv.update(new, new, [40, 600, 300])
    assert kv.capacity == 3 * CAPACITY_STEP and kv.lengths == [40, 600, 300]
    kept = kv.take([2, 0])
    assert kept.capacity == 2 * CAPACITY_STEP and kept.lengths == [300, 40]
    for i, row in enumerate([2, 0]):
        k, v = kept.row(i)
        assert mx.array_equal(k, kv.row(row)[0]).item() and mx.array_equal(v, kv.row(row)[1]).item()
    assert kv.take([1]).capacity == 3 * CAPACITY_STEP and kv.take([0]).capacity == CAPACITY_STEP


def test_admission_waits_for_memory_and_times_out(dense_ckpt: Path, engines: Engines) -> None:
    config = load_config(dense_ckpt)
    dims = plan.ModelDims.of(config.args, itemsize=4, mtp=True, kv_step=CAPACITY_STEP)
    tok = engines.local("dense")
    a, b = request(encode(tok, PROMPTS[0]), 2, 32), request(encode(tok, PROMPTS[1]), 1, 24)
    need = [plan.footprint(len(r.prompt_tokens) + r.max_tokens, r.mtp_depth) for r in (a, b)]
    budget = max(plan.batch_bytes(dims, [n]) for n in need)  # each fits alone, not both together
    engine = batch_engine(dense_ckpt, dtype=mx.float32, memory_budget=budget, queue_timeout=30)
    try:
        first, second = Stream(engine, a), Stream(engine, b)
        assert first.finish() == engines.alone("dense", a).tokens
        assert second.finish() == engines.alone("dense", b).tokens
        assert second.stamps[0] > first.ended_at  # it started only once the first one was done
        # With room for both, they run together: the second's first token comes before the first ends.
        engine.thread.call(setattr, engine, "budget", plan.batch_bytes(dims, need))
        first, second = Stream(engine, a), Stream(engine, b)
        first.finish(), second.finish()
        assert second.stamps[0] < first.ended_at
    finally:
        engine.close()

    # Admitted with room to grow by a horizon: a second row does not fit beside one with that room.
    long = request(encode(tok, PROMPTS[0]), 0, 2000, params=never_ends(tok))
    alone = plan.batch_bytes(dims, [plan.footprint(len(long.prompt_tokens) + plan.ADMIT_HORIZON, 0)])
    engine = batch_engine(dense_ckpt, dtype=mx.float32, queue_timeout=0.2, memory_budget=alone)
    try:
        running = Stream(engine, long).first()
        start = time.monotonic()
        waiting = Stream(engine, b)
        with pytest.raises(ServerBusy) as busy:
            waiting.finish()
        assert busy.value.retry_after >= 1 and waiting.ended_at - start >= 0.2 and not waiting.chunks
        assert not running.ended  # refused while the first one still held the memory
        running.handle.cancel()
        running.finish()
        assert engine.thread.call(lambda: engine.stages[0].sequences) == 0
    finally:
        engine.close()


def test_the_default_budget_stays_within_a_memory_cap(dense_ckpt: Path) -> None:
    """`mtpipe launch --max-memory` alone: the weights and the batch's caches stay within the cap (half of what
    the cap leaves beside the weights), where the memory free would allow more."""
    engine = batch_engine(dense_ckpt, dtype=mx.float32, memory_cap=2**40)  # (more than any machine: free memory rules)
    try:
        weights = engine.thread.call(lambda: engine.stages[0].worker.shard.model.parameter_bytes())
        uncapped = engine.budget
    finally:
        engine.close()
    cap = weights + 2 * 512 * 2**20
    assert uncapped > 512 * 2**20  # (this machine has more than 1 GiB free)
    engine = batch_engine(dense_ckpt, dtype=mx.float32, memory_cap=cap)
    try:
        assert engine.budget == 512 * 2**20
    finally:
        engine.close()


# -- 5. cancellation -------------------------------------------------------------------------------------


def test_cancel_ends_the_request_and_frees_every_stage(engines: Engines) -> None:
    engine = engines.batch("dense", 3)
    short = [encode(engine, t) for t in PROMPTS]
    other = Stream(engine, request(short[12], 1, 2000, params=never_ends(engine)))
    gone = Stream(engine, request(short[13], 2, 2000)).first()
    cancelled_at = time.monotonic()
    gone.handle.cancel()
    gone.finish()
    assert gone.error is None and all(c.finish_reason is None for c in gone.chunks)
    assert gone.ended_at - cancelled_at < 2.0
    assert sum(t > cancelled_at for t in gone.stamps) <= 1  # at most the round already under way
    # Cancelled while its long prompt is prefilled in chunks between the other row's rounds.
    prompt = encode(engine, "".join(LONG_TEXTS) * 6)
    assert len(prompt) > 1500
    filling = Stream(engine, request(prompt, 0, 8))
    other.first()
    filling.handle.cancel()
    filling.finish()
    assert filling.error is None and not any(c.finish_reason for c in filling.chunks)
    assert engine.thread.call(lambda: [s.sequences for s in engine.stages]) == [1, 1, 1]  # only `other`
    other.handle.cancel()
    other.finish()
    assert engine.thread.call(lambda: [(s.sequences, len(s.ids)) for s in engine.stages]) == [(0, 0)] * 3
    # And the engine serves on.
    req = request(short[14], 2, 16)
    assert Stream(engine, req).finish() == engines.alone("dense", req).tokens


# -- 6. one MLX thread ------------------------------------------------------------------------------


def test_all_mlx_work_runs_on_the_engine_thread(dense_ckpt: Path, engines: Engines) -> None:
    tok = engines.local("dense")
    prompts = [encode(tok, t) for t in (PROMPTS[15], LONG_TEXTS[0], PROMPTS[16])]
    gpu_limit()  # a device query any thread may make, cached per process: asked here, not in the block
    with record_mlx_threads() as rec:
        engine = batch_engine(dense_ckpt, stages=2, dtype=mx.float32)
        try:
            streams = [Stream(engine, request(p, d, 16)) for p, d in zip(prompts, (0, 2, "auto"))]
            got = [s.finish() for s in streams]
            ident = engine.thread.ident
        finally:
            engine.close()
    assert rec.threads == {"mlx-engine"}, {k: v.most_common(5) for k, v in rec.calls_by_thread.items()}
    assert rec.idents("mlx-engine") == {ident}  # this engine's thread, not another engine's
    calls = rec.calls_by_thread["mlx-engine"]
    assert calls["new_thread_local_stream"] == 1 and calls["eval"] > 0 and calls["clear_streams"] == 1
    assert got == [engines.alone("dense", s.req).tokens for s in streams]


# -- 7. refusals ---------------------------------------------------------------------------------------


def test_bad_requests_are_refused_and_the_engine_serves_on(engines: Engines) -> None:
    engine = engines.batch("dense", 1)
    vocab = engine.stages[0].worker.shard.config.args.vocab_size
    prompt = encode(engine, PROMPTS[17])
    for bad in ([*prompt, vocab], [*prompt[:3], vocab + 1000, *prompt[3:]], [-1, *prompt]):
        with pytest.raises(RequestError) as e:
            engine.open(request(bad), lambda item: None)
        assert e.value.param == "prompt"
    with pytest.raises(RequestError) as e:
        engine.open(request([prompt[0]] * (engine.max_context + 1)), lambda item: None)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(RequestError) as e:
        engine.open(request(prompt, 3, engine.max_context), lambda item: None)
    assert e.value.param == "max_tokens"
    assert engine.thread.call(lambda: [s.sequences for s in engine.stages]) == [0]
    req = request(prompt, 2, 16)
    assert Stream(engine, req).finish() == engines.alone("dense", req).tokens


def test_a_row_that_fails_fails_alone_and_a_closed_engine_ends_what_it_holds(
        dense_ckpt: Path, engines: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose tokens cannot be handed out (its text fails) ends with that error; the rows
    beside it decode on. Closing the engine ends every request it holds, and refuses new ones."""
    from mtpipe.coordinator.engine import batch as batch_module

    class Failing(batch_module.TextStream):
        def release(self, final: bool = False) -> str:
            raise ValueError("no text for this one")

    made = batch_module.TextStream
    monkeypatch.setattr(made, "of", classmethod(
        lambda cls, tok, req: (Failing if req.stop == ["boom"] else made)(tok, req.stop, req.skip_special_tokens)))
    engine = batch_engine(dense_ckpt, dtype=mx.float32)
    try:
        prompts = [encode(engine, t) for t in PROMPTS[:3]]
        good = [request(prompts[0], 2, 16), request(prompts[1], 0, 16)]
        streams = [Stream(engine, good[0]), Stream(engine, request(prompts[2], 1, 16, stop=["boom"])),
                   Stream(engine, good[1])]
        with pytest.raises(ValueError, match="no text"):
            streams[1].finish()
        assert [streams[0].finish(), streams[2].finish()] == [engines.alone("dense", r).tokens for r in good]
        held = Stream(engine, request(prompts[0], 0, 2000, params=never_ends(engine))).first()
        queued = Stream(engine, request(prompts[1], 0, 8))
    finally:
        engine.close()
    for s in (held, queued):
        with pytest.raises(StageUnavailable):
            s.finish()
    with pytest.raises(StageUnavailable):
        engine.open(request(prompts[0], 0, 8), lambda item: None)


def test_prompt_chunks_of_full_rows_run_unmasked_as_a_sequence_alone(dense_ckpt: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt chunks of rows not yet in the batch (filling.py) mask padding out of the GatedDeltaNet
    layers only where a row is shorter than the widest: a lone chunk runs unmasked, and computes
    bit for bit what the shard computes for the sequence alone, caches included."""
    from mlx_lm.models.qwen3_5 import GatedDeltaNet

    from mtpipe.models import gdn_chunked
    from mtpipe.models.shard import STEPPED_MAX_TOKENS
    from mtpipe.node.filling import FillGroup

    model = load_shard(dense_ckpt, dtype=mx.float32).model
    masks: list[bool] = []  # (the chunked mixer on the CPU, mlx-lm's layer on Metal)
    chunked, call = gdn_chunked.prefill_mixer, GatedDeltaNet.__call__
    monkeypatch.setattr(gdn_chunked, "prefill_mixer", lambda gdn, x, mask, cache: (
        masks.append(mask is not None), chunked(gdn, x, mask, cache))[1])
    monkeypatch.setattr(GatedDeltaNet, "__call__", lambda self, x, mask=None, cache=None: (
        masks.append(mask is not None), call(self, x, mask, cache))[1])
    linear = sum(layer.is_linear for layer in model.layers)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]  # (longer than a stepped input)
    assert len(prompt) > STEPPED_MAX_TOKENS

    def fill(rows: list[list[int]]) -> tuple[mx.array, list]:
        group = FillGroup(model, None, first=True, dtype=mx.float32, max_context=64,
                          vocab_size=model.config.args.vocab_size, hidden_size=model.config.args.hidden_size,
                          has_mtp=False)
        h = group.step([StepRequest(f"r{i}", 0, StepKind.PREFILL, t, params=SamplingParams())
                        for i, t in enumerate(rows)], None)
        return h, group.cache

    h, cache = fill([prompt])
    assert masks == [False] * linear
    ref_cache = model.make_cache()
    ref, _ = model.run_layers(model.embed(mx.array([prompt])), ref_cache)
    got = [c.row(0) if isinstance(c, RaggedKV) else (c[0], c[1]) for c in cache]  # (attention: the row's entries)
    want = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) if hasattr(c, "offset") and c.keys is not None
            else (c[0], c[1]) for c in ref_cache]
    assert mx.array_equal(h, ref).item() and len(got) == len(want) == len(model.layers)
    assert all(a.shape == b.shape and mx.array_equal(a, b).item() for x, y in zip(got, want) for a, b in zip(x, y))
    masks.clear()
    fill([prompt, prompt[:4]])
    assert masks == [True] * linear


def test_a_refused_prompt_chunk_adds_no_row(dense_ckpt: Path) -> None:
    """Every row of a prompt step is checked before any joins: a bad one (its sampling, its length, the
    hidden states a later stage gets) leaves the rows as they were, none of its good neighbours added."""
    from mtpipe.node.filling import FillGroup

    model = load_shard(dense_ckpt, dtype=mx.float32).model
    args = model.config.args
    good = StepRequest("good", 0, StepKind.PREFILL, [3, 1, 4], params=SamplingParams())
    bad = [StepRequest("bad", 0, StepKind.PREFILL, [5, 9], params=SamplingParams(temperature=float("nan"))),
           StepRequest("bad", 0, StepKind.PREFILL, list(range(65)), params=SamplingParams())]  # over max_context
    for first in (True, False):
        group = FillGroup(model, None, first=first, dtype=mx.float32, max_context=64, vocab_size=args.vocab_size,
                          hidden_size=args.hidden_size, has_mtp=False)
        hidden = None if first else mx.zeros((2, 3, args.hidden_size))
        for req in bad:
            with pytest.raises(StageError):
                group.step([good, req], hidden)
            assert group.ids == [] and group.cache == []
        if not first:
            for shape in ((1, 3, args.hidden_size), (2, 3, args.hidden_size + 1), (2 * 3, args.hidden_size)):
                with pytest.raises(StageError, match="hidden states have shape"):
                    group.step([good, replace(good, seq_id="other")], mx.zeros(shape))
                assert group.ids == []


def test_an_auto_row_joins_a_batch_at_the_depth_its_rows_run(dense_ckpt: Path) -> None:
    """A prompt's last chunk drafts for its first round at the depth of the batch it joins (its plan's):
    the stage's per-sequence round costs are never timed in a batch, so its own chooser would start
    every request without drafts, to time them."""
    stage = BatchStage(StageWorker(load_shard(dense_ckpt, dtype=mx.float32), overlap=False))
    prompt = list(range(3, 40))

    def first_drafts(seq_id: str, depth: int = 3) -> list[int]:
        req = StepRequest(seq_id, 0, StepKind.PREFILL, prompt, final=True, mtp_depth=depth, mtp_auto=True)
        return stage.fill([req])[0].drafts

    assert first_drafts("a") == []  # nothing decided yet: no drafts, which the batch's first round times
    stage.head.plan.depth = 2
    assert len(first_drafts("b")) == 2
    assert len(first_drafts("c", depth=1)) == 1  # capped at what the request asked for
    stage.head.plan.depth = 0
    assert first_drafts("d") == []


def test_a_ring_prompt_joins_its_groups_at_their_depth(dense_ckpt: Path) -> None:
    """Over nodes the last node prefills a prompt on its own, then the sequence joins its client's
    groups: its first round drafts at the depth the groups run (their plan's), once they chose one."""
    from mtpipe.node.batch_depth import DepthPlan
    from mtpipe.node.groups import RingGroups

    worker = StageWorker(load_shard(dense_ckpt, dtype=mx.float32), overlap=False)
    groups = RingGroups(worker)
    prompt = list(range(3, 40))

    def first_drafts(seq_id: str, client: str, group: int = 1) -> list[int]:
        req = StepRequest(seq_id, 0, StepKind.PREFILL, prompt, final=True, mtp_depth=3, mtp_auto=True, group=group)
        return worker.step(req, None, groups.joins_at(client, req)).drafts

    groups.plans["client"] = plan = DepthPlan()
    assert first_drafts("a", "client") == []  # the plan chose nothing yet
    plan.depth = 2
    assert len(first_drafts("b", "client")) == 2
    assert first_drafts("c", "another") == []  # another client's plan: none yet
    assert first_drafts("d", "client", group=0) == []  # a prompt meant for no group


def test_auto_rows_beside_a_fixed_depth_row_draft_at_least_as_deep(dense_ckpt: Path) -> None:
    """A round is as wide as its deepest row: beside a row of fixed depth 2, auto rows draft at least 2
    (drafts up to there cost the batch little) and the plan times its rounds, instead of asking, round
    after round, for a depth 0 no round beside that row can run at; each row's tokens are its own."""
    from concurrent.futures import ThreadPoolExecutor

    engine = batch_engine(dense_ckpt, dtype=mx.float32)
    alone = local_engine(dense_ckpt, dtype=mx.float32)
    try:
        prompts = [engine.tokenizer.encode(t) for t in PROMPTS[:3]]
        reqs = [GenerationRequest(prompts[0], max_tokens=72, mtp_depth=2),
                *(GenerationRequest(p, max_tokens=24, mtp_depth=3, mtp_auto=True) for p in prompts[1:])]
        fixed = Stream(engine, reqs[0]).first()  # (decoding before the auto rows come: they decode beside it)
        with ThreadPoolExecutor(len(reqs) - 1) as pool:
            got = list(pool.map(engine.complete, reqs[1:]))
        assert [fixed.finish(), *(r.tokens for r in got)] == [alone.complete(r).tokens for r in reqs]
        for r in got:  # (a row's first round drafts at what the plan ran when it joined)
            deep = sum(n for k, n in r.stats.depths.items() if int(k) >= 2)
            assert r.stats.drafted > 0 and deep >= r.stats.rounds - 1
        plan = engine.stages[-1].head.plan
        assert engine.thread.call(lambda: any(k >= 2 for _, k in plan.costs_by_rows[4].live))  # (3 rows: bucket 4)
    finally:
        engine.close()


def test_auto_rows_with_processed_logits_time_their_rounds_and_draft(dense_ckpt: Path) -> None:
    """Rows with penalties or a logit bias cost more per round than plain rows: batches of them follow
    a plan of their own, timed on their rounds, instead of never timing one (and so never drafting);
    each row's tokens are still its own."""
    from concurrent.futures import ThreadPoolExecutor

    engine = batch_engine(dense_ckpt, dtype=mx.float32)
    alone = local_engine(dense_ckpt, dtype=mx.float32)
    try:
        params = [SamplingParams(presence_penalty=0.5), SamplingParams(logit_bias=((7, 1.5),))]
        reqs = [GenerationRequest(engine.tokenizer.encode(PROMPTS[i]), max_tokens=64, mtp_depth=3, mtp_auto=True,
                                  params=p) for i, p in enumerate(params)]
        with ThreadPoolExecutor(len(reqs)) as pool:
            got = list(pool.map(engine.complete, reqs))
        assert [r.tokens for r in got] == [alone.complete(r).tokens for r in reqs]
        assert all(r.stats.drafted > 0 for r in got)
        plan = engine.stages[-1].head.plan

        def timed(p: Any) -> set[int]:
            return {k for table in p.costs_by_rows.values() for _, k in table.live}

        assert engine.thread.call(lambda: (timed(plan), timed(plan.processed))) == (set(), {0, 1, 2, 3})
    finally:
        engine.close()


def test_a_client_callback_that_fails_ends_its_request_alone(dense_ckpt: Path) -> None:
    """A sink that raises on a chunk or on its end, or an `admitted` that raises, ends that request
    like a cancel (freed on every stage); the rows beside it give what they give alone, and closing the
    engine still ends every request."""
    engine = batch_engine(dense_ckpt, dtype=mx.float32)
    try:
        never = SamplingParams(logit_bias=tuple((t, -100.0) for t in sorted(engine.eos)))
        prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:2]]
        good = GenerationRequest(prompts[0], max_tokens=24, params=never)
        want = engine.complete(good).tokens

        def gone(*args: Any) -> None:
            raise RuntimeError("the client is gone")

        def on_chunk(item: Any) -> None:
            if getattr(item, "tokens", None):
                gone()

        for bad in (dict(sink=on_chunk), dict(sink=lambda item: gone() if item is END else None),
                    dict(sink=lambda item: None, admitted=gone)):
            handle = engine.open(GenerationRequest(prompts[1], max_tokens=8 if "admitted" not in bad else 400,
                                                   params=never), **bad)
            assert [t for c in engine.generate(good) for t in c.tokens] == want
            handle.cancel()
        assert engine.thread.call(lambda: (engine._waiting, engine._prefilling, engine._decoding,
                                           [s.ids for s in engine.stages])) == ([], [], [], [[]])
        running: queue.SimpleQueue = queue.SimpleQueue()
        engine.open(GenerationRequest(prompts[0], max_tokens=3000, params=never), running.put)
        running.get(timeout=60)
        engine.open(GenerationRequest(prompts[1], max_tokens=3000, params=never), gone)
    finally:
        engine.close()
    while running.get(timeout=60) is not END:  # (a queue.Empty here: a request left hanging)
        pass


def test_the_allocator_cache_is_cleared_now_and_then_on_the_batch_path(dense_ckpt: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """As the per-sequence stage does and mlx-lm's batches do: memory of rows that left goes back."""
    from mtpipe.node import stage as node_stage

    cleared: list[int] = []
    monkeypatch.setattr(node_stage, "CLEAR_CACHE_EVERY", 4)
    monkeypatch.setattr(node_stage.mx, "clear_cache", lambda: cleared.append(1))
    engine = batch_engine(dense_ckpt, dtype=mx.float32, prefix_cache=0)
    try:
        result = engine.complete(GenerationRequest(engine.tokenizer.encode(PROMPTS[0]), max_tokens=12))
        steps = engine.stages[0].stats.steps
    finally:
        engine.close()
    assert len(result.tokens) == 12 and steps >= 12 and len(cleared) == steps // 4


def test_prefill_speed_counts_the_tokens_prefilled_not_those_taken_from_a_kept_prefix() -> None:
    from mtpipe.coordinator.engine.request import GenerationStats

    assert GenerationStats(prompt_tokens=100, cached_tokens=60, prefill_seconds=2.0).prefill_tps == 20.0
