"""One depth for the groups a client keeps in flight around a ring (batch_depth.py), over plain numbers.

A ring is simulated on a fake clock: groups take turns, so a group's round lasts from its drafts going
out until its verdict, and in between every other group's round runs too.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mtpipe.node import batch_depth, batch_head
from mtpipe.node.batch_depth import DepthPlan
from mtpipe.node.batch_head import BatchHead
from mtpipe.node.depth import Acceptance, DepthChooser, StageCosts

ACCEPTED = 0.6  # every draft position


class Clock:
    def __init__(self) -> None:
        self.now = 1.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(batch_depth, "time", c)
    monkeypatch.setattr(batch_head, "time", c)
    return c


def stage_head() -> SimpleNamespace:
    costs = StageCosts([1.0, 1.8], optimistic=True)
    costs.acceptance = Acceptance([1000.0], [1000.0 * ACCEPTED])
    return SimpleNamespace(model=None, mtp_pre_norm=False, costs=costs)


def ring(clock: Clock, heads: list[BatchHead], rounds: int, work: float = 0.8) -> list[list[tuple[float, float, int]]]:
    """Each group in turn: its round's verdict after its own work on the ring (1 + work x depth), then
    its next drafts go out. Returns each group's rounds as (drafts out, verdict, depth)."""
    states = [SimpleNamespace(chooser=DepthChooser(1), depth=0, processed=False) for _ in heads]
    for head, state in zip(heads, states):
        head.states = [state]
    history: list[list[tuple[float, float, int]]] = [[] for _ in heads]
    sent = [(clock.now, 0) for _ in heads]  # (when, depth) of each group's round on its way
    for _ in range(rounds):
        for i, (head, state) in enumerate(zip(heads, states)):
            out, depth = sent[i]
            clock.now += 1.0 + work * depth
            history[i].append((out, clock.now, depth))
            head._choose([SimpleNamespace(tokens=[0] * (depth + 1))], [100])
            head.handed_out = clock.now
            sent[i] = (clock.now, state.depth)
    return history


def drafting(history: list[list[tuple[float, float, int]]], skip: int = 50) -> float:
    rounds = [r for h in history for r in h[skip:]]
    return sum(d > 0 for _, _, d in rounds) / len(rounds)


def test_groups_in_flight_choose_the_depth_that_pays_for_all_of_them(clock: Clock) -> None:
    """A draft costs its group 0.8 of a round and is accepted 0.6 of the time: alone, a group would
    gain by it (1.6 tokens for 1.8), but around a ring its round also holds the other group's work,
    and for both groups together drafting loses (1.6 tokens each per 3.6, against 1 per 2). A group
    timing only its own rounds while the other decodes plainly would see 2.8 against 2.0 and draft."""
    plan, head = DepthPlan(), stage_head()
    history = ring(clock, [BatchHead(head, plan), BatchHead(head, plan)], 300)
    assert drafting(history) < 0.1  # probes only


def test_groups_in_flight_draft_where_it_pays_for_all_of_them(clock: Clock) -> None:
    plan, head = DepthPlan(), stage_head()
    head.costs.acceptance = Acceptance([1000.0], [900.0])
    history = ring(clock, [BatchHead(head, plan), BatchHead(head, plan)], 300, work=0.3)
    assert drafting(history) > 0.9


def test_only_rounds_every_group_ran_at_one_depth_are_timed(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every timing a shared plan takes covers rounds of all groups at the timed depth."""
    observed: list[tuple[int, float]] = []
    real = StageCosts.observe

    def observe(self: StageCosts, depth: int, context: int, seconds: float) -> None:
        observed.append((depth, clock.now))
        real(self, depth, context, seconds)

    monkeypatch.setattr(StageCosts, "observe", observe)
    plan = DepthPlan()
    head = stage_head()
    head.costs.acceptance = Acceptance([1000.0], [900.0])  # drafting pays: depths change, probes go both ways
    history = ring(clock, [BatchHead(head, plan) for _ in range(3)], 200, work=0.3)
    rounds = [r for h in history for r in h]
    assert len(observed) > 100
    assert {d for d, _ in observed} == {0, 1}
    for depth, at in observed:
        timed = next(r for h in history for r in h if r[1] == at)  # the round whose verdict was timed
        overlapping = [r for r in rounds if r[0] < timed[1] and r[1] > timed[0]]
        assert all(d == depth for _, _, d in overlapping), (depth, timed)


def test_a_group_that_ends_does_not_hold_the_others(clock: Clock) -> None:
    """A member that leaves (its rows are done) no longer counts for taking up a new depth."""
    plan = DepthPlan()
    head = stage_head()
    a, b = BatchHead(head, plan), BatchHead(head, plan)
    ring(clock, [a, b], 5)
    b.keep([])  # b's rows are all gone
    assert b not in plan.members
    ring(clock, [a], 40)
    assert {k for _, k in plan.costs_by_rows[1].live} == {0, 1}
    assert plan.clean_from < clock.now
