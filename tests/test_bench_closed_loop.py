"""`mtpipe bench serve`'s closed loop (coordinator/bench/serve_steady.py): c clients each send their
next request as the last one ends, on the engine and on mlx-lm's BatchGenerator, and the figure counts
only the time every slot was taken."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_threads import record_mlx_threads

from mtpipe.coordinator.bench.serve import _mlx_load, _request
from mtpipe.coordinator.bench.serve_steady import engine_closed_loop, lengths, mlx_lm_closed_loop, steady_window
from mtpipe.coordinator.bench.streams import Decode
from mtpipe.coordinator.engine.build import batch_engine


def test_the_window_is_while_every_slot_is_taken() -> None:
    # Two slots, four requests sent in this order: a and b at once, c when a ended, d when b ended.
    a = ([1.0, 2.0, 3.0], [1.0, 1.0, 1.0], 3.0)
    b = ([2.0, 4.0, 6.0], [1.0, 2.0, 2.0], 6.0)
    c = ([4.0, 5.0, 7.0], [1.0, 1.0, 1.0], 7.0)
    d = ([7.0, 8.0], [1.0, 1.0], 8.0)
    # Open when b (the later of the first two) has its first token, at 2; close at the third end (7): from
    # then on one slot stays empty. Tokens in (2, 7]: a 1, b 2 + 2, c 1 + 1 + 1, d 1.
    assert steady_window([a, b, c, d], 2) == Decode(9.0, 5.0)
    # One request per slot: a wave, up to its first end.
    assert steady_window([a, b], 2) == Decode(1.0, 1.0)
    assert steady_window([a], 2) == Decode() and steady_window([], 1) == Decode()
    assert steady_window([([], [], 1.0), ([], [], 2.0)], 2) == Decode()  # no token at all


def test_lengths_spread_around_the_asked_length() -> None:
    sizes = lengths(32, 128)
    assert min(sizes) >= 64 and max(sizes) < 192 and len(set(sizes)) == 32
    assert sum(sizes) / 32 == pytest.approx(128, rel=0.05)
    assert lengths(4, 1) == [1, 1, 1, 1]  # never below one token


def test_the_engine_loop_sends_each_request_as_one_ends(dense_ckpt: Path) -> None:
    engine = batch_engine(dense_ckpt, max_rows=4)
    try:
        prompts = [list(engine.tokenizer.encode(t)) for t in ("def f(x):\n", "import os\n", "class A:\n")]

        def request(i: int):
            return _request(engine, prompts[i % 3], 6, "auto" if i % 2 else "no_mtp")

        with record_mlx_threads() as rec:
            recs = engine_closed_loop(engine, request, 2, 5)
        assert rec.threads <= {"mlx-engine"}  # the clients only hand requests over
        assert len(recs) == 5 and all(r.done.is_set() and r.tokens and r.ended >= r.times[-1] for r in recs)
        ends = sorted(r.ended for r in recs)
        for i in range(2, 5):  # the i-th sent came in only once i - 1 had ended
            assert recs[i].times[0] >= ends[i - 2]
        assert steady_window([(r.times, r.counts, r.ended) for r in recs], 2).tps > 0
        # prompt 0 went first without drafts and fourth with auto, beside other rows: the same greedy tokens
        assert recs[0].tokens == recs[3].tokens
    finally:
        engine.close()


def test_mlx_lm_loop_keeps_its_slots_full_and_runs_on_the_mlx_thread(dense_ckpt: Path) -> None:
    engine = batch_engine(dense_ckpt, max_rows=4)
    try:
        model, tokenizer = engine.thread.call(_mlx_load, str(dense_ckpt))
        prompts = [list(tokenizer.encode(t)) for t in ("def f(x):\n", "import os\n", "class A:\n")]
        with record_mlx_threads() as rec:
            streams = engine.thread.call(mlx_lm_closed_loop, model, tokenizer, prompts, 2, [6, 3, 6, 2, 4])
        assert rec.threads == {"mlx-engine"}
        assert len(streams) == 5
        assert all(e > 0 and len(t) == len(n) <= size and (not t or t[-1] <= e)
                   for (t, n, e), size in zip(streams, [6, 3, 6, 2, 4]))
        ends = sorted(e for _, _, e in streams)
        for i in range(2, 5):
            assert not streams[i][0] or streams[i][0][0] >= ends[i - 2]
        assert steady_window(streams, 2).tps > 0
    finally:
        engine.close()


def test_requests_ask_for_no_more_than_their_prompt_leaves_room_for(dense_ckpt: Path) -> None:
    """The closed loop asks up to 1.5x max tokens: near the context limit it takes what room is left."""
    from mtpipe.coordinator.bench.serve import closed_loop
    from mtpipe.node.protocol import SamplingParams

    engine = batch_engine(dense_ckpt, max_rows=4)
    try:
        prompts = [list(engine.tokenizer.encode(t)) for t in ("def f(x):\n", "import os\n")]
        engine.max_context = max(len(p) for p in prompts) + 3 + 8  # 8 tokens of room after 3 drafts
        tps, outputs = closed_loop(engine, None, prompts, [SamplingParams()] * 2, 2, 8, 0.0, per_client=2)
        sizes = [size for _, size, _ in outputs["auto"]]
        assert max(sizes) <= 8 + max(len(p) for p in prompts) - min(len(p) for p in prompts) and min(sizes) >= 4
        assert all(len(toks) <= size for triples in outputs.values() for _, size, toks in triples)
        assert tps["no_mtp"] > 0 and tps["auto"] > 0
    finally:
        engine.close()


def test_a_failed_request_stops_the_loop(dense_ckpt: Path) -> None:
    """The engine refuses the third request sent: its error comes out, and no client sends another."""
    engine = batch_engine(dense_ckpt, max_rows=4)
    try:
        prompt = list(engine.tokenizer.encode("def f(x):\n"))
        asked: list[int] = []

        def request(i: int):
            asked.append(i)
            return _request(engine, prompt, 10**9 if i == 2 else 4, "no_mtp")  # past any context

        with pytest.raises(ValueError, match="maximum context length is"):
            engine_closed_loop(engine, request, 2, 8)
        assert sorted(asked) == [0, 1, 2] or sorted(asked) == [0, 1, 2, 3]  # (the other client's next, at most)
    finally:
        engine.close()
