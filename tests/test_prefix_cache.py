"""Kept prompt prefixes: a prompt that starts with a kept one prefills only the rest, and its tokens are
those of the prompt prefilled whole (greedy and seeded, every depth, dense and MoE, 1 and 2 stages);
kept prefixes stay within their budget, give way to requests that need the memory, and a bad one is
refused without touching the stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from helpers import PROMPTS

from mtpipe.coordinator.engine import scheduler as plan
from mtpipe.coordinator.engine.batch import BatchEngine
from mtpipe.coordinator.engine.build import batch_engine, local_engine
from mtpipe.coordinator.engine.request import GenerationRequest, GenerationResult, resolve_depth
from mtpipe.coordinator.engine.sinks import ServerBusy
from mtpipe.node.batch import BatchStage
from mtpipe.node.protocol import SamplingParams, StageError, StepKind, StepRequest

TEXT = "".join(PROMPTS[0:6])
TOKENS = 24


def run(engine: BatchEngine, prompt: list[int], depth: int | str = 0, **kw: Any) -> GenerationResult:
    d, auto = resolve_depth(depth, engine.has_mtp)
    return engine.complete(GenerationRequest(prompt, max_tokens=TOKENS, mtp_depth=d, mtp_auto=auto, **kw))


def kept(engine: BatchEngine) -> list[plan.KeptPrefix]:
    return engine.thread.call(lambda: list(engine._kept.values()))


@pytest.mark.parametrize(("model", "stages"), [("dense", 1), ("moe", 1), ("dense", 2)])
def test_a_prompt_going_on_from_a_kept_prefix_gives_the_tokens_of_a_whole_prefill(
        dense_ckpt: Path, moe_ckpt: Path, model: str, stages: int) -> None:
    path = dense_ckpt if model == "dense" else moe_ckpt
    whole = batch_engine(path, stages=stages, dtype=mx.float32, prefix_cache=0)
    cached = batch_engine(path, stages=stages, dtype=mx.float32)
    try:
        prompt = list(cached.tokenizer.encode(TEXT))
        for i, depth in enumerate((0, 2, "auto")):
            first = run(cached, prompt, depth)
            # Kept by the depth-0 run without the MTP head's part, which the others need: they keep their own.
            assert first.stats.cached_tokens == (len(prompt) - 1 if depth == "auto" else 0)
            again = run(cached, prompt, depth)  # the same prompt: all but its last token kept
            assert again.stats.cached_tokens == len(prompt) - 1
            turn = prompt + first.tokens[:9] + list(cached.tokenizer.encode(PROMPTS[7 + i]))  # the next turn
            going_on = run(cached, turn, depth)
            assert going_on.stats.cached_tokens == len(prompt) - 1
            reference, whole_turn = run(whole, prompt, depth), run(whole, turn, depth)
            assert first.tokens == again.tokens == reference.tokens, depth
            assert going_on.tokens == whole_turn.tokens, depth
            if depth == 2:  # the MTP head went on from the kept prefix too: the same drafts, accepted alike
                assert (again.stats.drafted, again.stats.accepted) == (first.stats.drafted, first.stats.accepted)
                assert (going_on.stats.drafted, going_on.stats.accepted) == (whole_turn.stats.drafted,
                                                                             whole_turn.stats.accepted)
            assert whole.thread.call(lambda: whole._kept) == {}
        seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
        turn = prompt + list(cached.tokenizer.encode(PROMPTS[9]))
        sampled = run(cached, turn, "auto", params=seeded)
        assert sampled.stats.cached_tokens == len(prompt) - 1
        assert sampled.tokens == run(whole, turn, "auto", params=seeded).tokens
    finally:
        whole.close()
        cached.close()


def test_kept_prefixes_stay_within_their_budget_and_give_way_to_requests(dense_ckpt: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    probe = batch_engine(dense_ckpt, dtype=mx.float32)
    text = list(probe.tokenizer.encode(TEXT))
    prompts = [text[7 * i : 7 * i + 30] for i in range(4)]  # as long as each other, none the start of another
    try:
        reply = run(probe, prompts[0], 2).tokens
        sizes = {k.tokens: k.nbytes for k in kept(probe)}  # what one of these requests keeps
        size, end = sizes[tuple(prompts[0][:-1])], sizes[tuple(prompts[0] + reply[:-1])]  # its prompt, its end
        assert len(sizes) == 2 and 0 < size < end and all(k.drafts for k in kept(probe))
    finally:
        probe.close()
    engine = batch_engine(dense_ckpt, dtype=mx.float32, prefix_cache=2 * (size + end) + size // 2)
    try:
        ends = [tuple(p + run(engine, p, 2).tokens[:-1]) for p in prompts[:3]]
        mine = [(tuple(p[:-1]), e) for p, e in zip(prompts, ends)]
        assert {k.tokens for k in kept(engine)} == {*mine[1], *mine[2]}  # the oldest request's went
        assert run(engine, prompts[1], 2).stats.cached_tokens == len(prompts[1]) - 1
        run(engine, prompts[3], 2)  # the least recently used go: prompt 2's, not prompt 1's just used
        tokens = {k.tokens for k in kept(engine)}
        assert mine[1][0] in tokens and mine[2][0] not in tokens
        assert sum(k.nbytes for k in kept(engine)) <= engine.prefix_cache
        assert sum(s["kept_prefixes"] for s in engine.describe()["stages"]) == len(tokens)
        longer = (text * 12)[:800]  # one prefix larger than the cache is not kept, and leaves the others
        join, joined = BatchStage.join, []  # (nor even copied out as its row joins, to be dropped at once)
        monkeypatch.setattr(BatchStage, "join", lambda self, seq_id, keep="": (joined.append(keep),
                                                                                 join(self, seq_id, keep))[1])
        run(engine, longer, 2)
        assert joined == [""] and {k.tokens for k in kept(engine)} == tokens
        monkeypatch.undo()
        # Memory for a request that goes on from prompt 1's prefix and for one kept prefix: the others go.
        need = plan.footprint(len(prompts[1]) + 3 + TOKENS, 2)
        engine.budget = plan.batch_bytes(engine.dims, [need]) + size
        assert run(engine, prompts[1] + [5, 6, 7], 2).stats.cached_tokens == len(prompts[1]) - 1
        # A request that needs the memory they hold gets it; and kept prefixes never take the room of
        # rows running beside them: its prompt's is not kept, its end is once its row is gone.
        engine.budget = plan.batch_bytes(engine.dims, [plan.footprint(len(prompts[2]) + TOKENS, 0)])
        last = run(engine, prompts[2], 0)
        assert last.stats.cached_tokens == 0
        assert [k.tokens for k in kept(engine)] == [tuple(prompts[2] + last.tokens[:-1])]
        assert kept(engine)[0].nbytes <= engine.budget
    finally:
        engine.close()
    assert engine.stages[0].prefixes == {}  # (freed on the engine's thread as it closed)


def test_an_unknown_prefix_is_refused_and_the_stage_is_left_as_it_was(dense_ckpt: Path) -> None:
    engine = batch_engine(dense_ckpt, dtype=mx.float32)
    try:
        prompt = list(engine.tokenizer.encode(TEXT))
        want = run(engine, prompt, 2).tokens
        stage = engine.stages[0]
        bad = StepRequest("x", 0, StepKind.PREFILL, prompt[:5], mtp_depth=2, prefix="no-such-prefix")
        with pytest.raises(StageError, match="no kept prompt prefix"):
            engine.thread.call(lambda: stage.fill([bad]))
        assert engine.thread.call(lambda: (stage.filling.ids, stage.sequences)) == ([], 0)
        assert run(engine, prompt, 2).tokens == want
    finally:
        engine.close()


def test_a_resumed_sequence_goes_on_from_a_prefix_within_its_prompt_only(dense_ckpt: Path) -> None:
    """A resumed sequence's penalties count its generated tokens from those it is sent; a kept prefix
    past its prompt would hide some of them. Refused on both paths (per sequence, batch rows), and
    the stages are left as they were; a prefix within the prompt is taken."""
    from mtpipe.models.loading import load_shard
    from mtpipe.node.stage import StageWorker

    worker = StageWorker(load_shard(dense_ckpt, dtype=mx.float32), overlap=False)
    prompt = list(range(3, 19))
    worker.step(StepRequest("a", 0, StepKind.PREFILL, prompt[:-1], mtp_depth=1))
    worker.step(StepRequest("a", 1, StepKind.PREFILL, prompt[-1:], final=True, keep="k"))
    worker.release("a")
    length = worker.prefixes["k"].length
    resumed = dict(prefix="k", params=SamplingParams(presence_penalty=1.0), mtp_depth=1)
    with pytest.raises(StageError, match="within its prompt only"):
        worker.step(StepRequest("b", 0, StepKind.PREFILL, prompt[length:] + [7], resumed_at=length - 2, **resumed))
    assert "b" not in worker.sequences
    worker.step(StepRequest("c", 0, StepKind.PREFILL, prompt[length:] + [7], resumed_at=length, final=True,
                            **resumed))
    worker.release("c")
    stage = BatchStage(worker)
    stage.prefixes["k"] = worker.prefixes["k"]  # (a batch stage keeps its own)
    with pytest.raises(StageError, match="within its prompt only"):
        stage.fill([StepRequest("d", 0, StepKind.PREFILL, [7], resumed_at=length - 1, **resumed)])
    assert (stage.filling.ids, stage.sequences) == ([], 0)


def test_which_kept_prefix_a_prompt_reuses() -> None:
    def k(key: str, tokens: list[int], drafts: bool = True, used: float = 0.0, nbytes: int = 10) -> plan.KeptPrefix:
        return plan.KeptPrefix(key, tuple(tokens), nbytes, drafts, used)

    kept = [k("a", [1, 2]), k("b", [1, 2, 3, 4]), k("c", [1, 2, 3], drafts=False), k("d", [5, 6])]
    assert plan.reusable(kept, [1, 2, 3, 4, 9], drafts=True).key == "b"  # the longest
    assert plan.reusable(kept, [1, 2, 3, 4], drafts=True).key == "a"  # its last token must go in
    assert plan.reusable(kept, [1, 2, 3, 7], drafts=False).key == "c"
    assert plan.reusable(kept, [1, 2, 3, 7], drafts=True).key == "a"  # (c lacks the MTP head's part)
    assert plan.reusable(kept, [2, 1, 2, 3], drafts=False) is None
    aged = [k("x", [1], used=3.0), k("y", [2], used=1.0), k("z", [3], used=2.0)]
    assert plan.least_used(aged, 15) == ["y", "z"]
    assert plan.least_used(aged, 15, pinned={"y"}) == ["z", "x"]
    assert plan.least_used(aged, 0) == []


def test_a_row_from_a_kept_prefix_holds_what_a_whole_prefill_leaves(dense_ckpt: Path) -> None:
    """Every cache of the stage, the MTP head's included, after a prompt goes on from a kept prefix equals
    what the same chunks prefilled from the start leave (bit for bit: the same arithmetic)."""
    from mtpipe.models.ragged import RaggedKV, take_rows

    engine = batch_engine(dense_ckpt, dtype=mx.float32)
    try:
        prompt = list(engine.tokenizer.encode(TEXT))
        run(engine, prompt, 2)
        (key,) = [k.key for k in kept(engine) if k.tokens == tuple(prompt[:-1])]
        turn = prompt + list(engine.tokenizer.encode(PROMPTS[8]))
        n = len(prompt) - 1
        stage = engine.stages[0]

        def fill(seq: str, chunks: list[list[int]], prefix: str = "") -> tuple[list, Any]:
            for i, chunk in enumerate(chunks):
                stage.fill([StepRequest(seq, i, StepKind.PREFILL, chunk, final=i == len(chunks) - 1,
                                        mtp_depth=2 if i == 0 else 0, prefix=prefix if i == 0 else "")])
            row, draft = take_rows(stage.filling.cache, [stage.filling.ids.index(seq)]), stage.filling.drafts[seq]
            stage.release(seq)  # (alone in each step, as the kept prefix was made)
            return row, draft

        def states() -> list[tuple[list, Any]]:
            return [fill("whole", [turn[:n], turn[n:-1], turn[-1:]]), fill("kept", [turn[n:-1], turn[-1:]], key)]

        def compared() -> tuple[list, list, list[float]]:  # (on the engine's MLX thread, which owns the arrays)
            (a, da), (b, db) = states()
            assert da.mtp_len == db.mtp_len == len(turn)  # (with the first token's entry, made to draft)
            assert (da.history.length, da.history.recent) == (db.history.length, db.history.recent)
            pairs = [(da.mtp_cache.keys[:, :, : da.mtp_len], db.mtp_cache.keys[:, :, : db.mtp_len]),
                     (da.mtp_cache.values[:, :, : da.mtp_len], db.mtp_cache.values[:, :, : db.mtp_len])]
            for ca, cb in zip(a, b):
                if isinstance(ca, RaggedKV):
                    assert ca.lengths == cb.lengths == [len(turn)]
                    pairs += [(ca.keys[:, :, : len(turn)], cb.keys[:, :, : len(turn)]),
                              (ca.values[:, :, : len(turn)], cb.values[:, :, : len(turn)])]
                else:
                    pairs += [(ca[0], cb[0]), (ca[1], cb[1])]
            return ([x.shape for x, _ in pairs], [y.shape for _, y in pairs],
                    [mx.abs(x - y).max().item() for x, y in pairs])

        shapes_a, shapes_b, diffs = engine.thread.call(compared)
        assert shapes_a == shapes_b and diffs == [0.0] * len(diffs), diffs
    finally:
        engine.close()


@pytest.mark.parametrize("depth", [2, "auto", 0])
def test_what_a_request_keeps_at_its_end_is_what_a_prefill_of_its_tokens_leaves(dense_ckpt: Path,
                                                                                 depth: int | str) -> None:
    """A request's state kept as it ends (its prompt and reply but the last token, never fed) equals a
    prompt prefilled whole to the same point: every cache, the MTP head's entries and pending hidden, to
    1e-5 (decode rounds and a prefill differ in low-order bits). `auto` on this checkpoint drafts at
    first and then mostly not: the pairs of its rounds without drafts go into the entries as it ends."""
    import numpy as np

    ended = batch_engine(dense_ckpt, dtype=mx.float32)
    whole = batch_engine(dense_ckpt, dtype=mx.float32)
    try:
        prompt = list(ended.tokenizer.encode(TEXT))
        reply = run(ended, prompt, depth).tokens
        tokens = tuple(prompt + reply[:-1])
        (key,) = [k.key for k in kept(ended) if k.tokens == tokens]
        run(whole, list(tokens) + [reply[-1]], depth)  # its prompt's state before the last token: `tokens`
        (other,) = [k.key for k in kept(whole) if k.tokens == tokens]

        def arrays(engine: BatchEngine, key: str) -> tuple[dict[str, Any], list[np.ndarray]]:
            p = engine.stages[0].prefixes[key]
            meta = {"length": p.length, "mtp_len": p.mtp_len, "drafts": p.drafts, "recent": p.recent[-20:]}
            return meta, [np.array(a) for a in p.arrays()]

        (meta_a, a), (meta_b, b) = ended.thread.call(lambda: arrays(ended, key)), whole.thread.call(lambda: arrays(whole, other))
        assert meta_a == meta_b and meta_a["length"] == len(tokens)
        assert meta_a["drafts"] == (depth != 0) and (meta_a["mtp_len"] == len(tokens) - 1 or depth == 0)
        assert [x.shape for x in a] == [y.shape for y in b]
        assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) <= 1e-5
    finally:
        ended.close()
        whole.close()


def test_the_next_turn_goes_on_from_where_the_reply_ended(dense_ckpt: Path, moe_ckpt: Path) -> None:
    """A chat's next turn (its prompt, the reply, a new message) prefills only the new message, and gives
    the tokens of a whole prefill: greedy at depths 0-3 and auto, seeded top-p, a repetition penalty
    (MoE, the same code past the MLP: some of them). The chats run at once, as rows of batches."""
    from concurrent.futures import ThreadPoolExecutor

    for path in (dense_ckpt, moe_ckpt):
        whole = batch_engine(path, dtype=mx.float32, prefix_cache=0)
        cached = batch_engine(path, dtype=mx.float32)
        try:
            prompt = list(cached.tokenizer.encode(TEXT))
            cases = [(0, {}), (1, {}), (2, {}), (3, {}), ("auto", {}),
                     ("auto", {"params": SamplingParams(temperature=0.9, top_p=0.95, seed=7)}),
                     (2, {"params": SamplingParams(repetition_penalty=1.3)})]
            cases = cases if path == dense_ckpt else cases[3:6]
            # (none the start of another)
            asked = [prompt + list(cached.tokenizer.encode(PROMPTS[i])) for i in range(len(cases))]

            def each(engine: BatchEngine, prompts: list[list[int]]) -> list[GenerationResult]:
                with ThreadPoolExecutor(len(prompts)) as pool:
                    return list(pool.map(lambda c: run(engine, c[0], c[1][0], **c[1][1]), zip(prompts, cases)))

            replies = [r.tokens for r in each(cached, asked)]
            turns = [a + r + list(cached.tokenizer.encode(PROMPTS[10])) for a, r in zip(asked, replies)]
            for (depth, kw), a, reply, going_on, reference in zip(cases, asked, replies, each(cached, turns),
                                                                  each(whole, turns)):
                assert going_on.stats.cached_tokens == len(a) + len(reply) - 1, (depth, kw)
                assert going_on.tokens == reference.tokens, (depth, kw)
                if depth in (1, 2, 3):  # the MTP head went on from where it ended: the same drafts and verdicts
                    assert (going_on.stats.drafted, going_on.stats.accepted) == (reference.stats.drafted,
                                                                                 reference.stats.accepted)
        finally:
            whole.close()
            cached.close()


def test_a_round_keeps_no_token_past_the_end_of_its_sequence() -> None:
    from mtpipe.node.acceptance import kept_of_round

    stops = frozenset({9})
    assert kept_of_round([1, 2, 3, 4], None, stops) == 4  # no budget told
    assert kept_of_round([1, 2, 3, 4], 2, stops) == 2
    assert kept_of_round([1, 9, 3, 4], 5, stops) == 2  # through the stop token
    assert kept_of_round([1, 2, 3], 0, stops) == 1  # (a round always yields its first token)


def test_a_reply_cut_at_max_tokens_is_kept_where_it_was_cut(dense_ckpt: Path) -> None:
    """Drafts accepted past max_tokens are not fed: the state kept at the request's end is its prompt
    and the reply it returned, and the next turn goes on from there (seeded sampling accepts often here).
    The drafts accepted within the reply still count as accepted, as on the per-sequence path, which
    feeds them all."""
    whole = batch_engine(dense_ckpt, dtype=mx.float32, prefix_cache=0)
    cached = batch_engine(dense_ckpt, dtype=mx.float32)
    alone = local_engine(dense_ckpt, dtype=mx.float32)
    try:
        for seed in range(6):
            params = SamplingParams(temperature=1.0, seed=seed)
            prompt = list(cached.tokenizer.encode(PROMPTS[seed] + PROMPTS[seed + 1]))
            first = GenerationRequest(prompt, max_tokens=6, mtp_depth=3, params=params)
            got, reference = cached.complete(first), alone.complete(first)
            reply = got.tokens
            assert len(reply) == 6 and reply == reference.tokens
            assert got.stats.accepted_per_position == reference.stats.accepted_per_position, seed
            turn = prompt + reply + list(cached.tokenizer.encode(PROMPTS[12]))
            req = GenerationRequest(turn, max_tokens=4, mtp_depth=3, params=params)
            going_on = cached.complete(req)
            assert going_on.stats.cached_tokens == len(prompt) + len(reply) - 1, seed
            assert going_on.tokens == whole.complete(req).tokens, seed
    finally:
        whole.close()
        cached.close()


def test_a_request_ending_near_the_budget_keeps_its_end_when_it_fits_once_its_row_is_gone(dense_ckpt: Path) -> None:
    """The memory budget holds one running row and one kept prompt: as the request ends, its row goes,
    so its end state fits beside its prompt's, and the next turn goes on from it."""
    engine = batch_engine(dense_ckpt, dtype=mx.float32, prefix_cache=1 << 30)
    try:
        prompt = list(engine.tokenizer.encode(TEXT))
        engine.budget = plan.batch_bytes(engine.dims, [plan.footprint(len(prompt) + TOKENS, 2)])
        engine.budget += plan.kept_bytes(engine.dims, len(prompt))
        reply = run(engine, prompt, 2).tokens
        assert {k.tokens for k in kept(engine)} == {tuple(prompt[:-1]), tuple(prompt + reply[:-1])}
        turn = prompt + reply + list(engine.tokenizer.encode(PROMPTS[10]))
        assert run(engine, turn, 2).stats.cached_tokens == len(prompt) + len(reply) - 1
    finally:
        engine.close()


