"""`mtp_depth auto`: the depth policy over plain numbers, and the engine keeping greedy output exact whatever it picks."""

from __future__ import annotations

import itertools
import math
import statistics
import time
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import PROMPTS

from mtpipe.coordinator.engine.build import local_engine
from mtpipe.coordinator.engine.request import AUTO_MAX_DEPTH, GenerationRequest, resolve_depth
from mtpipe.node import depth as policy
from mtpipe.node import depth_rates as arithmetic
from mtpipe.node.depth import NOISE_TIMINGS, Acceptance, DepthChooser, Probe, StageCosts
from mtpipe.node.depth_rates import DRIFT_SECONDS, best_of, depth_rates, expected_tokens, settled
from mtpipe.node.depth_acceptance import MEMORY, PRIOR_ACCEPTANCE
from mtpipe.node.protocol import SamplingParams


def test_expected_tokens_is_the_accepted_prefix_plus_one() -> None:
    assert expected_tokens([0.8, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.8, 0.5, 0.5], 2) == pytest.approx(1 + 0.8 + 0.4)
    assert expected_tokens([0.8, 0.5, 0.5], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)


def test_best_depth_weighs_acceptance_against_cost() -> None:
    cheap = [1.0, 1.1, 1.2, 1.3]  # verify costs little more than a decode (optimized BLAS, GPU)
    dear = [1.0, 2.0, 3.0, 4.0]  # a verify over K+1 tokens costs K+1 decodes (reference BLAS)
    def best_depth(acceptance: list[float], seconds: list[float]) -> int:
        return best_of(depth_rates(acceptance, seconds))

    assert best_depth([0.9, 0.9, 0.9], cheap) == 3
    assert best_depth([0.0, 0.0, 0.0], cheap) == 0  # drafts never accepted: no speculation
    assert best_depth([0.9, 0.9, 0.9], dear) == 0  # nothing pays when tokens cost what rounds cost
    assert best_depth([0.8, 0.1, 0.1], cheap) == 1  # later positions too unlikely to pay for themselves


def test_drafts_are_chosen_only_when_their_gain_shows_through_the_noise() -> None:
    """Round costs are estimates; the best of noisy estimates is whichever dipped. Drafting is chosen
    over no drafts only when its gain exceeds the estimates' error: their timings' spread, and the
    machine's drift between the moments they were timed."""
    rates = [100.0, 105.0]
    assert settled(rates, [0.0, 0.0], [1.0, 1.0]) == 1  # exact, timed together: the best
    assert settled(rates, [0.05, 0.05], [1.0, 1.0]) == 0  # a 5% gain within a 7% error
    assert settled(rates, [0.0, 0.0], [1.0, 1.0 + DRIFT_SECONDS]) == 0  # timed far apart
    assert settled(rates, [0.0, 0.0], [1.0, None]) == 0  # never timed
    assert settled(rates, [0.0, 0.0], [1.0, 1.0 + DRIFT_SECONDS], lead=0.0) == 1
    # a clear gain shows through both, and the deeper depth's larger gain still wins
    assert settled([100.0, 140.0, 150.0], [0.03] * 3, [0.0, 60.0, 60.0]) == 2


def test_a_costs_error_is_the_spread_of_its_latest_timings() -> None:
    """And a cost timed once or never is as uncertain as one timing on its table: a single slow timing
    of no drafts against a single fast one of drafts must not settle the choice."""
    costs = StageCosts(prior=[1.0, 2.0])
    costs.observe(0, 64, 1.0, now=5.0)
    assert costs.noise(64) == [0.0, 0.0]  # timed once, or never: taken at its word
    assert costs.when() == [5.0, None]
    for seconds in (1.2, 0.8, 1.0):
        costs.observe(0, 64, seconds, now=6.0)
    xs = [1.0, 1.2, 0.8, 1.0]
    spread = statistics.stdev(xs) / statistics.fmean(xs) / 2
    assert costs.noise(64)[0] == pytest.approx(spread)
    assert costs.noise(8192)[0] == pytest.approx(spread)  # from the nearest context length timed
    assert costs.noise(64)[1] == pytest.approx(2 * spread)  # never timed: one timing's spread on this table
    assert costs.when() == [6.0, None]
    for _ in range(NOISE_TIMINGS):
        costs.observe(0, 64, 1.0)
    assert costs.noise(64)[0] == 0.0  # only the latest timings count


def test_a_round_deeper_than_the_table_informs_no_choice() -> None:
    """A sequence of a fixed depth past every chooser's (mtp_depth 5 beside auto's 0-3) is timed on the
    same stage: its rounds are left out of the table, which an auto request then reads without
    reaching past its end."""
    costs = StageCosts(prior=[1.0, 1.5, 2.0, 2.5])
    costs.observe(5, 4096, 9.0)
    assert costs.live == {}
    costs.observe(0, 64, 1.0)
    costs.observe(2, 64, 2.2)
    assert len(costs.round_seconds(4096)) == 4 and len(costs.round_seconds(64)) == 4


