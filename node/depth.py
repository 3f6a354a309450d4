"""How many drafts the next round carries (`mtp_depth auto`): the depth with the most tokens per second.

A round with K drafts yields 1 + a1 + a1*a2 + ... + a1*...*aK tokens on average, where ai is the
chance that draft i is accepted once drafts 1..i-1 were, and costs one verify over K+1 tokens plus K
draft steps. Both sides are measured: acceptance per sequence and per draft position (with the
stage's figures from every sequence's first rounds as the prior, and taken at one standard error
above the estimate, so a sequence finds out what its own drafts are worth; a sequence's counts at
positions it no longer drafts at fade, so it tries them again), costs per depth and per context
length on this stage (a calibration at load as the prior, then live timings of whole rounds, so hops
and other stages count too; a drafting depth as it compared with rounds without drafts timed beside
it, as the machine's pace drifts). The best of noisy estimates favours whichever dipped, so drafts
are chosen over none only when their gain exceeds the costs' error (`settled`). Depths whose costs
go stale are probed now and then, so a sequence that dropped to 0 drafts comes back when drafting
pays again; probes that keep confirming the choices come less often, on the whole stage, so a model
whose drafts never pay stops paying for probes.

A seeded sampled sequence draws the same tokens whatever its depths (acceptance.py), so its depth is
timed like any other.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from .depth_acceptance import MEMORY, Acceptance
from .depth_rates import DRIFT_SECONDS, best_of, context_bucket, depth_rates, nearest, settled, shortfall, spread

PRIOR_ROUNDS = 16  # rounds with drafts of each sequence that inform the stage's acceptance (the prior)
EMA = 0.2  # weight of a new timing
PAIRS_KEPT = (2 - EMA) / EMA  # about how many samples a moving average of weight EMA keeps
OUTLIER = 2.0  # a timing counts as at most this many times the estimate it updates
PROBE_EVERY = 16  # rounds between probes of a neighbouring depth, at first
PROBE_EVERY_MAX = 64  # probes that keep confirming the choice back off up to this
PROBE_EVERY_MAX_BATCH = 128  # the same for a batch, whose probe costs every row a round
CHALLENGE_EVERY = 8  # rounds at least between probes of a depth estimated best but not chosen (`challenger`)
CHALLENGE_AFTER = 16  # timings of other depths after which a depth estimated best, not chosen, is probed
# A neighbouring depth estimated this much slower than the best is within the estimates' noise; one
# estimated n times as far behind is probed up to n times less often (at most PROBE_STRETCH times).
PROBE_SHORTFALL = 0.1
PROBE_STRETCH = 4
WARMUP = 1  # timings of rounds without drafts a stage takes at each context length before choosing
TRUSTED = 3  # timings of a depth on a stage before they may say it costs more than the calibration
NOISE_TIMINGS = 8  # a cost's latest timings, whose spread says how far its estimate may be off


def challenger(rates: list[float], best: int, costs: StageCosts, context: int) -> int | None:
    """The depth estimated best where `settled` chose another, if `costs` took CHALLENGE_AFTER timings or
    more since it was last timed at this context length: only new timings tell it behind from stale."""
    top = best_of(rates)
    return top if top != best and costs.timings_since(top, context) >= CHALLENGE_AFTER else None


@dataclass
class Clock:
    """Rounds counted between probes: a batch's, or a whole stage's for its sequences."""

    rounds: int = 0
    last_probe: int = 0
    last_challenge: int = 0  # (`Probe`'s challenger: apart from the probes, which come as they would without)
    probes: int = 0  # probes from between 0 and the most drafts: up and down in turn


@dataclass
class StageCosts:
    """Seconds per round for each depth on one last stage: a calibrated prior, then live timings per
    context bucket. A round is everything between handing out drafts and knowing the verdict on them
    (host, hops, every stage's forward), plus drafting the next ones."""

    prior: list[float]  # round seconds for depth 0..kmax at load (verify + drafts)
    live: dict[tuple[int, int], float] = field(default_factory=dict)  # (bucket, depth) -> seconds
    # (bucket, depth > 0) -> its rounds' seconds over those of rounds without drafts, from timings side by side
    paired: dict[tuple[int, int], float] = field(default_factory=dict)
    pairs: dict[tuple[int, int], int] = field(default_factory=dict)  # (bucket, depth > 0) -> side-by-side samples
    # bucket -> its latest timings, as (depth, seconds, when), up to NOISE_TIMINGS of them
    lately: dict[int, list[tuple[int, float, float]]] = field(default_factory=dict)
    samples: dict[tuple[int, int], int] = field(default_factory=dict)  # (bucket, depth) -> timings taken
    timed_at: dict[tuple[int, int], int] = field(default_factory=dict)  # (bucket, depth) -> stage's timings at its last
    recent: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # (bucket, depth) -> latest timings
    last_timed: dict[int, float] = field(default_factory=dict)  # depth -> when it was last timed (perf_counter)
    probe_gap: int = PROBE_EVERY  # rounds between probes (of the stage's sequences, or of a batch)
    acceptance: Acceptance | None = None  # every sequence's counts: the prior for new ones
    # Under TRUSTED timings a depth costs at most what the calibration says: for timings that cannot
    # leave out a depth's first rounds on the stage (the batch head leaves out each shape's first).
    optimistic: bool = False
    clock: Clock = field(default_factory=Clock)  # the rounds of the stage's sequences (`DepthChooser`)
    tried: set[tuple[int, int]] = field(default_factory=set)  # (bucket, depth) probed early (`Probe`)
    # (bucket, depth) -> relative error (`noise`; nan: timed under twice), (-1, -1) -> `_spread`: read every
    # round, changed only by timings (of the depth; of any depth)
    _errors: dict[tuple[int, int], float] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.acceptance is None:
            self.acceptance = Acceptance.empty(len(self.prior) - 1)

    @property
    def kmax(self) -> int:
        return len(self.prior) - 1

    def widened(self, prior: list[float]) -> StageCosts:
        """The same measurements over a longer prior (a sequence asked for deeper drafts than any before)."""
        extra = len(prior) - len(self.prior)
        acceptance = Acceptance(self.acceptance.reached + [0.0] * extra, self.acceptance.accepted + [0.0] * extra)
        return StageCosts(prior, live=dict(self.live), paired=dict(self.paired), pairs=dict(self.pairs),
                          lately={b: list(xs) for b, xs in self.lately.items()},
                          samples=dict(self.samples), timed_at=dict(self.timed_at),
                          recent={k: list(v) for k, v in self.recent.items()}, last_timed=dict(self.last_timed),
                          probe_gap=self.probe_gap, acceptance=acceptance, optimistic=self.optimistic,
                          clock=self.clock, tried=set(self.tried))

    def observe(self, depth: int, context: int, seconds: float, now: float | None = None) -> None:
        """A round's timing. One far above the estimate (the machine busy elsewhere a moment) moves
        it by at most OUTLIER times: a depth that then looks dear is rarely chosen, so rarely
        timed again, and an estimate raised by a stall would keep it out for long. A round deeper
        than the table (a sequence of a fixed depth past every chooser's) informs no choice: left out."""
        if depth >= len(self.prior):
            return
        key = (context_bucket(context), depth)
        old = self.live.get(key)
        seconds = max(seconds, 1e-9) if old is None else min(max(seconds, 1e-9), OUTLIER * old)
        self.live[key] = seconds if old is None else (1 - EMA) * old + EMA * seconds
        now = time.perf_counter() if now is None else now
        self._pair(key[0], depth, seconds, now)
        self.recent[key] = (self.recent.get(key, []) + [seconds])[-NOISE_TIMINGS:]
        self.last_timed[depth] = now
        self.samples[key] = self.samples.get(key, 0) + 1
        for cached in [k for k in self._errors if k[1] in (depth, -1)]:
            del self._errors[cached]
        self.timed_at[key] = sum(self.samples.values())

    def _pair(self, bucket: int, depth: int, seconds: float, now: float) -> None:
        """Two depths compared on timings side by side: the machine's pace drifts, within tens of
        rounds, and a depth timed in a quiet moment would look cheap against rounds without drafts timed
        in a busy one (and the other way round), however many timings each estimate averages. So where
        the timing just before this one at this context length was of another depth, and not long
        before, the two are a sample of how the deeper compares with rounds without drafts (through the
        shallower's own comparison where that one drafts too)."""
        history = self.lately.get(bucket, [])
        before = history[-1] if history else None
        self.lately[bucket] = (history + [(depth, seconds, now)])[-NOISE_TIMINGS:]
        if before is None or before[0] == depth or now - before[2] > DRIFT_SECONDS:
            return
        (lo, lo_s), (hi, hi_s) = sorted([before[:2], (depth, seconds)])
        base = 1.0 if lo == 0 else self.paired.get((bucket, lo))
        if base is None:
            return
        ratio, old = base * hi_s / lo_s, self.paired.get((bucket, hi))
        self.paired[(bucket, hi)] = ratio if old is None else (1 - EMA) * old + EMA * ratio
        self.pairs[(bucket, hi)] = self.pairs.get((bucket, hi), 0) + 1

    def stalest_below(self, depth: int, context: int | None) -> int:
        """Of the depths under `depth`, the one timed longest ago at this context length (never: first;
        ties: the deepest). The machine's pace drifts, so an estimate not renewed since drifts away from
        the truth: a depth left below the best (no drafts, above all: what auto must never lose to)
        would otherwise be judged on an old timing for as long as the best stays above it."""
        bucket = context_bucket(context) if context is not None else None
        return min(range(depth), key=lambda k: (self.timed_at.get((bucket, k), -1), -k))

    def unmeasured(self, context: int, kmax: int) -> int | None:
        """A depth to time before choosing: each depth once on this stage, then no drafts at each new
        context length (never a loss against decoding without MTP), from which the other depths'
        costs there are scaled until they are timed there too."""
        timed = {k for _, k in self.samples}
        first = next((k for k in range(kmax + 1) if k not in timed), None)
        if first is not None:
            return first
        return 0 if self.samples.get((context_bucket(context), 0), 0) < WARMUP else None

    def timings_since(self, depth: int, context: int) -> int:
        """Timings on this table since `depth` was last timed at this context length (never: every one)."""
        return sum(self.samples.values()) - self.timed_at.get((context_bucket(context), depth), 0)

    def first_try(self, depth: int, context: int) -> bool:
        """Whether `depth` was neither timed nor probed early at this context length (its cost there is
        carried over from other lengths: `_measured`), marking it probed: an early probe is one try."""
        key = (context_bucket(context), depth)
        if key in self.samples or key in self.tried:
            return False
        self.tried.add(key)
        return True

    def round_seconds(self, context: int) -> list[float]:
        """Estimated seconds per round for each depth at this context length."""
        bucket = context_bucket(context)
        return [self._estimate(bucket, k) for k in range(len(self.prior))]

    def noise(self, context: int) -> list[float]:
        """Each depth's cost's relative standard error at this context length: the spread of its
        latest timings (where it was timed here, else at the nearest length where it was) over the
        square root of their number, which is about what the moving average keeps; for a cost timed
        once or never, one timing's spread on this table (`_spread`); for a cost compared side by side
        with rounds without drafts (`_pair`), at least what its few comparisons leave open."""
        bucket = context_bucket(context)
        return [self._noise(bucket, k) for k in range(len(self.prior))]

    def when(self) -> list[float | None]:
        """When each depth was last timed (at any context length)."""
        return [self.last_timed.get(k) for k in range(len(self.prior))]

    def _noise(self, bucket: int, depth: int) -> float:
        if (bucket, depth) not in self._errors:
            timed = [b for (b, k), xs in self.recent.items() if k == depth and len(xs) >= 2]
            xs = self.recent[(nearest(timed, bucket), depth)] if timed else []
            self._errors[(bucket, depth)] = math.sqrt(spread(xs) / len(xs)) if xs else math.nan
        error = self._errors[(bucket, depth)]
        error = self._spread() if math.isnan(error) else error
        if depth and (bucket, depth) in self.pairs:  # compared side by side: two timings' errors, as often as kept
            error = max(error, self._spread() * math.sqrt(2.0 / min(self.pairs[(bucket, depth)], PAIRS_KEPT)))
        return error

    def _spread(self) -> float:
        """The relative error of a cost timed once (or not at all): one timing's spread on this table,
        pooled over the costs timed at least twice (none yet: taken at its word)."""
        if (-1, -1) not in self._errors:
            parts = [spread(xs) for xs in self.recent.values() if len(xs) >= 2]
            self._errors[(-1, -1)] = math.sqrt(sum(parts) / len(parts)) if parts else 0.0
        return self._errors[(-1, -1)]

    def _estimate(self, bucket: int, depth: int) -> float:
        """Timed here, else measured against what was (`_measured`). In an optimistic table, while a
        depth has few timings on the stage, it costs at most what the calibration says relative to
        rounds without drafts: a depth that looked dear once would otherwise rarely be chosen again,
        so rarely timed again."""
        seconds = self._measured(bucket, depth)
        plain = self._measured(bucket, 0) if (bucket, 0) in self.live else None
        if self.optimistic and depth and plain is not None and self.prior[0] > 0 and self._timings(depth) < TRUSTED:
            seconds = min(seconds, self.prior[depth] * plain / self.prior[0])
        return seconds

    def _measured(self, bucket: int, depth: int) -> float:
        """Timed here (as it compared, side by side, with the depth most rounds here run lately, whose
        estimate is current: `_pace`, `_pair`); else the nearest depth timed here, scaled as the two
        compare (`_ratio`); else what the nearest context length with timings says. The calibration's
        own comparisons (one short sequence) are the last resort: at other batch sizes and context
        lengths depths compare differently, and a depth whose rival was only calibrated would keep the
        calibration's odds."""
        pace = self._pace(bucket)
        if pace is not None and pace != depth:
            theirs, ours = self._relative(bucket, pace), self._relative(bucket, depth)
            if theirs is not None and ours is not None:
                return self.live[(bucket, pace)] * ours / theirs
        if (bucket, depth) in self.live:
            return self.live[(bucket, depth)]
        here = [k for b, k in self.live if b == bucket]
        if not here:
            timed = {b for b, _ in self.live}
            return self._measured(nearest(timed, bucket), depth) if timed else self.prior[depth]
        ref = min(here, key=lambda k: (abs(k - depth), k))
        return self._measured(bucket, ref) * self._ratio(depth, ref, bucket)

    def _pace(self, bucket: int) -> int | None:
        """The depth most of the latest timings at this context length were of: its estimate is
        current, and the others compare with it as they did side by side (`_pair`)."""
        depths = [d for d, _, _ in self.lately.get(bucket, [])]
        if not depths:
            return None
        return max(reversed(depths), key=depths.count)

    def _relative(self, bucket: int, depth: int) -> float | None:
        """depth's rounds over rounds without drafts at this context length, where known."""
        if (bucket, 0) not in self.live:
            return None
        if depth == 0:
            return 1.0
        if (bucket, depth) in self.paired:
            return self.paired[(bucket, depth)]
        return self.live[(bucket, depth)] / self.live[(bucket, 0)] if (bucket, depth) in self.live else None

    def _ratio(self, depth: int, ref: int, bucket: int) -> float:
        """How depth's rounds compare with ref's: where both compare with rounds without drafts (the
        nearest such context length), else where both were timed, else as calibrated."""
        relative = {b: (self._relative(b, depth), self._relative(b, ref)) for b in {b for b, _ in self.live}}
        known = {b: ours / theirs for b, (ours, theirs) in relative.items() if ours is not None and theirs is not None}
        if known:
            return known[nearest(known, bucket)]
        both = [b for b, k in self.live if k == depth and (b, ref) in self.live]
        if both:
            b = nearest(both, bucket)
            return self.live[(b, depth)] / self.live[(b, ref)]
        return self.prior[depth] / max(self.prior[ref], 1e-12)

    def _timings(self, depth: int) -> int:
        return sum(n for (_, k), n in self.samples.items() if k == depth)


@dataclass
class Probe:
    """Now and then another depth instead of the best, so its cost and acceptance stay current: the
    one above, and every other time one below (the one timed longest ago: `StageCosts.stalest_below`;
    from the most drafts, every probe goes below); less often, on the whole stage, while probes keep
    confirming the choice, down to one every `most` rounds, or fewer while the neighbours are
    estimated far behind (a probe then rarely changes the choice). Where the depth above the best was
    never timed at the context length (given `context`), it is probed once within `PROBE_EVERY`
    rounds, whatever the gap: its cost there is carried over from other lengths, and one carried over
    too dear would otherwise keep a sequence from drafting deeper for its whole life. (Not the depth
    below: drafts accepted less often than hoped bring a sequence down by themselves.) A `challenger`
    is probed within CHALLENGE_EVERY rounds. With `hold`, a probe lasts two rounds (the first untimed)."""

    hold: bool = False
    most: int = PROBE_EVERY_MAX
    clock: Clock = field(default_factory=Clock)  # its own, unless `choose` is given the stage's
    probed_from: int | None = None  # the choice a probe was made from, until the next choice is known
    probed_on: StageCosts | None = field(default=None, repr=False, compare=False)  # the table it was made on
    held: int | None = None

    def next(self, best: int, costs: StageCosts, kmax: int, behind: float = 0.0, context: int | None = None,
             challenger: int | None = None) -> int:
        """A round's depth when `best` is the best known (counts the round); `behind`: its neighbours'
        shortfall (`shortfall`); `context`: the round's context length; `challenger`: the best estimate's."""
        self.clock.rounds += 1
        return self.choose(best, costs, kmax, behind, context=context, challenger=challenger)

    def choose(self, best: int, costs: StageCosts, kmax: int, behind: float = 0.0, clock: Clock | None = None,
               context: int | None = None, challenger: int | None = None) -> int:
        clock = clock or self.clock
        if self.held is not None:
            depth, self.held = self.held, None
            return depth
        if self.probed_from is not None:  # the probe is in: did it change the choice?
            # Only a choice from the same table answers that: a batch that changed size since chooses
            # from another table, where the choice probed from may never have been the best.
            if costs is self.probed_on:
                confirmed = best == self.probed_from
                most = int(self.most * min(PROBE_STRETCH, max(1.0, behind / PROBE_SHORTFALL)))
                costs.probe_gap = min(2 * costs.probe_gap, most) if confirmed else PROBE_EVERY
            self.probed_from = self.probed_on = None
        since = clock.rounds - clock.last_probe
        due = since >= costs.probe_gap
        early = not due and since >= PROBE_EVERY and context is not None and best < kmax and costs.first_try(
            best + 1, context)
        challenger = None if challenger is None or min(challenger, kmax) == best else min(challenger, kmax)
        if not (due or early):
            if challenger is None or clock.rounds - max(clock.last_probe, clock.last_challenge) < CHALLENGE_EVERY:
                return best
            clock.last_challenge, depth = clock.rounds, challenger  # (says nothing of how often probes should come)
        else:  # (an early probe goes up; one counted in rounds would keep the parity of the gap: counted here)
            self.probed_from, self.probed_on, clock.last_probe = best, costs, clock.rounds
            if 0 < best < kmax and not early:
                clock.probes += 1
            up = early or best == 0 or (best < kmax and clock.probes % 2 == 1)
            depth = min(best + 1, kmax) if up else costs.stalest_below(best, context)
        if self.hold:
            self.held = depth
        return depth


@dataclass
class DepthChooser:
    """One sequence's choice of depth, round after round."""

    kmax: int
    acceptance: Acceptance = field(init=False)
    probe: Probe = field(default_factory=lambda: Probe(hold=True))  # a probe's first round is not timed

    def __post_init__(self) -> None:
        self.acceptance = Acceptance.empty(self.kmax, MEMORY)

    def next_depth(self, costs: StageCosts, context: int) -> int:
        """The next round's depth. Probes are spaced in the stage's rounds, whichever sequences run
        them: a sequence's own would leave sequences shorter than the gap never probing."""
        costs.clock.rounds += 1
        first = costs.unmeasured(context, self.kmax)
        if first is not None:  # measure every depth on this stage and context length first
            return first
        acceptance = self.acceptance.hopeful(costs.acceptance.extrapolated()[: self.kmax])
        rates = depth_rates(acceptance, costs.round_seconds(context)[: self.kmax + 1])
        best = settled(rates, costs.noise(context), costs.when())
        return self.probe.choose(best, costs, self.kmax, shortfall(rates, best), costs.clock, context,
                                 challenger(rates, best, costs, context))
