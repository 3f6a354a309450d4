"""How the engine reaches the stages: in-process (local.py) or a chain of nodes (remote.py)."""

from __future__ import annotations

from typing import Any, Protocol

from ...node.protocol import StepOutput, StepRequest


class Pipeline(Protocol):
    def step(self, req: StepRequest) -> StepOutput: ...

    def steps(self, reqs: list[StepRequest]) -> list[StepOutput]: ...  # in order; may overlap them

    def release(self, seq_id: str) -> None: ...

    def describe(self) -> dict[str, Any]:
        """Plain data about the stages, cheap enough for every /v1/cluster call: {"kind", "stages": [...]}."""
        ...

    def close(self) -> None: ...
