"""A request's state in the batch engine (batch.py), and its handle."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ...node.protocol import Scored
from .opened import Opened


@dataclass
class Live(Opened):
    """One request inside the engine (touched only on the MLX thread, except `cancelled`)."""

    cancelled: threading.Event = field(default_factory=threading.Event)
    prefilled: int = 0  # tokens of `tokens` fed so far
    step: int = 0  # prefill steps sent
    generated: int = 0
    next_tokens: list[int] = field(default_factory=list)  # the next round's [y, d1..dK]
    started: float = 0.0
    prefix: str = ""  # the kept prefix its prompt goes on from
    admitted: Callable[[], None] | None = None  # told once it leaves the queue
    ends: frozenset[int] = frozenset()  # the tokens that end it (`GenerationRequest.ends`)
    scored: list[Scored] | None = None  # its prompt's log-probabilities so far, where asked; handed out first

    @property
    def resumed(self) -> bool:
        """It was preempted after it had tokens: those go in again after its prompt."""
        return bool(self.emitted)

    @property
    def tokens(self) -> list[int]:
        """What its prefill feeds: the prompt, and after a preemption the tokens it had (the last of them,
        never fed, goes last, alone, and yields the next)."""
        return self.req.prompt_tokens + self.emitted if self.emitted else self.req.prompt_tokens


class Handle:
    def __init__(self, live: Live, wake: Callable[[], None]):
        self._live = live
        self._wake = wake

    def cancel(self) -> None:
        """The client is gone: the sequence leaves the batch at the next round."""
        self._live.cancelled.set()
        self._wake()