def test_acceptance_counts_only_positions_that_were_reached() -> None:
    a = Acceptance.empty(3)
    a.record(drafted=3, accepted=1)  # d1 accepted, d2 rejected, d3 never judged
    a.record(drafted=3, accepted=3)
    a.record(drafted=1, accepted=0)
    assert a.reached == [3, 2, 1] and a.accepted == [2, 1, 1]
    assert a.rates(weight=0.0) == [pytest.approx(2 / 3), 0.5, 1.0]
    assert Acceptance.empty(2).rates([0.7, 0.2]) == [pytest.approx(0.7), pytest.approx(0.2)]  # prior alone


def test_a_new_sequence_tries_drafts_the_stage_average_would_not_pay_for() -> None:
    """A sequence's acceptance is taken a standard error above its estimate: a new one drafts where
    the stage's average acceptance would not pay, finds out what its own drafts are worth, and keeps
    drafting only if they pay (with the plain estimate it would never draft, so never find out)."""
    def stage() -> StageCosts:
        costs = StageCosts(prior=[1.0, 1.7, 2.2, 2.5])
        for k in range(4):
            costs.observe(k, 64, costs.prior[k])
        costs.acceptance = Acceptance([1000.0] * 3, [500.0] * 3)
        return costs

    plain = StageCosts(prior=[1.0, 1.7, 2.2, 2.5]).acceptance.rates([0.5] * 3)
    assert best_of(depth_rates(plain, [1.0, 1.7, 2.2, 2.5])) == 0
    for accepted, settles in ((0, 0), (3, 3)):
        costs, chooser = stage(), DepthChooser(kmax=3)
        first = chooser.next_depth(costs, 64)
        assert first > 0
        depth, depths = first, []
        for _ in range(30):
            chooser.acceptance.record(depth, min(accepted, depth))
            depth = chooser.next_depth(costs, 64)
            depths.append(depth)
        assert depths[-10:].count(settles) >= 8, (accepted, depths)


def test_batch_rows_hope_together_for_less_than_one_row_alone() -> None:
    """Rows' hopes add in quadrature, within a batch and across the batches that share rounds (a
    client's groups around a ring): eight new rows hope for less each than one alone, however they
    are split into groups."""
    fresh = Acceptance.empty(2)
    row = (fresh.rates([0.5, 0.5]), fresh.hopeful([0.5, 0.5]))
    seconds = [1.0, 1.6, 2.0]
    alone = arithmetic.hoped([arithmetic.batch_rates([row], [2], seconds)])
    assert alone == pytest.approx(depth_rates(row[1], seconds))
    eight = arithmetic.hoped([arithmetic.batch_rates([row] * 8, [2] * 8, seconds)])
    groups = arithmetic.hoped([arithmetic.batch_rates([row] * 2, [2] * 2, seconds) for _ in range(4)])
    assert groups == pytest.approx(eight)
    assert eight[0] == pytest.approx(8.0)  # no drafts: nothing to hope for
    for k in (1, 2):
        mean = 8 * depth_rates(row[0], seconds)[k]
        assert mean < eight[k] < 8 * depth_rates(row[1], seconds)[k]
    capped = arithmetic.batch_rates([row, row], [2, 0], seconds)  # a row that never drafts hopes for nothing
    assert capped[2][1] == pytest.approx(arithmetic.batch_rates([row], [2], seconds)[2][1])


def test_costs_widen_for_deeper_requests_and_keep_their_timings() -> None:
    costs = StageCosts(prior=[1.0, 2.0])
    costs.observe(1, 64, 3.0)
    costs.acceptance.record(1, 1)
    wide = costs.widened([1.0, 2.0, 3.0, 4.0])
    assert wide.kmax == 3 and wide.live == costs.live and wide.acceptance.reached == [1, 0, 0]
    assert len(wide.round_seconds(64)) == 4


def test_live_timings_replace_the_prior_per_context_length() -> None:
    costs = StageCosts(prior=[1.0, 1.5, 2.0])
    costs.observe(depth=1, context=100, seconds=3.0)
    near = costs.round_seconds(context=120)  # same power-of-two bucket
    assert near[1] == 3.0 and near[0] == pytest.approx(2.0) and near[2] == pytest.approx(4.0)  # others scaled 2x
    far = costs.round_seconds(context=5000)  # no timing there yet: the nearest bucket's scale
    assert far == [pytest.approx(2.0), pytest.approx(3.0), pytest.approx(4.0)]
    costs.observe(depth=1, context=100, seconds=1.0)
    assert costs.round_seconds(context=100)[1] == pytest.approx((1 - policy.EMA) * 3.0 + policy.EMA * 1.0)


