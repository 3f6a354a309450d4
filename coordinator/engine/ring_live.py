"""A request's state in the ring engine (ring.py), and its handle."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...node.protocol import Scored, StepKind, StepOutput, StepRequest
from .opened import Opened


@dataclass
class RingLive(Opened):
    """One request in the ring; its outcomes come from the prefill's thread, then the subscription's."""

    group: int = 0
    generated: int = 0
    started: float = 0.0
    last_at: float = 0.0  # when its last round's outcome came (perf_counter)
    admitted: bool = False
    prefilling: bool = False  # its prompt is on its way: a release now could overtake it
    resuming: bool = False  # its sequence was lost with a node: waiting for the pipeline to come back
    lost_prompt: tuple[str, int] | None = None  # (sequence, group) lost while its prompt went in: freed after
    resumes: int = 0
    keep_end: str = ""  # the key its state is kept under as it ends (kept.py), and the epoch it counts in
    kept_epoch: float = 0.0
    done: bool = False
    on_admit: Callable[[], None] | None = None  # told once it has a row
    # Held while outcomes are handed out (in order, by one thread at a time) and while it finishes.
    lock: threading.RLock = field(default_factory=threading.RLock)
    ends: frozenset[int] = frozenset()  # the tokens that end it (`GenerationRequest.ends`)
    expected: int = 0  # the order of the next outcome to hand out (0: the prefill's)
    early: dict[int, StepOutput] = field(default_factory=dict)  # outcomes that overtook an earlier one
    scored: list[Scored] | None = None  # its prompt's log-probabilities, where asked, until handed out

    def prompt_steps(self, chunks: list[tuple[list[int], bool]], prefix: str, keep: str) -> list[StepRequest]:
        """Its prompt's chunks as steps (the first names its sampling and drafts, the final one its budget,
        the prompt prefix kept under `keep`, and its end's key); after a resume, the tokens handed out too."""
        req, params = self.req, self.req.params
        if self.emitted and params.prompt_logprobs >= 0:  # (resumed: its prompt was scored already)
            params = dataclasses.replace(params, prompt_logprobs=-1)
        return [StepRequest(self.seq_id, i, StepKind.PREFILL, chunk, final=final,
                            params=params if i == 0 else None, mtp_depth=req.mtp_depth if i == 0 else 0,
                            mtp_auto=req.mtp_auto and i == 0,
                            budget=max(1, req.max_tokens - self.generated) if final else 0,
                            stop_tokens=tuple(sorted(self.ends)) if final else (), group=self.group,
                            resumed_at=len(req.prompt_tokens) if self.emitted and i == 0 else 0,
                            prefix=prefix if i == 0 else "", keep=keep if final else "",
                            keep_end=self.keep_end if final else "")
                for i, (chunk, final) in enumerate(chunks)]


class RingHandle:
    def __init__(self, engine: Any, live: RingLive):  # (a RingEngine)
        self._engine, self._live = engine, live

    def cancel(self) -> None:
        """The client is gone: the sequence leaves its group at the next round, on every node."""
        self._engine._finish(self._live, None)
