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
    from .generation import ResponseFormat
    from .reasoning import ReasoningSplit
    from .tool_held import HeldCalls
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


class CallDeltas:
    """A choice's answer through the tool-call parser, as chat deltas: its text; a whole call at once; a
    streamed one as OpenAI streams it, its id and name first (arguments ""), then each part of its
    arguments on the call's index. With parallel calls off only the first call is handed out."""

    def __init__(self, parser: ToolCallParser | HeldCalls, parallel: bool, held: str | None = None):
        self.parser, self.parallel = parser, parallel
        self.held = held  # a reply held to calls: "function" (one tool_choice named) or "required"
        self.calls = 0  # calls handed out
        self.cut = False  # the last one handed out was cut short (the text ended inside it)
        self._shown: bool | None = None  # whether the streamed call now open is handed out

    def deltas(self, fmt: ResponseFormat, chunk: GenerationChunk,
               logprobs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        """A chunk's deltas; its `logprobs` ride on the first (an empty one when the parser holds its text back)."""
        events = self.parser.feed(chunk.text) + \
            (self.parser.finish(chunk.finish_reason == "length") if chunk.finish_reason else [])
        items: list[tuple[str, list[dict[str, Any]] | None]] = []
        for kind, value in events:
            if kind == "text":
                if items and items[-1][1] is None:
                    items[-1] = (items[-1][0] + value, None)
                else:
                    items.append((value, None))
            elif kind in ("call", "begin"):
                shown = self.parallel or self.calls == 0
                if shown:
                    items.append(("", [value.to_dict(index=self.calls)]))
                if kind == "begin":
                    self._shown = shown
                elif shown:
                    self.calls, self.cut = self.calls + 1, False
            elif kind == "arguments" and self._shown:
                items.append(("", [{"index": self.calls, "function": {"arguments": value}}]))
            elif kind == "end":
                if self._shown:
                    self.calls, self.cut = self.calls + 1, value.cut
                self._shown = None
        if logprobs is not None:
            items = items or [("", None)]
        return [fmt.chunk(text, tool_calls=delta, logprobs=logprobs if i == 0 else None)
                for i, (text, delta) in enumerate(items)]

    def finish(self, finish: str) -> str:
        """The choice's finish reason (`finish`: the engine's), as `responses._calls` gives it whole."""
        return calls_finish(finish, self.held, self.calls, self.cut)


def calls_finish(finish: str, held: str | None, calls: int, cut: bool) -> str:
    """A reply's finish reason where it made `calls` calls (`cut`: the last was cut short): "tool_calls"
    where it called, unless its budget cut the call short; a reply held to calls says so only where it
    stopped, and one held to a function tool_choice named keeps its own (OpenAI's says "stop")."""
    if held == "function" or not calls:
        return finish
    if held == "required":
        return "tool_calls" if finish == "stop" else finish
    return finish if cut and finish == "length" else "tool_calls"
