"""A chat reply as it streams: each engine chunk's text into thinking, answer and tool calls.

The thinking is split off first (reasoning.py); the tool-call parser reads only the answer, as a
reply's calls come after its thought.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..engine.request import GenerationChunk
    from .chat import ToolSpec
    from .generation import ResponseFormat
    from .reasoning import ReasoningSplit
    from .tools import ToolCallParser


async def thought_apart(chunks: AsyncIterator[GenerationChunk],
                        split: ReasoningSplit | None) -> AsyncIterator[tuple[GenerationChunk, str]]:
    """Each chunk with only its answer as text, and the thinking it carried ("" when the request asked
    for none: `include_reasoning` false)."""
    async for chunk in chunks:
        if split is None:
            yield chunk, ""
            continue
        thought, answer = split.feed(chunk.text, final=chunk.finish_reason is not None)
        yield dataclasses.replace(chunk, text=answer), thought if split.shown else ""


def tool_deltas(fmt: ResponseFormat, parser: ToolCallParser, tools: ToolSpec, chunk: GenerationChunk, calls: int,
                logprobs: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]], int]:
    """A chunk's text through the tool-call parser: content deltas, and each whole call as a tool_calls
    delta (`calls`: those streamed so far). Its `logprobs` ride on the first delta (an empty one when the
    parser holds its text back)."""
    events = parser.feed(chunk.text) + (parser.finish() if chunk.finish_reason else [])
    items: list[tuple[str, list[dict[str, Any]] | None]] = []
    for kind, value in events:
        if kind == "text":
            if items and items[-1][1] is None:
                items[-1] = (items[-1][0] + value, None)
            else:
                items.append((value, None))
        elif tools.parallel or calls == 0:
            items.append(("", [value.to_dict(index=calls)]))
            calls += 1
    if logprobs is not None:
        items = items or [("", None)]
    return [fmt.chunk(text, tool_calls=delta, logprobs=logprobs if i == 0 else None)
            for i, (text, delta) in enumerate(items)], calls