def test_every_depth_is_timed_before_the_timings_are_trusted() -> None:
    costs = StageCosts(prior=[1.0, 5.0, 9.0])
    chooser = DepthChooser(kmax=2)
    picked = []
    for _ in range(3 * policy.WARMUP):
        k = chooser.next_depth(costs, 64)
        picked.append(k)
        costs.observe(k, 64, costs.prior[k])
    assert picked == [0] * policy.WARMUP + [1] * policy.WARMUP + [2] * policy.WARMUP
    assert costs.unmeasured(64, 2) is None and costs.unmeasured(4096, 2) == 0  # a new context length: again


def test_unreached_positions_take_the_rate_before_them() -> None:
    a = Acceptance([10, 2, 0], [8, 1, 0])
    assert a.extrapolated() == [0.8, 0.8, 0.8]
    assert Acceptance.empty(2).extrapolated() == [PRIOR_ACCEPTANCE] * 2


def test_a_sequence_at_depth_zero_probes_back() -> None:
    costs = StageCosts(prior=[1.0, 5.0, 9.0])  # drafting looks hopeless
    for k in range(3):
        for _ in range(policy.WARMUP):
            costs.observe(k, 64, costs.prior[k])
    chooser = DepthChooser(kmax=2)
    depths = [chooser.next_depth(costs, 64) for _ in range(8 * policy.PROBE_EVERY)]
    probes = [i + 1 for i, d in enumerate(depths) if d]
    assert set(depths) == {0, 1}  # probes go one depth up from 0
    # The first probe after PROBE_EVERY rounds; each one that confirms 0 doubles the wait for the next.
    # A probe lasts two rounds: the first, a change of depth, is not timed.
    P = policy.PROBE_EVERY
    assert probes == [P, P + 1, 3 * P, 3 * P + 1, 7 * P, 7 * P + 1]
    # The stage keeps what the probes learned and counts its rounds, whichever sequence runs them: the
    # next probe comes a whole gap after the last one, in a new sequence too. Its neighbour is
    # estimated far behind (a probe would rarely change the choice): the gap grows past PROBE_EVERY_MAX.
    later = DepthChooser(kmax=2)
    first = next(i + 1 for i in range(1000) if later.next_depth(costs, 64))
    assert costs.probe_gap == 8 * P > policy.PROBE_EVERY_MAX
    assert first == 7 * P + costs.probe_gap - len(depths)  # 8P rounds after the probe at round 7P


def test_short_sequences_of_a_stage_probe_up_and_down_in_turn() -> None:
    """Sequences shorter than the gap between probes share the stage's count: each probes at most once,
    and from a middle depth the stage's probes still alternate."""
    costs = StageCosts(prior=[1.0, 1.2, 1.4, 1.6])
    for k in range(4):
        costs.observe(k, 64, costs.prior[k])
    directions = []
    for _ in range(40):
        chooser = DepthChooser(kmax=3)
        chooser.acceptance = Acceptance([1e4, 1e4, 1e4], [9e3, 2e3, 1e3])  # known well: K=1 is the best
        for _ in range(policy.PROBE_EVERY):
            d = chooser.next_depth(costs, 64)
            if d != 1 and chooser.probe.held is not None:  # a probe's first round
                directions.append(d)
    assert len(directions) >= 4 and set(directions[:4]) == {0, 2}
    assert all(a != b for a, b in itertools.pairwise(directions))


def test_probes_go_up_and_down_in_turn() -> None:
    """From a depth between 0 and the most, probes alternate between the depth above and one below
    (each held two rounds), whatever the gap between them; from the ends, only one way. Below, the
    depth timed longest ago (here none was: the deepest below)."""
    for best, want in [(1, [2, 2, 0, 0, 2, 2, 0, 0]), (0, [1] * 8), (3, [2] * 8)]:
        costs, probe = StageCosts(prior=[1.0, 1.2, 1.4, 1.6]), Probe(hold=True)
        probes = [d for d in (probe.next(best, costs, 3) for _ in range(40 * policy.PROBE_EVERY)) if d != best]
        assert probes[:8] == want