def test_a_reply_that_ends_on_its_stop_token_is_kept_through_it(dense_ckpt: Path) -> None:
    """A reply a stop token id ends holds that token (vLLM's rule); its state, which was fed every token
    before it, is kept, and the next turn (the reply as returned, then a message) prefills only the message:
    so too when the stop token's text, kept (include_stop_str_in_output), matches a stop string, and
    the text then ends with it."""
    engine = batch_engine(dense_ckpt, dtype=mx.float32)
    whole = batch_engine(dense_ckpt, dtype=mx.float32, prefix_cache=0)
    try:
        tok = engine.tokenizer
        for n, keep in enumerate([False, True]):
            prompt = list(tok.encode(PROMPTS[n] + PROMPTS[3]))
            full = whole.complete(GenerationRequest(prompt, max_tokens=24, mtp_depth=0)).tokens
            at = next(i for i in range(2, len(full)) if full[i] not in full[:i]
                      and tok.decode([full[i]]).strip() and "\ufffd" not in tok.decode([full[i]]))  # (a whole character)
            extra = {"include_stop_str_in_output": True, "stop": [tok.decode([full[at]])]} if keep else {}
            reply = engine.complete(GenerationRequest(prompt, max_tokens=24, mtp_depth=2,
                                                      stop_token_ids=[full[at]], **extra))
            assert reply.finish_reason == "stop" and reply.tokens[-1] == full[at]
            assert reply.text == tok.decode(reply.tokens if extra else reply.tokens[:-1]), extra
            turn = prompt + reply.tokens + list(tok.encode(PROMPTS[10]))
            req = GenerationRequest(turn, max_tokens=4, mtp_depth=2)
            going_on = engine.complete(req)
            assert going_on.stats.cached_tokens == len(prompt) + len(reply.tokens) - 1, extra
            assert going_on.tokens == whole.complete(req).tokens
    finally:
        engine.close()
        whole.close()


