"""One depth for every row that shares a stage's time: a batch, or all the groups a client keeps in
flight around a ring.

Groups in flight take turns on every node, so one group's round lasts as long as every group's work
in it. Timed alone, a group that drafts deeper sees only its share of what its drafts cost (the rest
lengthens the other groups' rounds), so it picks deeper than pays; and groups at different depths
leave nodes waiting on the heaviest group. So the groups of a client share one `DepthPlan`: one depth
for all of them, cost tables per batch size, and a round is timed only if every group ran the plan's
depth for all of it: from the moment the last group took up a new depth (or something else ran,
such as a prompt chunk), rounds handed out after it are clean. A single batch is the case of one
group. Choosing is depth.py's: tokens per second by depth from acceptance and round costs, probes.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable

from .depth import PROBE_EVERY_MAX_BATCH, Probe, StageCosts, best_of, nearest, shortfall

# A new depth is held until a round at it was timed; rounds that cannot be timed (logits processors,
# prompt chunks in between) release it after this many choices per member.
HOLD_PER_MEMBER = 4


class DepthPlan:
    """The depth of the rounds of some batches (members) that share a stage's time, and what they cost."""

    def __init__(self) -> None:
        self.costs_by_rows: dict[int, StageCosts] = {}
        self.shapes: set[tuple[int, int]] = set()  # (rows, depth) of the rounds run so far
        self.probe = Probe(most=PROBE_EVERY_MAX_BATCH)
        self.depth: int | None = None  # what the members were last told
        self.clean_from = 0.0  # rounds handed out before this moment (perf_counter) mixed other work in
        self.held = 0  # choices left while a new depth waits for a timing (0: not held)
        self.members: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()  # -> its depth

    # -- what the members report ---------------------------------------------------------------

    def interrupt(self) -> None:
        """Something other than the members' rounds ran: rounds handed out before now are not clean."""
        if math.isfinite(self.clean_from):
            self.clean_from = time.perf_counter()

    def leave(self, member: object) -> None:
        """A member without rows to time (gone, or none of its rows chooses its depth)."""
        if self.members.pop(member, None) is not None:
            self._settle()

    def first_shape(self, shape: tuple[int, int]) -> bool:
        """The first round of a shape builds its kernels: not a cost."""
        if shape in self.shapes:
            return False
        self.shapes.add(shape)
        return True

    def clean(self, handed_out: float) -> bool:
        return handed_out >= self.clean_from

    def timed(self, depth: int) -> None:
        """A clean round at `depth` was timed: a depth held for it may change again."""
        if depth == self.depth:
            self.held = 0

    # -- choosing ------------------------------------------------------------------------------

    def costs(self, bucket: int, stage: StageCosts) -> StageCosts:
        """Round costs per power-of-two batch size: how much a wider round costs depends on the rows.
        The tables follow the stage's: deeper when a sequence asked for deeper drafts than any before,
        and reading its acceptance (which every drafting sequence informs)."""
        for b, table in self.costs_by_rows.items():
            if len(table.prior) < len(stage.prior):
                self.costs_by_rows[b] = table = table.widened(stage.prior)
            table.acceptance = stage.acceptance
        if bucket not in self.costs_by_rows:
            self.costs_by_rows[bucket] = StageCosts(list(stage.prior), acceptance=stage.acceptance)
        return self.costs_by_rows[bucket]

    def next(self, member: object, bucket: int, context: int, kmax: int,
             rates: Callable[[list[float]], list[float]]) -> int:
        """The depth of `member`'s next round. While the members have not all taken up the plan's
        depth, or it waits for a timing, they follow it; else it is chosen: depths never timed first,
        then the best by `rates` (tokens per second from round seconds per depth), with probes."""
        if self.depth is not None and self.held:  # (a member whose rows draft less caps it)
            self.held -= 1
            return self._take(member, self.depth)
        costs = self.costs_by_rows[bucket]
        depth = self.untimed(costs, kmax)
        if depth is None:
            per_depth = rates(self.round_seconds(bucket, context)[: kmax + 1])
            best = best_of(per_depth)
            depth = self.probe.next(best, costs, kmax, shortfall(per_depth, best))
        if depth != self.depth:
            self.depth = depth
            self.held = HOLD_PER_MEMBER * (len(self.members) + 1)
            self.clean_from = math.inf  # until every member runs it
        return self._take(member, depth)

    def untimed(self, costs: StageCosts, kmax: int) -> int | None:
        """A depth to time before choosing: each depth once (at any batch size), then no drafts at each
        batch size (never a loss against decoding without MTP)."""
        anywhere = {k for c in self.costs_by_rows.values() for _, k in c.live}
        first = next((k for k in range(kmax + 1) if k not in anywhere), None)
        if first is not None:
            return first
        return None if any(k == 0 for _, k in costs.live) else 0

    def round_seconds(self, bucket: int, context: int) -> list[float]:
        """Round costs at this batch size; a depth not timed at it is its cost at the nearest batch
        size where it was, scaled as rounds without drafts compare between the two."""
        own = self.costs_by_rows[bucket]
        out = own.round_seconds(context)
        for k in range(1, len(out)):
            if any(d == k for _, d in own.live):
                continue
            near = [b for b, c in self.costs_by_rows.items()
                    if b != bucket and {0, k} <= {d for _, d in c.live} and len(c.prior) == len(own.prior)]
            if near:
                seconds = self.costs_by_rows[nearest(near, bucket, int.bit_length)].round_seconds(context)
                out[k] = seconds[k] * out[0] / seconds[0]
        return out

    def _take(self, member: object, depth: int) -> int:
        self.members[member] = depth
        self._settle()
        return depth

    def _settle(self) -> None:
        """Every member runs the plan's depth: rounds handed out from now on are clean."""
        if not math.isfinite(self.clean_from) and all(d == self.depth for d in self.members.values()):
            self.clean_from = time.perf_counter()