def test_a_probe_is_judged_only_on_the_table_it_was_made_on() -> None:
    """A batch that changed size between a probe and its verdict chooses from another cost table,
    where the choice probed from may never have been the best: that says nothing of the probe."""
    wide, narrow = StageCosts(prior=[1.0, 2.0]), StageCosts(prior=[1.0, 1.2])
    wide.probe_gap = narrow.probe_gap = 4 * policy.PROBE_EVERY
    probe = Probe(most=policy.PROBE_EVERY_MAX_BATCH)
    probe.clock.rounds = 4 * policy.PROBE_EVERY
    assert probe.choose(best=0, costs=wide, kmax=1) == 1  # a probe, on the wide table
    assert probe.choose(best=1, costs=narrow, kmax=1) == 1  # the narrow table's own best, no verdict
    assert wide.probe_gap == narrow.probe_gap == 4 * policy.PROBE_EVERY
    assert probe.choose(best=0, costs=wide, kmax=1) == 0  # no verdict pending any more
    assert wide.probe_gap == 4 * policy.PROBE_EVERY
    # On the same table, a verdict that changes the choice starts the probes over.
    probe.clock.rounds += 4 * policy.PROBE_EVERY
    assert probe.choose(best=0, costs=wide, kmax=1) == 1
    assert probe.choose(best=1, costs=wide, kmax=1) == 1
    assert wide.probe_gap == policy.PROBE_EVERY


def test_probes_of_a_close_neighbour_back_off_to_the_usual_most() -> None:
    costs = StageCosts(prior=[1.0, 1.62, 9.0])  # one draft estimated just behind no drafts
    for k in range(3):
        costs.observe(k, 64, costs.prior[k])
    chooser = DepthChooser(kmax=2)
    chooser.acceptance = Acceptance([1e4, 1e4], [6e3, 6e3])  # known well: no hope beyond the estimate
    for _ in range(40 * policy.PROBE_EVERY):
        chooser.next_depth(costs, 64)
    assert costs.probe_gap == policy.PROBE_EVERY_MAX
    assert arithmetic.shortfall(arithmetic.depth_rates([0.6, 0.6], [1.0, 1.62, 9.0]), 0) < policy.PROBE_SHORTFALL


def test_a_deeper_depth_carried_over_too_dear_is_probed_soon() -> None:
    """At a new context length a depth's cost is carried over from where it was timed. Carried over too
    dear (timed there in a slow moment), it would keep a sequence from drafting deeper for its whole
    life while the stage's probes have backed off: the depth above the best is probed within
    PROBE_EVERY rounds wherever it was never timed, and the sequence climbs to the depth that pays."""
    true = [2.0, 3.0, 3.6, 4.0]
    costs = StageCosts(prior=list(true))
    for k, seconds in enumerate([2.0, 3.0, 9.0, 12.5]):  # short contexts: K=2 and K=3 timed in a slow stretch
        costs.observe(k, 100, seconds)
    costs.probe_gap = policy.PROBE_EVERY_MAX * policy.PROBE_STRETCH  # earlier probes kept confirming
    chooser = DepthChooser(kmax=3)
    chooser.acceptance = Acceptance([1e3] * 3, [1e3] * 3)  # every draft accepted
    depths: list[int] = []
    for _ in range(4 * policy.PROBE_EVERY):
        depth = chooser.next_depth(costs, 2000)
        if depths and depths[-1] == depth:  # a change of depth is not timed
            costs.observe(depth, 2000, true[depth])
        depths.append(depth)
    P = policy.PROBE_EVERY  # the stage's rounds, counted from 1: a probe comes at round P
    assert depths[:2] == [0, 0]  # no drafts are timed first at a new length
    assert depths[2:P - 1] == [1] * (P - 3)  # carried over, K=2 and K=3 look dear: one draft
    assert depths[P - 1:P + 1] == [2, 2]  # the depth above, never timed here, probed without waiting
    assert depths[P + 1:2 * P - 1] == [2] * (P - 2)  # it pays
    # That probe changed the choice, so the stage's probes come every P rounds again: the next one up
    assert depths[2 * P - 1:2 * P + 1] == [3, 3]
    # K=3 pays most; the probe between goes below, to the depth timed longest ago at this length (no
    # drafts, timed first), not to K=2, timed since
    assert depths[2 * P - 1:] == [3] * P + [0, 0] + [3] * (len(depths) - 3 * P - 1)


