"""What both batching engines hold of a request from `open` to its end (batch_live.py, ring_live.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import scheduler as plan
from .detokenizer import TextStream
from .request import GenerationRequest, GenerationStats
from .sinks import Sink


@dataclass
class Opened:
    seq_id: str
    req: GenerationRequest
    sink: Sink
    text: TextStream
    stats: GenerationStats
    queued: float  # when it was opened (monotonic)
    # The tokens it had: after a preemption they go in again behind its prompt (the batch engine's include
    # those the stages gave past a stop; the ring engine's are those handed out).
    emitted: list[int] = field(default_factory=list)
    order: int = 0  # when it was admitted, as a count: the last admitted is preempted first

    def need(self, horizon: int | None) -> plan.Footprint:
        """What it holds once it has `horizon` tokens more (None: at its end)."""
        positions = plan.reach(len(self.req.prompt_tokens), len(self.emitted), self.req.max_tokens, horizon)
        return plan.footprint(positions, self.req.mtp_depth)