def test_a_request_a_stop_string_ends_keeps_no_end(dense_ckpt: Path) -> None:
    """Its state holds the tokens past the stop string, which the reply (and so a next turn) does not
    have: only its prompt's prefix is kept."""
    engine = batch_engine(dense_ckpt, dtype=mx.float32)
    try:
        prompt = list(engine.tokenizer.encode(PROMPTS[12]))
        texts = [engine.tokenizer.decode([t]) for t in run(engine, prompt).tokens[2:-2]]
        stop = next(t for t in texts if t.strip() and "\ufffd" not in t)  # (a whole character or more)
        engine.thread.call(lambda: [engine._drop_kept([k.key]) for k in list(engine._kept.values())])
        got = engine.complete(GenerationRequest(prompt, max_tokens=TOKENS, mtp_depth=0, stop=[stop]))
        assert got.finish_reason == "stop" and len(got.tokens) < TOKENS
        assert [k.tokens for k in kept(engine)] == [tuple(prompt[:-1])]
    finally:
        engine.close()


def test_a_request_ends_where_its_row_does_only_on_its_budget_or_an_eos() -> None:
    """Only then does its state end where its reply does (`ended_in_stages`): not where a stop string
    in a token before ended it, even in a round that goes on to an EOS; an EOS whose own text holds a
    stop string (include_stop_str_in_output) still ends it, with nothing past it."""
    from mtpipe.coordinator.engine.request import ended_in_stages

    eos = {2}
    assert ended_in_stages([5, 6, 2], eos, 11, 20)  # the EOS, the last handed out
    assert not ended_in_stages([5], eos, 9, 20)  # a stop string at 5 (an EOS may follow in the round)
    assert ended_in_stages([5, 6], eos, 20, 20)  # its budget (its last token never fed)
    assert not ended_in_stages([5, 6], eos, 12, 20)  # (still going)


