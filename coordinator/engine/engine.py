"""The speculative engine: prompt in, tokens out, through any pipeline of stages.

One round sends [y, d1..dK] to the first stage with the previous round's commit; the last stage
verifies, accepts, drafts again and returns token ids. The engine only decides when to stop and
keeps the statistics. Single-node mode is the same engine over a one-stage pipeline. Each step says
how many tokens the engine still wants and which tokens end the sequence, so a remote last node can
start the next round itself (see coordinator/remote.py); the engine's loop is the same either way.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

from ...node.protocol import SamplingParams, StepKind, StepOutput, StepRequest
from ..pipeline.local import Pipeline

log = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK = 512


@dataclass
class GenerationRequest:
    prompt_tokens: list[int]
    max_tokens: int = 256
    params: SamplingParams = field(default_factory=SamplingParams)
    mtp_depth: int = 0
    stop: list[str] = field(default_factory=list)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        # The first token comes out of prefill; decode speed counts the rest.
        n = max(self.generation_tokens - 1, 0)
        return n / self.decode_seconds if self.decode_seconds else 0.0

    def record_round(self, out: StepOutput) -> None:
        self.rounds += 1
        self.drafted += out.drafted
        self.accepted += out.accepted
        while len(self.drafted_per_position) < out.drafted:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(out.drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < out.accepted)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": round(self.acceptance, 4),
            "acceptance_per_position": [
                round(a / d, 4) if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)
            ],
            "drafted_per_position": self.drafted_per_position,
            "accepted_per_position": self.accepted_per_position,
            "prefill_tps": round(self.prefill_tps, 2),
            "decode_tps": round(self.decode_tps, 2),
        }


@dataclass
class GenerationChunk:
    text: str
    tokens: list[int]
    finish_reason: str | None = None  # "stop" or "length" on the last chunk
    stats: GenerationStats | None = None


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: str
    stats: GenerationStats


class _TextStream:
    """Incremental detokenization with stop strings: never releases text past a stop."""

    def __init__(self, tokenizer: Any, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.window: list[int] = []
        self.text = ""  # decoded so far
        self.released = 0  # characters handed out
        self.stopped = False

    def add(self, token: int) -> None:
        self.window.append(token)
        piece = self.tokenizer.decode(self.window)
        if piece.endswith("\ufffd"):
            return  # an incomplete UTF-8 sequence: wait for the next token
        self.window = []
        self.text += piece
        for s in self.stop:
            at = self.text.find(s, max(0, len(self.text) - len(piece) - len(s)))
            if at >= 0:
                self.text = self.text[:at]
                self.stopped = True

    def release(self, final: bool) -> str:
        hold = 0 if final or self.stopped else max((len(s) - 1 for s in self.stop), default=0)
        end = max(self.released, len(self.text) - hold)
        out = self.text[self.released : end]
        self.released = end
        return out


class Engine:
    def __init__(
        self,
        pipeline: Pipeline,
        tokenizer: Any,
        eos_token_ids: set[int] | list[int],
        max_context: int,
        has_mtp: bool = False,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ):
        self.pipeline = pipeline
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)
        self.max_context = max_context
        self.has_mtp = has_mtp
        self.prefill_chunk = prefill_chunk

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))

    def validate(self, req: GenerationRequest) -> None:
        if not req.prompt_tokens:
            raise ValueError("the prompt is empty")
        if req.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {req.max_tokens}")
        if len(req.prompt_tokens) + req.max_tokens + req.mtp_depth > self.max_context:
            raise ValueError(
                f"prompt ({len(req.prompt_tokens)} tokens) plus max_tokens ({req.max_tokens}) exceeds the "
                f"context of {self.max_context} tokens"
            )
        if req.mtp_depth < 0:
            raise ValueError("mtp_depth must be >= 0")
        if req.mtp_depth > 0 and not self.has_mtp:
            raise ValueError("this model runs without an MTP head (--no-mtp, or none in the checkpoint); use mtp_depth 0")
        req.params.validate()

    def generate(self, req: GenerationRequest) -> Iterator[GenerationChunk]:
        """Stream chunks of text; the last chunk carries finish_reason and stats."""
        self.validate(req)
        seq_id = uuid.uuid4().hex
        stats = GenerationStats(prompt_tokens=len(req.prompt_tokens))
        text = _TextStream(self.tokenizer, req.stop)
        stop_tokens = tuple(sorted(self.eos))
        try:
            t0 = time.perf_counter()
            prefill = [
                StepRequest(
                    seq_id, i, StepKind.PREFILL, chunk, final=final,
                    params=req.params if i == 0 else None,
                    mtp_depth=req.mtp_depth if i == 0 else 0,
                    budget=req.max_tokens if final else 0, stop_tokens=stop_tokens if final else (),
                )
                for i, (chunk, final) in enumerate(self._prefill_chunks(req.prompt_tokens))
            ]
            out = self.pipeline.steps(prefill)[-1]  # a pipeline of nodes works on several chunks at once
            step = len(prefill)
            stats.prefill_seconds = time.perf_counter() - t0
            t0 = time.perf_counter()
            generated: list[int] = []
            finish = None
            while True:
                new = []
                for tok in out.tokens:
                    if tok in self.eos:
                        finish = "stop"
                        break
                    new.append(tok)
                    text.add(tok)
                    if text.stopped:
                        finish = "stop"
                        break
                    if len(generated) + len(new) >= req.max_tokens:
                        finish = "length"
                        break
                generated += new
                stats.generation_tokens = len(generated)
                if finish:
                    break
                yield GenerationChunk(text=text.release(final=False), tokens=new)
                out = self.pipeline.step(
                    StepRequest(seq_id, step, StepKind.DECODE, [out.tokens[-1]] + out.drafts, commit=out.commit,
                                budget=req.max_tokens - len(generated), stop_tokens=stop_tokens)
                )
                stats.record_round(out)
                step += 1
            stats.decode_seconds = time.perf_counter() - t0
            yield GenerationChunk(text=text.release(final=True), tokens=new, finish_reason=finish, stats=stats)
        finally:
            self.pipeline.release(seq_id)

    def complete(self, req: GenerationRequest) -> GenerationResult:
        parts, tokens = [], []
        for chunk in self.generate(req):
            parts.append(chunk.text)
            tokens += chunk.tokens
            if chunk.finish_reason:
                return GenerationResult("".join(parts), tokens, chunk.finish_reason, chunk.stats)
        raise RuntimeError("generation ended without a finish reason")

    def _prefill_chunks(self, prompt: list[int]) -> Iterator[tuple[list[int], bool]]:
        """All but the last prompt token in chunks, then the last token alone (as mlx-lm does)."""
        body = prompt[:-1]
        for i in range(0, len(body), self.prefill_chunk):
            yield body[i : i + self.prefill_chunk], False
        yield prompt[-1:], True


def load_tokenizer(model_path: Path | str, eos_token_ids: list[int]) -> Any:
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    return mlx_load_tokenizer(Path(model_path), eos_token_ids=eos_token_ids or None)


def local_engine(
    model_path: Path | str, *, stages: int = 1, mtp: bool = True, dtype: Any = None, **pipeline_options: Any
) -> Engine:
    """Single-machine engine: the same engine over in-process stages."""
    from ...models.config import load_config
    from ..pipeline.local import local_pipeline

    config = load_config(Path(model_path))
    tokenizer = load_tokenizer(model_path, config.eos_token_ids)
    pipeline = local_pipeline(model_path, stages=stages, mtp=mtp, dtype=dtype, **pipeline_options)
    has_mtp = pipeline.stages[-1].shard.has_mtp
    return Engine(pipeline, tokenizer, set(tokenizer.eos_token_ids), config.args.max_position_embeddings, has_mtp)
