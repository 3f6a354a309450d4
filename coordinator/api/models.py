"""Request bodies of the OpenAI-compatible API.

Types are strict (no "5" for 5, no 1 for true, no NaN): a body of the wrong shape is a 422. Ranges
are not checked here but by the engine's own validation, so a bad value is a 400 with the
engine's message. Unknown fields are ignored, as OpenAI clients send many we have no use for.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class _GenerationBody(_Body):
    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    mtp_depth: int | Literal["auto"] | None = None  # extension: drafts per round (0 = none); "auto" picks per round
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (mlx-lm's, over the last 20 tokens)
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias


class ChatCompletionRequest(_GenerationBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are given
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(_GenerationBody):
    prompt: str | list[int] | list[str]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
