"""One depth for every row that shares a stage's time: a batch, or all the groups a client keeps in
flight around a ring.

Groups in flight take turns on every node, so one group's round lasts as long as every group's work
in it. Timed alone, a group that drafts deeper sees only its share of what its drafts cost (the rest
lengthens the other groups' rounds), so it picks deeper than pays; and groups at different depths
leave nodes waiting on the heaviest group. So the groups of a client share one `DepthPlan`: one depth
for all of them, cost tables per batch size, and a round is timed only if every group ran the plan's
depth for all of it: from the moment the last group took up a new depth (or something else ran,
such as a prompt chunk), rounds handed out after it are clean. One member, the oldest, decides, once
per its round (so probes come as often in rounds of the ring whatever the number of groups), from
every member's rows; the others follow. A single batch is the case of one group. Choosing is
depth.py's: tokens per second by depth from acceptance and round costs, probes.

Batches with rows whose logits are processed on the host (penalties, a logit bias) cost more per
round, and their rounds without drafts are queued only once the host has their tokens: they follow a
plan of their own (`rows_of`), timed on their rounds only.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable

from .depth import PROBE_EVERY_MAX_BATCH, Probe, StageCosts, challenger
from .depth_rates import hoped, nearest, settled, shortfall

# A new depth is held until a round at it was timed (two rounds of the deciding member, when nothing
# else runs); rounds that are not timed (prompt chunks in between) release it after this many.
HOLD_ROUNDS = 4

# a member's rows, from round seconds: per depth, tokens per second and their hope's square (depth.batch_rates)
Rates = Callable[[list[float]], list[tuple[float, float]]]


def scaled(seconds: float, depth: int, plain_there: float, plain_here: float) -> float:
    """A round at `depth` timed at another batch size (`seconds`), at this one, where rounds without
    drafts took `plain_there` there and take `plain_here` here: what the rows change in a plain round
    they change in each of a drafting round's depth + 1 tokens a row. Where a wider round costs about
    what a narrow one does (the weights read once, as on a Mac's GPU), that is about the cost timed
    there; where each row costs (a CPU's products), drafting gets dearer with the rows than the plain
    rounds' ratio would say. Where plain rounds are dearer here, never below that ratio's scaling;
    cheaper, never above it; never below a plain round here."""
    ratio = seconds * plain_here / plain_there
    by_rows = seconds + (depth + 1) * (plain_here - plain_there)
    return max(plain_here, ratio, by_rows) if plain_here >= plain_there else max(plain_here, min(ratio, by_rows))


class DepthPlan:
    """The depth of the rounds of some batches (members) that share a stage's time, and what they cost."""

    def __init__(self) -> None:
        self.costs_by_rows: dict[int, StageCosts] = {}
        self.shapes: set[tuple[int, int]] = set()  # (rows, depth) of the rounds run so far
        self.probe = Probe(most=PROBE_EVERY_MAX_BATCH)
        self.depth: int | None = None  # what the members were last told
        self.clean_from = 0.0  # rounds handed out before this moment (perf_counter) mixed other work in
        self.held = 0  # the decider's rounds left while a new depth waits for a timing (0: not held)
        self.held_at = 0  # the batch size (bucket) the held depth was chosen at
        # member -> (the depth it runs, its rows' most drafts, its rows' tokens per second by depth)
        self.members: weakref.WeakKeyDictionary[object, tuple[int, int, Rates]] = weakref.WeakKeyDictionary()
        self.processed: DepthPlan | None = None  # the plan of members with processed rows (`rows_of`)

    def rows_of(self, member: object, processed: bool) -> DepthPlan:
        """The plan `member` follows: this one, or with rows whose logits are processed on the host,
        the plan of such batches (their rounds are not what plain rounds cost). It leaves the other."""
        if processed and self.processed is None:
            self.processed = DepthPlan()
        mine, other = (self.processed, self) if processed else (self, self.processed)
        if other is not None:
            other._drop(member)
        return mine

    # -- what the members report ---------------------------------------------------------------

    def interrupt(self) -> None:
        """Something other than the members' rounds ran: rounds handed out before now are not clean."""
        if math.isfinite(self.clean_from):
            self.clean_from = time.perf_counter()
        if self.processed is not None:
            self.processed.interrupt()

    def leave(self, member: object) -> None:
        """A member without rows to time (gone, or none of its rows chooses its depth)."""
        self._drop(member)
        if self.processed is not None:
            self.processed._drop(member)

    def _drop(self, member: object) -> None:
        if self.members.pop(member, None) is not None:
            self._settle()

    def first_shape(self, shape: tuple[int, int]) -> bool:
        """The first round of a shape builds its kernels: not a cost."""
        if shape in self.shapes:
            return False
        self.shapes.add(shape)
        return True

    def clean(self, handed_out: float, depth: int) -> bool:
        """Whether a round at `depth` whose drafts went out at `handed_out` ran at the plan's depth, as
        every member's round beside it did."""
        return depth == self.depth and handed_out >= self.clean_from

    def timed(self) -> None:
        """A clean round (so one at the plan's depth) was timed: the depth may change again."""
        self.held = 0

    # -- choosing ------------------------------------------------------------------------------

    def costs(self, bucket: int, stage: StageCosts) -> StageCosts:
        """Round costs per power-of-two batch size: how much a wider round costs depends on the rows.
        The tables follow the stage's: deeper when a sequence asked for deeper drafts than any before,
        and reading its acceptance (which every drafting sequence's first rounds inform)."""
        for b, table in self.costs_by_rows.items():
            if len(table.prior) < len(stage.prior):
                self.costs_by_rows[b] = table = table.widened(stage.prior)
            table.acceptance = stage.acceptance
        if bucket not in self.costs_by_rows:
            self.costs_by_rows[bucket] = StageCosts(list(stage.prior), acceptance=stage.acceptance)
        return self.costs_by_rows[bucket]

    def next(self, member: object, bucket: int, context: int, kmax: int, rates: Rates, least: int = 0) -> int:
        """The depth of `member`'s next round (its rows cap it at their `kmax`); `rates`: its rows'
        tokens per second by depth (`Rates`). The oldest member decides: depths never timed first, then the
        best for every member's rows together, with probes; a new depth is held until a round at it
        was timed, at the batch size it was chosen at: a depth chosen for the last row of a batch would
        cost a full batch that comes next several rounds at it (drafting pays at one row far more than
        at eight). `least`: the deciding member's rounds are that wide whatever the plan says (rows of
        a fixed depth), so it chooses among depths from there (a round below it could never be timed).
        The other members follow."""
        ran = self.members.get(member)
        self.members[member] = (ran[0] if ran else -1, kmax, rates)
        if self.depth is not None and next(iter(self.members)) is not member:
            return self._take(member, self.depth)
        if self.held and bucket != self.held_at:
            self.held = 0
        if self.depth is not None and self.held:
            self.held -= 1
            return self._take(member, self.depth)
        deepest = max(k for _, k, _ in self.members.values())
        least = min(least, deepest)
        costs = self.costs_by_rows[bucket]
        depth = self.untimed(costs, deepest, least)
        if depth is None:
            seconds, noise, when = self.round_seconds(bucket, context)
            per_depth = hoped(r(seconds[: deepest + 1]) for _, _, r in self.members.values())
            best = settled(per_depth, noise, when)
            top = challenger(per_depth, best, costs, context)
            depth = max(least, self.probe.next(best, costs, deepest, shortfall(per_depth, best), context,
                                               None if top is None else max(least, top)))
        if depth != self.depth:
            self.depth = depth
            self.held, self.held_at = HOLD_ROUNDS, bucket
            self.clean_from = math.inf  # until every member runs it
        return self._take(member, depth)

    def untimed(self, costs: StageCosts, kmax: int, least: int = 0) -> int | None:
        """A depth to time before choosing: each depth from `least` once (at any batch size), then
        `least` at each batch size (no drafts: never a loss against decoding without MTP)."""
        anywhere = {k for c in self.costs_by_rows.values() for _, k in c.live}
        first = next((k for k in range(least, kmax + 1) if k not in anywhere), None)
        if first is not None:
            return first
        return None if any(k == least for _, k in costs.live) else least

    def round_seconds(self, bucket: int, context: int) -> tuple[list[float], list[float], list[float | None]]:
        """Round costs at this batch size, their relative errors and when they were timed (`settled`);
        a depth not timed at it is its cost at the nearest batch size where it was, moved by what
        rounds without drafts gained or lost between the two (`scaled`)."""
        own = self.costs_by_rows[bucket]
        out, noise, when = own.round_seconds(context), own.noise(context), own.when()
        for k in range(1, len(out)):
            if any(d == k for _, d in own.live):
                continue
            near = [b for b, c in self.costs_by_rows.items()
                    if b != bucket and {0, k} <= {d for _, d in c.live} and len(c.prior) == len(own.prior)]
            if near:
                other = self.costs_by_rows[nearest(near, bucket, int.bit_length)]
                seconds, errors = other.round_seconds(context), other.noise(context)
                out[k] = scaled(seconds[k], k, seconds[0], out[0])
                # its own error, and the two plain rounds' errors, once for each of its tokens a row
                shift = (k + 1) * math.hypot(noise[0] * out[0], errors[0] * seconds[0])
                noise[k], when[k] = math.hypot(errors[k] * seconds[k], shift) / out[k], other.when()[k]
        return out, noise, when

    def _take(self, member: object, depth: int) -> int:
        _, kmax, rates = self.members[member]
        self.members[member] = (min(depth, kmax), kmax, rates)
        self._settle()
        return depth

    def _settle(self) -> None:
        """Every member runs the plan's depth (as far as its rows draft): rounds handed out from now
        on are clean."""
        if not math.isfinite(self.clean_from) and all(ran == min(self.depth, kmax)
                                                     for ran, kmax, _ in self.members.values()):
            self.clean_from = time.perf_counter()