def test_a_depth_estimated_best_but_held_back_is_challenged_soon() -> None:
    """Drafting estimated a little faster than no drafts is not chosen while the gain lies within the
    costs' error (`settled`), which for a cost timed long ago counts the machine's drift besides. Only
    new timings tell whether it is behind or only stale, and the stage's probes may have backed off
    far: a depth not timed for CHALLENGE_AFTER timings is probed within CHALLENGE_EVERY rounds, and once
    timed afresh it is chosen. The stage's own probes come as they would without challenges."""
    C, P = policy.CHALLENGE_EVERY, policy.PROBE_EVERY
    probe, costs = Probe(), StageCosts(prior=[1.0, 1.5])
    got = [probe.next(0, costs, 1, challenger=1) for _ in range(3 * P + 1)]
    assert [i + 1 for i, d in enumerate(got) if d] == list(range(C, 3 * P + 1, C))
    assert costs.probe_gap == 4 * P  # the probes at P and 3P came, each confirming no drafts: the gap doubled twice
    assert [probe.next(0, costs, 1, challenger=None) for _ in range(P)] == [0] * P

    costs, now = StageCosts(prior=[1.0, 1.5]), time.perf_counter()
    costs.observe(1, 64, 1.5, now=now - 10.0)  # one draft: timed long ago, and many timings before these
    rates = depth_rates([0.6], [1.0, 1.5])  # drafts accepted as below: 1.067 times as fast as none
    for i in range(policy.CHALLENGE_AFTER):
        assert policy.challenger(rates, 0, costs, 64) is None  # timed lately: left to `settled`
        costs.observe(0, 64, 1.0, now=now)
    assert policy.challenger(rates, 0, costs, 64) == 1 and policy.challenger(rates, 1, costs, 64) is None
    chooser = DepthChooser(kmax=1)
    chooser.acceptance = Acceptance([1e4], [6e3])  # known well
    depths: list[int] = []
    for _ in range(2 * C - 1):
        depth = chooser.next_depth(costs, 64)
        if depths and depths[-1] == depth:  # (a change of depth is not timed)
            costs.observe(depth, 64, [1.0, 1.5][depth])
        depths.append(depth)
    assert depths[: C - 1] == [0] * (C - 1)  # within its drift: not chosen
    assert depths[C - 1:] == [1] * C  # challenged, timed afresh beside no drafts: chosen


def test_an_early_probe_is_one_try_per_context_length() -> None:
    """Rounds that never get timed (rows with logits processors in a batch, a row that cannot draft as
    deep) leave the depth above untimed: it is probed early once per context length, then waits for
    the stage's gap like any neighbour."""
    costs = StageCosts(prior=[1.0, 1.5])
    for context in (100, 2000):
        costs.observe(0, context, 1.0)
    costs.observe(1, 100, 1.5)
    costs.probe_gap = policy.PROBE_EVERY_MAX * policy.PROBE_STRETCH
    probe = Probe()
    P = policy.PROBE_EVERY

    def depths(context: int, rounds: int) -> list[int]:  # the depth above estimated far behind
        return [probe.next(0, costs, 1, behind=1.0, context=context) for _ in range(rounds)]

    assert depths(2000, 4 * P) == [0] * (P - 1) + [1] + [0] * (3 * P)  # never timed there: once, not every P rounds
    assert costs.probe_gap == policy.PROBE_EVERY_MAX * policy.PROBE_STRETCH  # the probe confirmed 0
    assert depths(100, 4 * P) == [0] * (4 * P)  # timed here: the gap
    assert depths(9000, 4 * P) == [1] + [0] * (4 * P - 1)  # a new length: one early try


def test_resolve_depth() -> None:
    assert resolve_depth(None, True) == (AUTO_MAX_DEPTH, True)
    assert resolve_depth(None, False) == (0, False)
    assert resolve_depth("auto", False) == (0, False)
    assert resolve_depth(2, True) == (2, False)
    with pytest.raises(ValueError, match="'deep'"):
        resolve_depth("deep", True)


