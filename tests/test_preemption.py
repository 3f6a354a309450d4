"""Preemption in the batch engine (issue 12, admission by memory): a request is admitted with room to
grow by a horizon, not by all its max tokens; where the running rows outgrow the budget after all, the
last admitted leave to the head of the queue, and go on where they stopped once there is room, giving
the tokens they give without it (greedy and seeded rows, penalties and min_tokens counted across it)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import mlx.core as mx
import pytest
from batch_streams import (Stream, cancel_while_preempted, check_preemption_mix, encode, never_ends, nothing_scheduled,
                           preemption_mix, request)
from helpers import PROMPTS

from mtpipe.coordinator.engine import scheduler as plan
from mtpipe.coordinator.engine.build import batch_engine, local_engine

HORIZON = 8  # a small horizon: the rows below outgrow the budget within a few rounds
TOKENS = 48


def test_the_plan_admits_by_a_horizon_and_preempts_the_last_admitted() -> None:
    assert plan.reach(100, 10, 2000, 256) == 366  # what it holds, and room for the horizon
    assert plan.reach(100, 10, 50, 256) == plan.reach(100, 10, 50, None) == 150  # never past its end
    dims = plan.ModelDims(kv_bytes_per_token=10, state_bytes=1000)
    short, long = plan.footprint(100, 0), plan.footprint(10_000, 0)
    budget = plan.batch_bytes(dims, [short] * 4)
    assert plan.to_preempt([short] * 4, dims, budget) == 0
    assert plan.to_preempt([short, short, long], dims, budget) == 1  # the last admitted leaves
    assert plan.to_preempt([long, short, short], dims, budget) == 2  # the first stays, whatever it costs
    assert plan.to_preempt([long], dims, 0) == 0
    # One preempted was admitted once: it is never refused for the time it waits.
    queue = [plan.Waiting("new", short, 0.0), plan.Waiting("preempted", long, 0.0, preempted=True)]
    assert plan.expired(queue, 61.0, 60.0) == ["new"] and plan.expired(queue, 59.0, 60.0) == []


@pytest.mark.parametrize(("model", "stages"), [("dense", 1), ("moe", 2)])
def test_preempted_rows_go_on_where_they_stopped_token_identical(dense_ckpt: Path, moe_ckpt: Path, model: str,
                                                                 stages: int) -> None:
    path = dense_ckpt if model == "dense" else moe_ckpt
    reference = local_engine(path, dtype=mx.float32)
    # A queue timeout far shorter than a preempted row waits: one admitted once is never refused.
    engine = batch_engine(path, dtype=mx.float32, stages=stages, horizon=HORIZON, prefix_cache=0,
                          queue_timeout=0.05)
    try:
        # KV counted token by token (not in the steps the batch grows by), so that a few rounds outgrow it.
        dims = dataclasses.replace(engine.dims, kv_step=1)
        engine.thread.call(setattr, engine, "dims", dims)
        prompts = [encode(engine, p) for p in PROMPTS[:4]]
        reqs = preemption_mix(engine, prompts, TOKENS)
        # Room for all four with the horizon, not for all four at their ends.
        needs = [plan.footprint(len(r.prompt_tokens) + HORIZON, r.mtp_depth) for r in reqs]
        engine.thread.call(setattr, engine, "budget", plan.batch_bytes(dims, needs))
        assert plan.batch_bytes(dims, [plan.footprint(len(r.prompt_tokens) + TOKENS, r.mtp_depth)
                                       for r in reqs]) > engine.budget
        streams = [Stream(engine, r) for r in reqs]
        preempted = check_preemption_mix(streams, reference, TOKENS, lambda: engine.preemptions)
        # A preempted row waited far longer than the queue timeout, and was never refused.
        assert any(max(b - a for a, b in zip(s.stamps, s.stamps[1:])) > 0.05 for s in preempted)
        assert engine.thread.call(lambda: [st.sequences for st in engine.stages]) == [0] * stages
        assert engine.describe()["batch"]["preemptions"] == engine.preemptions
    finally:
        engine.close()
        reference.close()


def test_a_preempted_request_cancelled_while_it_waits_ends_and_holds_nothing(dense_ckpt: Path) -> None:
    engine = batch_engine(dense_ckpt, dtype=mx.float32, horizon=HORIZON, prefix_cache=0)
    try:
        dims = dataclasses.replace(engine.dims, kv_step=1)
        engine.thread.call(setattr, engine, "dims", dims)
        ends = never_ends(engine)
        first = request(encode(engine, PROMPTS[5]), 0, 2000, params=ends)
        second = request(encode(engine, PROMPTS[6]), 0, 2000, params=ends)
        needs = [plan.footprint(len(r.prompt_tokens) + HORIZON, 0) for r in (first, second)]
        engine.thread.call(setattr, engine, "budget", plan.batch_bytes(dims, needs))
        running, waiting = Stream(engine, first).first(), Stream(engine, second).first()
        cancel_while_preempted(engine, running, waiting, lambda: engine.preemptions)
        assert engine.thread.call(lambda: (engine.stages[0].sequences, len(engine._waiting))) == (0, 0)
        assert nothing_scheduled(engine)
    finally:
        engine.close()


def test_each_waiting_request_is_judged_on_its_own_need(dense_ckpt: Path) -> None:
    """A preempted row with a long prompt waits at the queue's head for room of its own, also when a new,
    short request waits behind it (judged on the short one's need, it was admitted and preempted again
    every unit)."""
    engine = batch_engine(dense_ckpt, dtype=mx.float32, horizon=HORIZON, prefix_cache=0)
    try:
        dims = dataclasses.replace(engine.dims, kv_step=1)
        engine.thread.call(setattr, engine, "dims", dims)
        ends = never_ends(engine)
        short, long = (request(encode(engine, text), 0, 2000, params=ends) for text in (PROMPTS[5], "".join(PROMPTS[:8])))
        engine.thread.call(setattr, engine, "budget", plan.batch_bytes(
            dims, [plan.footprint(len(long.prompt_tokens) + HORIZON, 0)] * 2))
        running, preempted = Stream(engine, short).first(), Stream(engine, long).first()
        deadline = time.monotonic() + 60
        while not engine.preemptions:
            assert time.monotonic() < deadline, "never preempted"
            time.sleep(0.01)
        new = Stream(engine, request(encode(engine, PROMPTS[6]), 0, 4, params=ends))
        while not engine.thread.call(lambda: any(x.req is new.req for x in engine._waiting)):
            assert time.monotonic() < deadline, "never queued"
        before = len(running.chunks)
        while len(running.chunks) < before + 20:  # (as many units of work, each a round of the running row)
            running._take()
        assert engine.preemptions == 1 and not new.chunks  # (it never overtakes the preempted one)
        for s in (new, preempted, running):
            s.handle.cancel()
            s.finish()
        assert engine.thread.call(lambda: (engine.stages[0].sequences, len(engine._waiting))) == (0, 0)
    finally:
        engine.close()


def test_priority_orders_the_queue_and_the_lowest_leaves_first(dense_ckpt: Path) -> None:
    """vLLM's priority policy (lower first): where rows outgrow the budget, the one of the lowest priority
    leaves though admitted first; a request of a higher priority overtakes those of lower ones in the queue
    (within a priority, first come, first served)."""
    engine = batch_engine(dense_ckpt, dtype=mx.float32, horizon=HORIZON, prefix_cache=0)
    try:
        dims = dataclasses.replace(engine.dims, kv_step=1)
        engine.thread.call(setattr, engine, "dims", dims)
        ends = never_ends(engine)
        low = request(encode(engine, PROMPTS[5]), 0, 2000, params=ends, priority=1)
        high = request(encode(engine, PROMPTS[6]), 0, 2000, params=ends, priority=0)
        needs = [plan.footprint(len(r.prompt_tokens) + HORIZON, 0) for r in (low, high)]
        engine.thread.call(setattr, engine, "budget", plan.batch_bytes(dims, needs))
        first, second = Stream(engine, low).first(), Stream(engine, high).first()
        deadline = time.monotonic() + 60
        while not engine.preemptions:
            assert time.monotonic() < deadline, "never preempted"
            time.sleep(0.01)
        assert engine.thread.call(lambda: [x.req for x in engine._waiting]) == [low]  # (admitted first, left first)
        # Behind it, in arrival order: one of its priority, then two of a higher one, which go first.
        later = [request(encode(engine, PROMPTS[i]), 0, 4, params=ends, priority=p) for i, p in ((7, 1), (1, -1), (2, -1))]
        streams = [Stream(engine, r) for r in later]
        while engine.thread.call(lambda: len(engine._waiting)) < 4:
            assert time.monotonic() < deadline, "never queued"
            time.sleep(0.01)
        second.handle.cancel()
        second.finish()  # (its room goes to the queue's head: the higher priorities, then the preempted one)
        ended = []
        for s in streams:
            s.finish()
            ended.append(s.ended_at)
        assert max(ended[1], ended[2]) < ended[0]
        while len(first.chunks) < 3:  # (and the preempted one goes on)
            first._take()
        first.handle.cancel()
        first.finish()
        assert engine.thread.call(lambda: (engine.stages[0].sequences, len(engine._waiting))) == (0, 0)
    finally:
        engine.close()
