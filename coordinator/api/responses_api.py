"""OpenAI's Responses API (`POST /v1/responses`) on the chat path: the answer.

A body is read as a chat request (responses_input.py). It runs as one choice, as a chat request does
(responses.py), and is answered as a Response whose `output` holds a reasoning item (a thinking model's
thought), a message item (the answer's text) and a function_call item per call; streamed, as the Responses
API's semantic events (`response.created` ... `response.completed`, each with its `sequence_number`), built
from the chat chunks of that choice. Finished responses are kept in the API process's memory
(response_store.py, unless `store: false`): a request may go on from one (`previous_response_id`), `GET` /
`DELETE /v1/responses/{id}` read and forget one, and `GET /v1/responses/{id}/input_items` lists the
conversation that led to it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Optional

from .errors import APIError
from .generation import ResponseFormat, usage_of
from .responses import choice_chunks, one_choice

if TYPE_CHECKING:
    from ..engine.request import GenerationRequest, GenerationStats
    from .chat import ToolSpec
    from .models import ResponsesRequest
    from .reasoning import ReasoningSplit
    from .response_store import ResponseStore
    from .service import Service

ENDPOINT = "/v1/responses"


class Shape:
    """One response's object and output items, in the Responses API's shape."""

    def __init__(self, body: ResponsesRequest, model: str):
        self.body, self.model = body, model
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())

    def response(self, status: str, output: list[dict[str, Any]], usage: Optional[dict[str, Any]] = None,
                 finish: Optional[str] = None) -> dict[str, Any]:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" and finish == "length" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": incomplete, "instructions": b.instructions,
                "max_output_tokens": b.max_output_tokens, "model": self.model, "output": output,
                "parallel_tool_calls": b.parallel_tool_calls is not False,
                "previous_response_id": b.previous_response_id, "store": b.store is not False,
                "reasoning": {k: (b.reasoning or {}).get(k) for k in ("effort", "summary")},
                "temperature": b.temperature, "top_logprobs": b.top_logprobs,
                "text": b.text or {"format": {"type": "text"}}, "tool_choice": b.tool_choice or "auto",
                "tools": b.tools or [], "top_p": b.top_p, "truncation": b.truncation or "disabled", "usage": usage,
                "user": b.user, "metadata": b.metadata or {}, "service_tier": self.tier(),
                "completed_at": int(time.time()) if status == "completed" else None}

    def tier(self) -> str:
        """The tier asked ("auto": the default one), as OpenAI's names the one that served (all are alike here)."""
        return "default" if self.body.service_tier in (None, "auto") else self.body.service_tier

    @staticmethod
    def item_id(kind: str) -> str:
        return f"{kind}_{uuid.uuid4().hex}"

    @staticmethod
    def reasoning(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
        return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}

    @staticmethod
    def message(item_id: str, text: str, logprobs: Optional[list[dict[str, Any]]],
                status: str = "completed") -> dict[str, Any]:
        content = [Shape.part(text, logprobs)] if status != "in_progress" else []
        return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def part(text: str, logprobs: Optional[list[dict[str, Any]]]) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}

    @staticmethod
    def call(call: dict[str, Any], status: Optional[str] = None) -> dict[str, Any]:
        """A function_call item; its status, unless given, "incomplete" where its arguments are not whole
        JSON (only a call the budget cut has such arguments: whole ones are parsed or held to their schema)."""
        fn = call["function"]
        status = status or ("completed" if _whole_json(fn["arguments"]) else "incomplete")
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                "name": fn["name"], "arguments": fn["arguments"] if status != "in_progress" else "", "status": status}


def _whole_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


