"""In-process stages chained on this thread: single-node mode is one stage holding every layer."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from ...models.loading import load_shard
from ...models.shard import ShardSpec
from ...node.protocol import StageError, StepOutput, StepRequest
from ...node.stage import StageWorker


class LocalPipeline:
    def __init__(self, stages: list[StageWorker]):
        if not stages or not stages[0].spec.is_first or not stages[-1].spec.is_last:
            raise ValueError("a pipeline runs from the first layer to the last")
        for a, b in zip(stages, stages[1:]):
            if a.spec.end != b.spec.start:
                raise ValueError(f"stages are not contiguous: [{a.spec.start},{a.spec.end}) then [{b.spec.start},{b.spec.end})")
        self.stages = stages

    def step(self, req: StepRequest) -> StepOutput:
        hidden = None
        for stage in self.stages:
            out = stage.step(req, hidden)
            hidden = out if isinstance(out, mx.array) else None
        if not isinstance(out, StepOutput):
            raise StageError("the last stage returned no tokens")
        return out

    def steps(self, reqs: list[StepRequest]) -> list[StepOutput]:
        return [self.step(r) for r in reqs]  # one thread: nothing to overlap

    def release(self, seq_id: str) -> None:
        for stage in self.stages:
            stage.release(seq_id)

    @property
    def constrains(self) -> bool:
        """The last stage holds output to grammars (given them: engine/build.py)."""
        head = self.stages[-1].head if self.stages else None
        return head is not None and head.grammars is not None

    def describe(self) -> dict[str, Any]:
        return {"kind": "local", "stages": [dict(index=i, **stage.describe()) for i, stage in enumerate(self.stages)]}

    def close(self) -> None:
        self.stages = []


def even_split(num_layers: int, parts: int) -> list[ShardSpec]:
    """Contiguous, near-equal layer ranges (placement proper lives in cluster/placement.py)."""
    if not 1 <= parts <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {parts} stages")
    bounds = [round(i * num_layers / parts) for i in range(parts + 1)]
    return [ShardSpec(a, b, num_layers) for a, b in zip(bounds, bounds[1:])]


def local_pipeline(
    model_path: Path | str,
    *,
    stages: int = 1,
    mtp: bool = True,
    dtype: mx.Dtype | None = None,
    mtp_pre_norm: bool = False,
    progress: Callable[[int, int], None] | None = None,
    draft_vocab: int | None = None,
    mtp_window: int | None = None,
) -> LocalPipeline:
    from ...models.config import load_config

    config = load_config(Path(model_path))
    specs = even_split(config.num_layers, stages)
    return LocalPipeline(
        [
            StageWorker(load_shard(model_path, s, mtp=mtp, dtype=dtype, progress=progress), mtp_pre_norm=mtp_pre_norm,
                        draft_vocab=draft_vocab, mtp_window=mtp_window)
            for s in specs
        ]
    )