def test_greedy_auto_is_exact_through_forced_depth_changes(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds without drafts keep their MTP pairs aside and hand them in when drafting resumes: whatever the
    schedule of depths, output equals plain decoding and every round carries the depth it was given."""
    schedule = [0, 0, 3, 1, 0, 2, 0, 0, 0, 3, 3, 0, 1]
    calls = {"n": 0}

    def forced(self: DepthChooser, costs: StageCosts, context: int) -> int:
        calls["n"] += 1
        return schedule[(calls["n"] - 1) % len(schedule)]

    engine = local_engine(ckpt, dtype=mx.float32)
    for text in PROMPTS[:4]:
        prompt = engine.tokenizer.encode(text)
        plain = engine.complete(GenerationRequest(prompt, max_tokens=40)).tokens
        with monkeypatch.context() as m:
            m.setattr(DepthChooser, "next_depth", forced)
            calls["n"] = 0
            out = engine.complete(GenerationRequest(prompt, max_tokens=40, mtp_depth=3, mtp_auto=True))
        assert out.tokens == plain
        assert sum(out.stats.depths.values()) == out.stats.rounds
        assert set(out.stats.depths) <= set(schedule) and out.stats.depths.get(3, 0) > 0


def test_seeded_sampled_auto_reproduces(dense_ckpt: Path) -> None:
    engine = local_engine(dense_ckpt, dtype=mx.float32)
    prompt = engine.tokenizer.encode(PROMPTS[1])
    req = GenerationRequest(prompt, max_tokens=32, params=SamplingParams(temperature=0.8, seed=11),
                            mtp_depth=3, mtp_auto=True)
    assert engine.complete(req).tokens == engine.complete(req).tokens


def test_a_new_context_length_times_no_drafts_and_scales_the_rest() -> None:
    costs = StageCosts(prior=[1.0, 1.2, 1.4])
    for k, seconds in enumerate([2.0, 3.0, 5.0]):  # every depth timed, at short contexts
        for _ in range(policy.TRUSTED):
            costs.observe(k, 100, seconds)
    assert costs.unmeasured(100, 2) is None
    # A new length: only the rounds without drafts are timed first (never a loss against no MTP) ...
    assert costs.unmeasured(8000, 2) == 0
    costs.observe(0, 8000, 4.0)
    assert costs.unmeasured(8000, 2) is None
    # ... and each depth's cost there is its own cost at the nearest length, scaled as no drafts scaled.
    assert costs.round_seconds(8000) == pytest.approx([4.0, 6.0, 10.0])
    costs.observe(1, 8000, 9.0)  # timed there: the timing stands
    assert costs.round_seconds(8000)[1] == 9.0


def test_depths_compare_as_measured_where_only_one_of_them_was_timed() -> None:
    """At a context length where a batch kept drafting, rounds without drafts may never have been
    timed: they compare with the drafting ones as they did where both were, not as the calibration
    (one short sequence) says, or drafts keep the calibration's odds there."""
    costs = StageCosts(prior=[1.0, 1.5, 2.0])
    costs.observe(0, 100, 2.0)
    costs.observe(1, 100, 4.0)  # twice rounds without drafts here, not 1.5 times
    costs.observe(1, 300, 6.0)  # the next length: only drafting rounds timed
    assert costs.round_seconds(300)[:2] == pytest.approx([3.0, 6.0])
    # never timed anywhere: the calibration's odds against the nearest depth timed there
    assert costs.round_seconds(300)[2] == pytest.approx(6.0 * 2.0 / 1.5)


def test_a_stalled_round_moves_the_estimate_a_bounded_step() -> None:
    costs = StageCosts(prior=[1.0, 1.2])
    costs.observe(0, 100, 2.0)
    costs.observe(0, 100, 50.0)  # the machine was busy elsewhere for a moment
    expected = (1 - policy.EMA) * 2.0 + policy.EMA * policy.OUTLIER * 2.0
    assert costs.round_seconds(100)[0] == pytest.approx(expected)


def test_rounds_with_logits_processors_are_timed_apart(ckpt: Path) -> None:
    """Such rounds are never queued ahead and accept fewer drafts: measured with plain ones, they would
    make no drafts look dear and drafts look worthless to every plain sequence."""
    engine = local_engine(ckpt, dtype=mx.float32)
    prompt = engine.tokenizer.encode(PROMPTS[0])
    engine.complete(GenerationRequest(prompt, max_tokens=24, mtp_depth=2, mtp_auto=True))
    head = engine.pipeline.stages[-1].head
    plain = dict(head.costs.samples)
    reached = list(head.costs.acceptance.reached)
    assert sum(plain.values()) > 0 and head.processed_costs is None
    processed = SamplingParams(presence_penalty=0.5)
    engine.complete(GenerationRequest(prompt, max_tokens=24, params=processed, mtp_depth=2, mtp_auto=True))
    assert head.costs.samples == plain and head.costs.acceptance.reached == reached
    assert sum(head.processed_costs.samples.values()) > 0


def test_a_depth_timed_dear_once_stays_worth_trying() -> None:
    """A depth's first timings on a stage may pay for building kernels for new shapes: until it has a
    few, it costs at most what the calibration says relative to rounds without drafts."""
    costs = StageCosts(prior=[1.0, 1.5], optimistic=True)
    costs.observe(0, 100, 2.0)
    costs.observe(1, 100, 9.0)  # its first round, with the kernels built
    assert costs.round_seconds(100) == pytest.approx([2.0, 3.0])
    for _ in range(policy.TRUSTED - 1):
        costs.observe(1, 100, 9.0)  # still dear: believed now
    assert costs.round_seconds(100)[1] > 3.0


def test_batch_cost_tables_follow_a_deeper_stage() -> None:
    """A sequence asking for deeper drafts than any before widens the stage's costs; the batch's
    tables per batch size follow (no depth past their end) and read the stage's acceptance."""
    from types import SimpleNamespace

    from mtpipe.node.batch_head import BatchHead

    head = SimpleNamespace(model=None, mtp_pre_norm=False, costs=StageCosts([1.0, 1.2], optimistic=True))
    batch = BatchHead(head)

    def rounds(state: SimpleNamespace, context: int, n: int) -> None:
        batch.states = [state]
        for _ in range(n):
            batch._choose([SimpleNamespace(tokens=[0] * (state.depth + 1))], [context])
            batch.handed_out = time.perf_counter()  # the round's drafts go out

    rounds(SimpleNamespace(chooser=DepthChooser(1), depth=0, processed=False), 100, 6)
    head.costs = head.costs.widened([1.0, 1.2, 1.4, 1.6])
    deeper = SimpleNamespace(chooser=DepthChooser(3), depth=0, processed=False)
    rounds(deeper, 100, 20)
    rounds(deeper, 5000, 20)  # a new context length: estimates scaled from the prior's shape
    table = batch.plan.costs_by_rows[1]
    assert len(table.prior) == 4 and {k for _, k in table.live} >= {2, 3}
    assert table.acceptance is head.costs.acceptance


def test_the_stage_prior_hears_from_every_sequence_alike() -> None:
    """Only a sequence's first rounds with drafts inform the stage's acceptance (the prior of new
    sequences): one whose drafts pay and that drafts for long must not make every new sequence look
    like it, while one whose drafts fail stops drafting early."""
    import numpy as np

    from mtpipe.node.head import DraftState, Head

    head = Head.__new__(Head)
    head.costs, head.processed_costs = StageCosts(prior=[1.0, 1.5]), None
    good, poor = (DraftState(SamplingParams(), 1, np.random.default_rng(0), None, chooser=DepthChooser(1))
                  for _ in range(2))
    for _ in range(200):
        head.record(good, 1, 1)
    for _ in range(5):
        head.record(poor, 1, 0)
    assert head.costs.acceptance.reached[0] == policy.PRIOR_ROUNDS + 5
    assert head.costs.acceptance.accepted[0] == policy.PRIOR_ROUNDS
    assert good.chooser.acceptance.reached[0] == 200 and poor.chooser.acceptance.accepted[0] == 0


def test_probes_below_go_to_the_depth_timed_longest_ago() -> None:
    costs = StageCosts(prior=[1.0, 1.2, 1.4, 1.6])
    for k in (0, 1, 2, 3, 2):
        costs.observe(k, 64, costs.prior[k])
    assert costs.stalest_below(3, 64) == 0
    costs.observe(0, 64, 1.0)
    assert costs.stalest_below(3, 64) == 1 and costs.stalest_below(1, 64) == 0
    assert costs.stalest_below(3, 5000) == 2  # nothing timed at that length: the deepest below


def test_depths_below_a_deep_best_are_timed_again() -> None:
    """Depths timed in a slow stretch make drafting deeper look better than it is. From K=3, probes of
    the next depth down only would renew K=2's estimate and never K=0's or K=1's: the sequence would
    draft at a loss for its whole life. Probes below go to the depth timed longest ago instead."""
    true = [1.0, 2.4, 3.4, 4.2]  # drafting loses (a wide batch on a CPU)
    costs = StageCosts(prior=list(true))
    for k, seconds in enumerate([1.6, 3.0, 4.0, 4.2]):  # all but K=3 timed once, in a slow stretch
        costs.observe(k, 64, seconds)
    chooser = DepthChooser(kmax=3)
    chooser.acceptance = Acceptance([1e3] * 3, [8e2] * 3)  # known well: 80% of drafts accepted
    depths: list[int] = []
    for _ in range(600):
        depth = chooser.next_depth(costs, 64)
        if depths and depths[-1] == depth:  # a change of depth is not timed
            costs.observe(depth, 64, true[depth])
        depths.append(depth)
    assert depths[0] == 3  # misled by the slow timings
    first_below = next(d for d in depths if d < 3)
    assert first_below == 0  # the probe below renews the depth timed longest ago, not K=2
    assert depths[-200:].count(0) > 190  # no drafts, with probes now and then


def test_drafting_rounds_compare_with_rounds_without_drafts_timed_beside_them() -> None:
    """The machine's pace drifts: a depth timed in a quiet moment must not look cheap against rounds
    without drafts timed in a busy one. Its cost is how it compared with the rounds timed beside it."""
    costs = StageCosts(prior=[1.0, 1.2, 1.4])
    costs.observe(0, 100, 1.0, now=0.0)
    costs.observe(1, 100, 2.0, now=0.1)  # a probe, beside rounds without drafts: twice as dear
    costs.observe(0, 100, 1.0, now=0.2)
    for i in range(30):  # then the machine slows by half, while the batch decodes without drafts
        costs.observe(0, 100, 1.5, now=10.0 + i)
    seconds = costs.round_seconds(100)
    assert seconds[0] == pytest.approx(1.5, rel=0.01)
    assert seconds[1] / seconds[0] == pytest.approx(2.0)  # not the quiet moment's 2.0 against a busy 1.5
    # A deeper probe beside the first compares through it; timings far apart say nothing of each other.
    costs.observe(1, 100, 3.0, now=50.0)
    costs.observe(2, 100, 4.5, now=50.1)
    costs.observe(0, 100, 1.5, now=50.2 + DRIFT_SECONDS)
    assert costs.paired[(7, 2)] == pytest.approx(costs.paired[(7, 1)] * 1.5)
    assert costs.round_seconds(100)[2] / costs.round_seconds(100)[0] == pytest.approx(costs.paired[(7, 2)])


def test_the_depth_run_lately_sets_the_pace_and_the_others_follow_it() -> None:
    """While a sequence drafts for long, rounds without drafts are not timed: their estimate follows the
    drafting rounds' own, as the two compared side by side, rather than stay as it was."""
    costs = StageCosts(prior=[1.0, 1.2])
    costs.observe(0, 100, 1.0, now=0.0)
    costs.observe(1, 100, 2.0, now=0.1)
    costs.observe(0, 100, 1.0, now=0.2)
    for i in range(30):  # the machine slows by half while only drafting rounds are timed
        costs.observe(1, 100, 3.0, now=5.0 + i)
    seconds = costs.round_seconds(100)
    assert seconds[1] == pytest.approx(3.0, rel=0.01)
    assert seconds[0] == pytest.approx(1.5, rel=0.01)


def test_a_depth_compared_side_by_side_a_few_times_is_uncertain() -> None:
    """One comparison is two timings' worth of noise: a depth compared once must not beat rounds
    without drafts on it (`settled` weighs this error)."""
    costs = StageCosts(prior=[1.0, 1.2])
    for i in range(8):
        costs.observe(0, 100, 1.0 + 0.2 * (i % 2), now=float(i) * 10)
    one = costs._spread()
    assert one > 0
    costs.observe(1, 100, 2.0, now=70.1)
    assert costs.noise(100)[1] == pytest.approx(one * math.sqrt(2.0))
    for i in range(40):
        costs.observe(0 if i % 2 else 1, 100, 2.0 - (i % 2), now=100.0 + i)
    assert costs.noise(100)[1] < one * math.sqrt(2.0) / 2


def test_drafting_rounds_compared_at_one_context_length_carry_over_to_another() -> None:
    costs = StageCosts(prior=[1.0, 1.5, 2.0])
    costs.observe(0, 100, 1.0, now=0.0)
    costs.observe(1, 100, 2.5, now=0.1)
    costs.observe(1, 100, 1.0, now=5.0)  # timed alone, in a quiet moment: no comparison
    costs.observe(0, 300, 4.0, now=9.0)  # the next length: rounds without drafts only
    assert costs.round_seconds(300)[1] == pytest.approx(4.0 * 2.5)


def test_a_sequence_hopes_again_for_positions_it_stopped_drafting_at() -> None:
    """A sequence's counts at positions it no longer drafts at fade, so a position judged on a few bad
    early rounds grows uncertain once the sequence drafts less deep, and is tried again; with counts
    that never fade it would stay judged on those rounds for the sequence's whole life. Positions it
    drafts at keep every count, so their error shrinks."""
    fading, lasting = Acceptance.empty(2, MEMORY), Acceptance.empty(2)
    for a in (fading, lasting):
        for _ in range(10):
            a.record(drafted=2, accepted=1)  # the first draft accepted, the second never
    low = fading.hopeful([0.7, 0.7])[1]
    assert low < 0.5
    for a in (fading, lasting):
        for _ in range(60):
            a.record(drafted=1, accepted=1)  # drafting one: the second position never reached
    assert lasting.hopeful([0.7, 0.7])[1] < 0.5
    assert fading.hopeful([0.7, 0.7])[1] > 0.75  # back near the prior, with its uncertainty
    assert fading.reached[0] == lasting.reached[0] == 70  # what it keeps drafting at stays known


def test_the_calibration_cap_follows_the_pace_of_rounds_without_drafts() -> None:
    """A depth timed a few times costs at most the calibration's odds against rounds without drafts as
    they cost now, not as they were last timed."""
    costs = StageCosts([1.0, 1.2, 1.4], optimistic=True)
    for depth, seconds, now in ((0, 1.0, 0.0), (1, 1.3, 0.1), (2, 1.5, 0.2), (1, 1.3, 0.3), (0, 1.0, 0.4)):
        costs.observe(depth, 100, seconds, now=now)
    for i in range(30):  # the machine slows by half while depth 1 runs
        costs.observe(1, 100, 2.6, now=5.0 + i)
    seconds = costs.round_seconds(100)
    assert seconds[0] == pytest.approx(2.0, rel=0.01) and seconds[2] > seconds[0]


def test_a_round_timed_at_zero_seconds_is_kept_finite() -> None:
    costs = StageCosts([1.0, 1.2])
    costs.observe(0, 100, 0.0, now=0.0)
    costs.observe(1, 100, 1.0, now=0.1)
    assert all(math.isfinite(s) and s > 0 for s in costs.round_seconds(100))