def test_a_request_no_drop_could_admit_waits_with_the_kept_prefixes_left_alone(dense_ckpt: Path) -> None:
    """Beside running rows a request that would not fit even with nothing kept waits (and is refused)
    with the kept prefixes as they were: dropping them would gain it nothing and cost the next turns."""
    probe = batch_engine(dense_ckpt, dtype=mx.float32, prefix_cache=0)
    tokenizer, dims = probe.tokenizer, probe.dims
    probe.close()
    text = list(tokenizer.encode("".join(PROMPTS)))
    row = plan.footprint(20 + 3000, 0)
    budget = plan.batch_bytes(dims, [row, row]) + 3 * plan.kept_bytes(dims, 200)  # two long rows, a few prefixes
    # (rows admitted for all their max tokens: by a horizon, the third one would be, and preempted later)
    engine = batch_engine(dense_ckpt, dtype=mx.float32, memory_budget=budget, prefix_cache=budget // 4,
                          queue_timeout=1.0, horizon=None)
    try:
        first = engine.complete(GenerationRequest(text[:60], max_tokens=8))
        never = SamplingParams(logit_bias=tuple((t, -100.0) for t in sorted(engine.eos)))
        running = [engine.generate(GenerationRequest(text[100 + 30 * i : 120 + 30 * i], max_tokens=3000,
                                                     params=never)) for i in range(2)]
        for stream in running:
            next(stream)
        before = sorted(k.key for k in kept(engine))
        with pytest.raises(ServerBusy):
            engine.complete(GenerationRequest(text[200:220], max_tokens=3000, params=never))
        assert sorted(k.key for k in kept(engine)) == before
        for stream in running:
            stream.close()
        turn = text[:60] + first.tokens + list(tokenizer.encode(PROMPTS[3]))
        assert engine.complete(GenerationRequest(turn, max_tokens=4)).stats.cached_tokens == 60 + len(first.tokens) - 1
    finally:
        engine.close()


