"""What a sequence's drafts are worth: the chance each draft position is accepted once the drafts before
it were, counted per sequence (the depth chooser's, depth.py) and per stage (the prior of new sequences)."""

from __future__ import annotations

import math
from dataclasses import dataclass

PRIOR_ACCEPTANCE = 0.6  # before anything was measured: a middling draft head
PRIOR_WEIGHT = 4.0  # pseudo-rounds of the stage-wide acceptance behind each sequence's own counts
HOPE = 1.0  # standard errors above its estimate a sequence's acceptance is taken at (`Acceptance.hopeful`)
MIN_REACHED = 4  # drafts at a position before the stage's own rate stands for that position
# A sequence's counts at positions it no longer drafts at fade by this much a round: such a position,
# judged on a few early rounds, must not stay judged so for the sequence's whole life (it grows
# uncertain, so hoped for again: `Acceptance.hopeful`). Positions it drafts at keep every count.
MEMORY = 0.95


@dataclass
class Acceptance:
    """Conditional acceptance per draft position: drafts that reached position i, and those accepted."""

    reached: list[float]
    accepted: list[float]
    memory: float = 1.0  # the weight a count at a position not drafted keeps each round (`MEMORY`; 1: all)

    @classmethod
    def empty(cls, depth: int, memory: float = 1.0) -> Acceptance:
        return cls([0.0] * depth, [0.0] * depth, memory)

    def record(self, drafted: int, accepted: int) -> None:
        if self.memory < 1.0:
            self.reached = [r if i < drafted else r * self.memory for i, r in enumerate(self.reached)]
            self.accepted = [a if i < drafted else a * self.memory for i, a in enumerate(self.accepted)]
        for i in range(min(drafted, accepted + 1, len(self.reached))):  # position i was reached
            self.reached[i] += 1
            self.accepted[i] += i < accepted

    def rates(self, prior: list[float] | None = None, weight: float = PRIOR_WEIGHT) -> list[float]:
        prior = prior or [PRIOR_ACCEPTANCE] * len(self.reached)
        return [(a + weight * p) / (r + weight) for a, r, p in zip(self.accepted, self.reached, prior)]

    def hopeful(self, prior: list[float] | None = None, weight: float = PRIOR_WEIGHT) -> list[float]:
        """The rates one standard error above their estimates: what a depth is chosen on. Sequences
        accept their drafts at very different rates (the stage's average says little about one),
        and a sequence that does not draft never learns its own; so drafts are tried while little
        is known, and a sequence whose drafts keep failing soon stops, as its error shrinks."""
        return [min(1.0, p + HOPE * math.sqrt(p * (1.0 - p) / (r + weight)))
                for p, r in zip(self.rates(prior, weight), self.reached)]

    def extrapolated(self) -> list[float]:
        """Measured rates, and for positions rarely reached the rate of the position before: a draft
        head's conditional acceptance changes slowly with depth, and a guess that kept deep positions
        at a flat prior would never let a sequence try them."""
        out: list[float] = []
        for a, r in zip(self.accepted, self.reached):
            out.append(a / r if r >= MIN_REACHED else (out[-1] if out else PRIOR_ACCEPTANCE))
        return out