async def _usage(service: Service, stats: GenerationStats, thought: str, depth: Any) -> dict[str, Any]:
    """The Responses usage; its reasoning tokens are the thought's text as the tokenizer encodes it (no
    prompt tokens are counted as written to a cache: a kept prefix is not billed apart)."""
    reasoning = await service.tokenize(len(thought), lambda tok: len(tok.encode(thought))) if thought else 0
    return {"input_tokens": stats.prompt_tokens,
            "input_tokens_details": {"cached_tokens": stats.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": stats.generation_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": stats.prompt_tokens + stats.generation_tokens, "mtp": usage_of(stats, depth)["mtp"]}


async def respond_to(service: Service, body: ResponsesRequest, req: GenerationRequest, tools: Optional[ToolSpec],
                     thinking: Optional[ReasoningSplit], request: Any, started: float, model: str,
                     store: ResponseStore, items: list[dict[str, Any]]) -> Any:
    """The response to a Responses body's request: streamed, or whole as the stream's last event holds it
    (so both read a reply alike: an item's logprobs are its own text's). Once finished it is kept in
    `store` with its conversation's input `items`, unless the body says `store: false`."""
    events, chat = _Events(Shape(body, model), store if body.store is not False else None, items), \
        ResponseFormat(True, model)

    def whole() -> Optional[dict[str, Any]]:
        return events.last["response"] if events.last.get("type") in ("response.completed", "response.incomplete") \
            else None

    return await one_choice(service, req, thinking, request, bool(body.stream),
                            lambda choice, run, raising: _events(service, events, choice, run, chat, started, tools,
                                                                 raising), whole, body.return_tokens_as_token_ids)


class _Events:
    """The stream's events, numbered; the output items as they open and close."""

    def __init__(self, shape: Shape, store: Optional[ResponseStore] = None,
                 items: Optional[list[dict[str, Any]]] = None):
        self.shape, self.seq = shape, 0
        self.store, self.items = store, items or []  # (where a finished response is kept, with its input)
        self.output: list[dict[str, Any]] = []  # closed items
        self.open: Optional[tuple[str, str, list[str], list[dict[str, Any]]]] = None  # (kind, id, texts, logprobs)
        self.thought = ""
        self.calling: dict[str, Any] = {}  # the open function_call's id and name (its chat delta)
        self.last: dict[str, Any] = {}  # the last event's data

    def event(self, kind: str, **fields: Any) -> str:
        self.last = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(self.last, ensure_ascii=False)}\n\n"

    def text(self, kind: str, delta: str, logprobs: Optional[list[dict[str, Any]]]) -> list[str]:
        """A delta of the reasoning item's text or the message's, opening that item first if need be."""
        out = []
        if self.open is None or self.open[0] != kind:
            out += self.close()
            item_id = Shape.item_id("rs" if kind == "reasoning" else "msg")
            self.open = (kind, item_id, [], [])
            item = Shape.reasoning(item_id, "", "in_progress") if kind == "reasoning" else \
                Shape.message(item_id, "", None, "in_progress")
            out.append(self.event("response.output_item.added", output_index=len(self.output), item=item))
            if kind == "message":
                out.append(self.event("response.content_part.added", item_id=item_id, output_index=len(self.output),
                                      content_index=0, part=Shape.part("", None)))
        _, item_id, texts, lps = self.open
        texts.append(delta)
        lps += logprobs or []
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": logprobs or []}
        return out + [self.event(name, item_id=item_id, output_index=len(self.output), content_index=0, delta=delta,
                                 **extra)]

    def close(self, status: str = "completed") -> list[str]:
        """The open item done (`status` "incomplete": the budget cut it)."""
        if self.open is None:
            return []
        kind, item_id, texts, lps = self.open
        self.open, text, at = None, "".join(texts), len(self.output)
        if kind == "call":
            item = Shape.call({**self.calling, "function": {**self.calling["function"], "arguments": text}})
            out = [self.event("response.function_call_arguments.done", item_id=item_id, output_index=at,
                              arguments=text)]
        elif kind == "reasoning":
            self.thought += text
            item = Shape.reasoning(item_id, text, status)
            out = [self.event("response.reasoning_text.done", item_id=item_id, output_index=at, content_index=0,
                              text=text)]
        else:
            item = Shape.message(item_id, text, lps, status)
            out = [self.event("response.output_text.done", item_id=item_id, output_index=at, content_index=0,
                              text=text, logprobs=lps),
                   self.event("response.content_part.done", item_id=item_id, output_index=at, content_index=0,
                              part=Shape.part(text, lps))]
        self.output.append(item)
        return out + [self.event("response.output_item.done", output_index=at, item=item)]

    def call(self, delta: dict[str, Any]) -> list[str]:
        """A chat tool_calls delta: one with an id opens a function_call item, and any part of its
        arguments streams into the open one (which closes as any other item does)."""
        out: list[str] = []
        if "id" in delta:
            out, self.calling = self.close(), delta
            item = Shape.call(delta, "in_progress")
            self.open = ("call", item["id"], [], [])
            out.append(self.event("response.output_item.added", output_index=len(self.output), item=item))
        if self.open is not None and self.open[0] == "call" and (part := delta["function"].get("arguments")):
            self.open[2].append(part)
            out.append(self.event("response.function_call_arguments.delta", item_id=self.open[1],
                                  output_index=len(self.output), delta=part))
        return out


async def _events(service: Service, events: _Events, choice: Any, run: Any, chat: ResponseFormat, started: float,
                  tools: Optional[ToolSpec], raising: bool = False) -> AsyncIterator[str]:
    """The Responses events of one choice's chat chunks; an error ends them with `error` and
    `response.failed` (`raising`: raised instead)."""
    shape, finals = events.shape, [None]
    yield events.event("response.created", response=shape.response("in_progress", []))
    yield events.event("response.in_progress", response=shape.response("in_progress", []))
    try:
        async for chunk in choice_chunks(service, ENDPOINT, choice, run, chat, started, tools, finals, 0):
            (part,) = chunk["choices"]
            delta, logprobs = part["delta"], (part["logprobs"] or {}).get("content")
            if delta.get("reasoning"):
                for event in events.text("reasoning", delta["reasoning"], None):
                    yield event
            if delta.get("content") or (logprobs and events.open is not None and events.open[0] == "message"):
                for event in events.text("message", delta.get("content", ""), logprobs):
                    yield event
            for call in delta.get("tool_calls") or []:
                for event in events.call(call):
                    yield event
            if finish := part["finish_reason"]:
                status = "incomplete" if finish == "length" else "completed"
                for event in events.close(status):
                    yield event
                usage = await _usage(service, finals[0], events.thought, choice.req.depth_label)
                response = shape.response(status, events.output, usage, finish)
                if events.store is not None:
                    events.store.put(response, events.items)
                yield events.event(f"response.{status}", response=response)
    except Exception as e:  # (the stream has begun: an error event ends it)
        run.cancel(by_client=False)
        if raising:
            raise e if isinstance(e, APIError) else service.server_error(e) from None
        error = e if isinstance(e, APIError) else service.server_error(e)
        yield events.event("error", code=error.code, message=error.message, param=error.param)
        failed = {**shape.response("failed", events.output), "error": {"code": "server_error",  # (OpenAI's codes)
                                                                       "message": error.message}}
        yield events.event("response.failed", response=failed)
    finally:
        run.cancel()
