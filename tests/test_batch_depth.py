"""One depth for the groups a client keeps in flight around a ring (batch_depth.py), over plain numbers.

A ring is simulated on a fake clock: groups take turns, so a group's round lasts from its drafts going
out until its verdict, and in between every other group's round runs too.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from mtpipe.node import batch_depth, batch_head
from mtpipe.node.batch_depth import HOLD_ROUNDS, DepthPlan
from mtpipe.node.batch_head import BatchHead
from mtpipe.node.depth import (
    PROBE_EVERY,
    PROBE_EVERY_MAX_BATCH,
    PROBE_STRETCH,
    Acceptance,
    DepthChooser,
    StageCosts,
)
from mtpipe.node.depth_rates import batch_rates, context_bucket

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


def ring(clock: Clock, heads: list[BatchHead], rounds: int, work: float = 0.8, kmaxes: list[int] | None = None,
         order: random.Random | None = None, processed: bool = False,
         jitter: float = 0.0) -> list[list[tuple[float, float, int]]]:
    """Verdicts of the groups' rounds in turn (or in a random order, each group one round in flight):
    a round's verdict comes after its own work on the ring (1 + work x depth, times a factor drawn
    within 1 +- `jitter`) since the verdict before, then its next drafts go out; each draft is accepted (while those before it were) at the
    stage's acceptance rate, and the row learns it. Returns each group's rounds as (drafts out,
    verdict, depth)."""
    kmaxes = kmaxes or [1] * len(heads)
    stage = heads[0].head.costs.acceptance
    rate = stage.accepted[0] / stage.reached[0]
    draws, pace = random.Random(5), random.Random(6)
    states = [SimpleNamespace(chooser=DepthChooser(k), depth=0, processed=processed) for k in kmaxes]
    for head, state in zip(heads, states):
        head.states = [state]
    history: list[list[tuple[float, float, int]]] = [[] for _ in heads]
    sent = [(clock.now, 0) for _ in heads]  # (when, depth) of each group's round on its way
    for n in range(rounds * len(heads)):
        i = order.randrange(len(heads)) if order else n % len(heads)
        head, state = heads[i], states[i]
        out, depth = sent[i]
        clock.now += (1.0 + work * depth) * (1.0 + jitter * (2.0 * pace.random() - 1.0))
        if not history[i]:
            head.plan.interrupt()  # the group's rows join at its first round's verdict (BatchHead.join)
        history[i].append((out, clock.now, depth))
        if depth:
            state.chooser.acceptance.record(depth, next((k for k in range(depth) if draws.random() >= rate), depth))
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


def test_drafts_that_tie_with_no_drafts_are_not_chosen_on_noisy_timings(clock: Clock) -> None:
    """Round times that vary by a quarter either way, and a draft that nearly pays for itself (1.6
    tokens for 1.65 rounds): estimates from a few such timings keep dipping below the truth, and a
    plan that took the best estimate would keep drafting at a loss. Drafting is chosen only when its
    gain shows through the estimates' noise (depth.settled), so the plan decodes without drafts but for
    probes; where drafting clearly pays it still drafts, through the same noise."""
    plan, head = DepthPlan(), stage_head()
    history = ring(clock, [BatchHead(head, plan)], 1500, work=0.65, jitter=0.25)
    assert drafting(history, skip=100) < 0.05
    plan, head = DepthPlan(), stage_head()
    head.costs.acceptance = Acceptance([1000.0], [900.0])
    history = ring(clock, [BatchHead(head, plan)], 1500, work=0.3, jitter=0.25)
    assert drafting(history, skip=100) > 0.9


@pytest.mark.parametrize("order,kmaxes", [(None, [1, 1, 1]), (7, [1, 1, 1]), (None, [3, 3, 1]), (11, [2, 3, 1])],
                         ids=["in-turn", "random-order", "shallow-member", "random-mixed"])
def test_only_rounds_every_group_ran_at_one_depth_are_timed(clock: Clock, monkeypatch: pytest.MonkeyPatch,
                                                            order: int | None, kmaxes: list[int]) -> None:
    """Every timing a shared plan takes is of a round at the plan's depth, and every round beside it
    ran that depth too (as far as its group's rows draft), also when groups come round out of turn
    or draft less than the others."""
    observed: list[tuple[int, float]] = []
    real = StageCosts.observe

    def observe(self: StageCosts, depth: int, context: int, seconds: float, now: float | None = None) -> None:
        observed.append((depth, clock.now))
        real(self, depth, context, seconds, now)

    monkeypatch.setattr(StageCosts, "observe", observe)
    plan = DepthPlan()
    head = stage_head()
    head.costs = head.costs.widened([1.0, 1.3, 1.6, 1.9])
    head.costs.acceptance = Acceptance([1000.0] * 3, [900.0] * 3)  # drafting pays: depths change, probes go both ways
    history = ring(clock, [BatchHead(head, plan) for _ in kmaxes], 200, work=0.3, kmaxes=kmaxes,
                   order=random.Random(order) if order is not None else None)
    assert len(observed) > 100
    assert len({d for d, _ in observed}) >= 2
    for depth, at in observed:
        timed = next(r for h in history for r in h if r[1] == at)  # the round whose verdict was timed
        assert timed[2] == depth
        for h, kmax in zip(history, kmaxes):
            assert all(d == min(depth, kmax) for out, end, d in h if out < timed[1] and end > timed[0]), (depth, timed)


def test_probes_are_timed_and_come_as_often_whatever_the_groups(clock: Clock) -> None:
    """A probe's depth gets timed (it is held until it is), and the oldest group alone decides: one
    group or four, a similar share of the ring's rounds goes to probes."""
    shares = []
    for groups in (1, 4):
        plan, head = DepthPlan(), stage_head()
        history = ring(clock, [BatchHead(head, plan) for _ in range(groups)], 600)
        table = plan.costs_by_rows[1]
        assert table.samples[(table.live and next(iter(table.live))[0], 1)] >= 3  # the probed depth: timed again and again
        shares.append(drafting(history, skip=100))
    assert 0 < shares[1] < 2 * shares[0] + 0.02


def test_rows_with_processed_logits_are_timed_in_a_plan_of_their_own(clock: Clock) -> None:
    """Rounds of rows with logits processors cost what plain rounds do not: they are timed in the plan
    of such batches, which chooses as a plain plan does; the plain plan's tables stay as they were, and
    a batch that changes kind leaves the plan it followed."""
    plan, head = DepthPlan(), stage_head()
    batch = BatchHead(head, plan)
    ring(clock, [batch], 40, processed=True)
    assert plan.processed is not None and {k for _, k in plan.processed.costs_by_rows[1].live} == {0, 1}
    assert 1 not in plan.costs_by_rows and batch in plan.processed.members and batch not in plan.members
    ring(clock, [batch], 5)
    assert batch in plan.members and batch not in plan.processed.members


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


def test_a_plan_probes_the_depth_above_where_it_was_never_timed(clock: Clock) -> None:
    """As for one sequence (test_depth.py): at a context length where the depth above the best was never
    timed, its cost is carried over, maybe too dear; it is probed within PROBE_EVERY rounds however
    far the plan's probes have backed off."""
    plan = DepthPlan()
    costs = plan.costs(1, StageCosts([2.0, 3.0, 3.6, 4.0]))
    for k, seconds in enumerate([2.0, 3.0, 9.0, 12.0]):  # short contexts: K=2 and K=3 timed in a slow stretch
        costs.observe(k, 100, seconds)
    for k in (0, 1):
        costs.observe(k, 2000, costs.live[(context_bucket(100), k)])
    costs.probe_gap = PROBE_EVERY_MAX_BATCH * PROBE_STRETCH

    class Member:  # (weakly referenced by the plan)
        pass

    member = Member()

    def rates(seconds: list[float]) -> list[tuple[float, float]]:  # one row, every draft accepted
        return batch_rates([([1.0] * 3, [1.0] * 3)], [3], seconds)

    depths = [plan.next(member, 1, 2000, 3, rates) for _ in range(PROBE_EVERY + HOLD_ROUNDS)]
    # the first choice is held while it waits for a timing (none comes here): the plan's probes count
    # its own decisions
    assert depths == [1] * (PROBE_EVERY + HOLD_ROUNDS - 1) + [2]
    # the probe is held in turn; then, where every depth was timed, the next waits for the plan's gap
    after = [plan.next(member, 1, 100, 3, rates) for _ in range(2 * PROBE_EVERY)]
    assert after == [2] * HOLD_ROUNDS + [1] * (2 * PROBE_EVERY - HOLD_ROUNDS)


def test_a_depth_held_for_one_row_does_not_hold_a_full_batch(clock: Clock) -> None:
    """A wave's last row drafts (it pays at one row) and the plan holds that depth until it is timed;
    the next batch of eight, where drafts cost more than they bring, decides afresh at once instead of
    running the held depth for its first rounds."""
    plan = DepthPlan()
    stage = StageCosts([1.0, 1.2])
    for rows, drafted in ((1, 1.2), (8, 3.0)):  # one row: a draft costs little; eight: it costs dear
        table = plan.costs(rows, stage)
        for _ in range(3):
            table.observe(0, 100, 1.0)
            table.observe(1, 100, drafted)

    class Member:  # (weakly referenced by the plan)
        pass

    member = Member()

    def rates(rows: int) -> batch_depth.Rates:
        return lambda seconds: batch_rates([([0.9], [0.9])] * rows, [1] * rows, seconds)

    assert plan.next(member, 1, 100, 1, rates(1)) == 1  # the last row of a wave drafts: held
    assert plan.held == HOLD_ROUNDS
    assert plan.next(member, 8, 100, 1, rates(8)) == 0  # the next wave's eight rows do not


def test_rows_of_a_fixed_depth_set_the_least_depth_the_plan_chooses(clock: Clock) -> None:
    """Beside rows of fixed depth 2 a batch's rounds are at least that wide: the plan times depths from
    there (a depth below could never be timed) and never chooses below it, even where no drafts would
    be best."""
    class Member:  # (weakly referenced by the plan)
        pass

    def rates(seconds: list[float]) -> list[tuple[float, float]]:
        return batch_rates([([0.05] * 3, [0.05] * 3)], [3], seconds)  # drafts almost never accepted

    plan, member = DepthPlan(), Member()
    table = plan.costs(1, StageCosts([1.0, 1.3, 1.6, 1.9]))
    assert plan.next(member, 1, 100, 3, rates, least=2) == 2  # nothing timed: 2 first, not 0
    for _ in range(3):
        for k in range(4):
            table.observe(k, 100, 1.0 + 0.3 * k)
    plan.timed()
    assert plan.next(member, 1, 100, 3, rates, least=2) == 2
    plan.timed()
    assert plan.next(member, 1, 100, 3, rates) == 0  # the same plan without such rows: no drafts


@pytest.mark.parametrize("plain_here", [1.0, 1.02, 2.4])
def test_a_depth_timed_at_another_batch_size_costs_what_the_rows_add_to_each_token(plain_here: float) -> None:
    """A depth timed at one row, read at eight: where eight rows cost about what one does, about what it
    cost at one row; where each row costs, each of its tokens a row pays what a plain round's row does,
    dearer than the plain rounds' ratio says. Narrower than where it was timed, it gets cheaper at least
    as the ratio says, never below a plain round."""
    plan = DepthPlan()
    one, eight = StageCosts([1.0, 1.7, 2.0, 2.3]), StageCosts([1.0, 1.7, 2.0, 2.3])
    plan.costs_by_rows = {1: one, 8: eight}
    for k, seconds in enumerate([1.0, 1.7, 2.0, 2.3]):
        one.observe(k, 100, seconds)
    eight.observe(0, 100, plain_here)
    seconds, _, _ = plan.round_seconds(8, 100)
    assert seconds[0] == pytest.approx(plain_here)
    extra = plain_here - 1.0
    assert seconds[1:] == pytest.approx([1.7 + 2 * extra, 2.0 + 3 * extra, 2.3 + 4 * extra])
    for k in (1, 2, 3):
        assert seconds[k] >= one.round_seconds(100)[k] * plain_here - 1e-12  # never below the ratio's scaling
    wide = StageCosts([1.0, 1.7, 2.0, 2.3])
    for k, s in enumerate(seconds):
        wide.observe(k, 100, s)
    lone = StageCosts([1.0, 1.7, 2.0, 2.3])
    lone.observe(0, 100, 1.0)
    plan.costs_by_rows = {1: lone, 8: wide}
    back, _, _ = plan.round_seconds(1, 100)
    assert back == pytest.approx([1.0, 1.7, 2.0, 2.3])
    assert all(b <= s / plain_here + 1e-12 and b >= 1.0 for b, s in zip(back, seconds))



def test_a_carried_cost_is_as_uncertain_as_the_plain_rounds_it_moved_by() -> None:
    """Cheaper plain rounds here than where a depth was timed (noise, or a batch size with less host work)
    make it cheaper, never below a plain round; and the plain rounds' errors, counted once for each of its
    tokens a row, make its error larger than the one it had there."""
    plan = DepthPlan()
    there, here = StageCosts([1.0, 1.05, 1.1, 1.15]), StageCosts([1.0, 1.05, 1.1, 1.15])
    plan.costs_by_rows = {8: there, 16: here}
    for seconds in ((1.0, 1.05, 1.1, 1.15), (1.1, 1.15, 1.2, 1.25)):
        for k, s in enumerate(seconds):
            there.observe(k, 100, s)
    here.observe(0, 100, 0.85)
    here.observe(0, 100, 0.95)
    seconds, noise, _ = plan.round_seconds(16, 100)
    assert all(s >= seconds[0] - 1e-12 for s in seconds[1:]) and seconds[3] == pytest.approx(seconds[0])
    assert all(n > e for n, e in zip(noise[1:], there.noise(100)[1:]))
    assert noise[3] > noise[1]
