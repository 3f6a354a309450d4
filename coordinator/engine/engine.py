"""The speculative engine: prompt in, tokens out, through any pipeline of stages.

One round sends [y, d1..dK] to the first stage with the previous round's commit; the last stage
verifies, accepts, drafts again and returns token ids. The engine only decides when to stop and
keeps the statistics. Single-node mode is the same engine over a one-stage pipeline. Each step says
how many tokens the engine still wants and which tokens end the sequence, so a remote last node can
start the next round itself (see pipeline/remote.py); the engine's loop is the same either way.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

from ...node.processors import has_processors
from ...node.protocol import StepKind, StepRequest
from ..pipeline.base import Pipeline
from .detokenizer import TextStream
from .request import (
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    RequestError,
    check_request,
    check_vocabulary,
    collect,
    stop_reason,
    take_tokens,
)

log = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK = 512


class Engine:
    batching = "none"  # one sequence per round (GET /v1/cluster says so)

    def __init__(
        self,
        pipeline: Pipeline,
        tokenizer: Any,
        eos_token_ids: set[int] | list[int],
        max_context: int,
        has_mtp: bool = False,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        processors: bool = True,
        vocab_size: int | None = None,
    ):
        self.pipeline = pipeline
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)
        self.max_context = max_context
        self.has_mtp = has_mtp
        self.prefill_chunk = prefill_chunk
        self.vocab_size = vocab_size  # what the model embeds: logit_bias ids are checked against it
        self.processors = processors  # False: the pipeline cannot carry logits processors and logprobs

    @property
    def constrains(self) -> bool:
        """The pipeline's last stage holds output to grammars (a node with the model's tokenizer)."""
        return bool(getattr(self.pipeline, "constrains", False))

    def scheduler_state(self) -> None:
        """None: each caller runs its own sequence, with no queue or memory budget of the engine's."""
        return None

    def close(self) -> None:
        """Stop the engine: its pipeline lets go of its stages (the batch and ring engines also end their threads)."""
        self.pipeline.close()

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))

    def validate(self, req: GenerationRequest) -> None:
        """Refuse a request this engine cannot serve (RequestError), before any stage is touched."""
        check_request(req, max_context=self.max_context, has_mtp=self.has_mtp, constrains=self.constrains)
        p = req.params
        if self.vocab_size:  # (prompt ids too: the first stage would refuse them only once a step is sent)
            check_vocabulary(req, self.vocab_size)
        if not self.processors and (has_processors(p) or p.top_logprobs >= 0 or p.prompt_logprobs >= 0):
            raise RequestError("this pipeline does not carry logit_bias, penalties or logprobs",
                               "logit_bias" if p.logit_bias else "logprobs" if p.top_logprobs >= 0 else
                               "prompt_logprobs" if p.prompt_logprobs >= 0 else "penalty")

    def generate(self, req: GenerationRequest) -> Iterator[GenerationChunk]:
        """Stream chunks of text; the last chunk carries finish_reason and stats."""
        self.validate(req)
        seq_id = uuid.uuid4().hex
        stats = GenerationStats(prompt_tokens=len(req.prompt_tokens))
        text = TextStream.of(self.tokenizer, req)
        ends = req.ends(self.eos)
        stop_tokens = tuple(sorted(ends))
        try:
            t0 = time.perf_counter()
            prefill = [
                StepRequest(
                    seq_id, i, StepKind.PREFILL, chunk, final=final,
                    params=req.params if i == 0 else None,
                    mtp_depth=req.mtp_depth if i == 0 else 0, mtp_auto=req.mtp_auto and i == 0,
                    budget=max(1, req.max_tokens) if final else 0, stop_tokens=stop_tokens if final else (),
                )
                for i, (chunk, final) in enumerate(self._prefill_chunks(req.prompt_tokens))
            ]
            outs = self.pipeline.steps(prefill)  # a pipeline of nodes works on several chunks at once
            out, step = outs[-1], len(prefill)
            scored = [s for o in outs for s in o.prompt_logprobs] if req.params.prompt_logprobs >= 0 else None
            stats.prefill_seconds = time.perf_counter() - t0
            t0 = time.perf_counter()
            generated: list[int] = []
            while True:
                new, finish = take_tokens(out.tokens, ends, text, len(generated), req.max_tokens)
                generated += new
                stats.generation_tokens = len(generated)
                if finish:
                    break
                yield GenerationChunk(text=text.release(final=False), tokens=new, prompt_logprobs=scored,
                                      logprobs=out.logprobs[: len(new)] if req.params.top_logprobs >= 0 else None,
                                      cached_tokens=None if step > len(prefill) else stats.cached_tokens)
                scored = None
                out = self.pipeline.step(
                    StepRequest(seq_id, step, StepKind.DECODE, [out.tokens[-1]] + out.drafts, commit=out.commit,
                                budget=req.max_tokens - len(generated), stop_tokens=stop_tokens)
                )
                stats.record_round(out)
                step += 1
            stats.decode_seconds = time.perf_counter() - t0
            stats.ended_within(out, len(new))
            yield GenerationChunk(text=text.release(final=True), tokens=new, finish_reason=finish, stats=stats,
                                  logprobs=out.logprobs[: len(new)] if req.params.top_logprobs >= 0 else None,
                                  prompt_logprobs=scored, stop_reason=stop_reason(finish, new, text, req),
                                  cached_tokens=None if step > len(prefill) else stats.cached_tokens)
        finally:
            self.pipeline.release(seq_id)

    def complete(self, req: GenerationRequest) -> GenerationResult:
        return collect(self.generate(req))

    def _prefill_chunks(self, prompt: list[int]) -> Iterator[tuple[list[int], bool]]:
        """All but the last prompt token in chunks, then the last token alone (as mlx-lm does)."""
        body = prompt[:-1]
        for i in range(0, len(body), self.prefill_chunk):
            yield body[i : i + self.prefill_chunk], False
        yield prompt[-1:], True