def test_a_kept_prefix_that_alone_keeps_a_request_out_goes(dense_ckpt: Path) -> None:
    """The prefix the queue's head would go on from is spared while room is made, unless it is what
    keeps the head out: then it goes and the prompt is prefilled whole, rather than the request
    waiting for a running row and being refused (503) although it fits."""
    probe = batch_engine(dense_ckpt, dtype=mx.float32)
    tokenizer, dims = probe.tokenizer, probe.dims
    probe.close()
    text = list(tokenizer.encode("".join(PROMPTS)))
    kept, long_row = text[:120], list(tokenizer.encode(PROMPTS[5]))
    head = kept[:119] + text[200:210]  # goes on from the kept prefix
    budget = plan.batch_bytes(dims, [plan.footprint(len(long_row) + 3000, 0),
                                     plan.footprint(len(head) + 4, 0)])  # the two rows, nothing else
    engine = batch_engine(dense_ckpt, dtype=mx.float32, memory_budget=budget, prefix_cache=budget, queue_timeout=1.0)
    try:
        engine.complete(GenerationRequest(kept, max_tokens=1))
        assert 119 in engine.thread.call(lambda: [len(k.tokens) for k in engine._kept.values()])
        never = SamplingParams(logit_bias=tuple((t, -100.0) for t in sorted(engine.eos)))
        running = engine.generate(GenerationRequest(long_row, max_tokens=3000, params=never))
        next(running)
        result = engine.complete(GenerationRequest(head, max_tokens=4))  # (ServerBusy: refused)
        assert result.finish_reason == "length" and engine.thread.call(lambda: len(engine._decoding)) == 1
        running.close()
    finally:
        engine.close()
