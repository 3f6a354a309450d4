"""OpenAI's Responses API (`POST /v1/responses`) on the chat path.

A body is read as a chat request: `instructions` and its `input` items become messages (text messages of
any role, `function_call` items as an assistant's calls, `function_call_output` items as tool results),
its flat function tools chat's tools, `text.format` a response_format, `max_output_tokens` the token
budget. It runs as one choice, as a chat request does (responses.py), and is answered as a Response whose
`output` holds a reasoning item (a thinking model's thought), a message item (the answer's text) and a
function_call item per call; streamed, as the Responses API's semantic events (`response.created` ...
`response.completed`, each with its `sequence_number`), built from the chat chunks of that choice.
Finished responses are kept in the API process's memory (response_store.py, unless `store: false`): a request
may go on from one (`previous_response_id`), `GET` / `DELETE /v1/responses/{id}` read and forget one, and
`GET /v1/responses/{id}/input_items` lists the conversation that led to it.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Optional

from .errors import APIError, validation_error
from .generation import ResponseFormat, usage_of
from .responses import choice_chunks, one_choice

if TYPE_CHECKING:
    from ..engine.request import GenerationRequest, GenerationStats
    from .chat import ToolSpec
    from .models import ChatCompletionRequest, ResponsesRequest
    from .reasoning import ReasoningSplit
    from .response_store import ResponseStore
    from .service import Service

ENDPOINT = "/v1/responses"
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# chat's field names as this endpoint's (in errors)
FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text",
          "top_logprobs": "top_logprobs"}
# OpenAI's `include` values: the logprobs are given where asked; the others name what a response here never holds
INCLUDABLE = frozenset({"message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
                        "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
                        "computer_call_output.output.image_url", "code_interpreter_call.outputs"})


# -- the body, as a chat request ----------------------------------------------------------------


def input_items(body: ResponsesRequest, store: ResponseStore) -> list[dict[str, Any]]:
    """The conversation's input items: those of the response it follows (`previous_response_id`, kept in
    `store`) and its output, then the body's own input."""
    earlier: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        found = store.conversation(body.previous_response_id)
        if found is None:
            raise APIError(400, f"no response {body.previous_response_id!r} is kept here (the most recent "
                                f"{store.most} are, while the server runs)", param="previous_response_id",
                           code="previous_response_not_found")  # (OpenAI's: a client sends the whole input then)
        earlier = found
    own = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else list(body.input)
    return earlier + own


def chat_body(body: ResponsesRequest, items: list[dict[str, Any]]) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat request a Responses body asks for, its conversation's input items given (`input_items`),
    and where each of its messages came from (for errors: `renamed`); a 400 naming the Responses field where
    it cannot be one."""
    from pydantic import ValidationError

    from .models import ChatCompletionRequest, _GenerationBody

    stateful = [name for name in ("conversation", "prompt") if getattr(body, name) is not None]
    if stateful or body.background:
        raise APIError(400, "conversations, stored prompts and background runs are not kept here: send the "
                            "conversation as input (or previous_response_id)", param=(stateful or ["background"])[0])
    if body.n not in (None, 1):
        raise APIError(400, "n is not a field of the Responses API: one output per response", param="n")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
        raise APIError(400, f"top_logprobs must be in [0, 20], got {body.top_logprobs}", param="top_logprobs")
    if unknown := [x for x in body.include or [] if x not in INCLUDABLE]:
        raise APIError(400, f"include: {unknown[0]!r} is not one of {', '.join(sorted(INCLUDABLE))}", param="include")
    skip = {"max_tokens", "response_format", "n", "stream_options"}
    shared = body.model_dump(include=set(_GenerationBody.model_fields) - skip, exclude_none=True)
    messages, origins = _messages(items, body.instructions, len(items) - len(_own(body.input)))
    logprobs = body.top_logprobs is not None or "message.output_text.logprobs" in (body.include or [])
    chat = {**shared, "messages": messages, "max_completion_tokens": body.max_output_tokens, "logprobs": logprobs,
            "top_logprobs": body.top_logprobs if logprobs else None, "response_format": _format(body.text),
            "tools": _tools(body.tools), "tool_choice": _choice(body.tool_choice),
            "parallel_tool_calls": body.parallel_tool_calls, "include_reasoning": body.include_reasoning,
            "chat_template_kwargs": body.chat_template_kwargs, "reasoning_effort": (body.reasoning or {}).get("effort")}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None}), origins
    except ValidationError as e:
        raise renamed(validation_error(e.errors(include_url=False)), origins) from None


def renamed(e: APIError, origins: list[str]) -> APIError:
    """A chat request's error named as this endpoint names its fields: a message by the input item (or the
    instructions) it came from, a tool's field without chat's `function.`, chat's field names by ours; the
    field a message names first, where the param is only its list."""
    def origin(at: re.Match) -> str:
        return origins[int(at.group(1))] if int(at.group(1)) < len(origins) else "input"

    def ours(text: str) -> str:
        text = re.sub(r"(tools\[\d+\])\.function\b\.?", r"\1.", re.sub(r"messages\[(\d+)\]", origin, text))
        return (text.replace("max_completion_tokens", "max_output_tokens").replace("messages", "input")
                .replace("reasoning_effort", "reasoning.effort"))

    message, param = ours(e.message), ours(e.param or "").rstrip(".")
    head = param.split("[")[0].split(".")[0]
    param = FIELDS.get(head, head) + param[len(head):]
    if param in ("input", "tools") and (named := re.match(r"((?:input|tools)\[\d+\][\w.\[\]]*|previous_response_id):",
                                                          message)):
        param = named.group(1)
    return APIError(e.status, message, param=param or None, code=e.code, type=e.type, headers=e.headers)


def _own(given: str | list[dict[str, Any]]) -> list[Any]:
    return [given] if isinstance(given, str) else given


def _messages(items: list[dict[str, Any]], instructions: Optional[str],
              earlier: int = 0) -> tuple[list[dict[str, Any]], list[str]]:
    """The conversation as chat messages, and each one's origin (`input[i]`, `instructions`, or for the
    first `earlier` items, those of the responses it follows, `previous_response_id`). The
    instructions and the system and developer items before the first other turn are one system message
    (templates want one, first); a call follows its assistant's text in that message; a reasoning item
    goes back as the next assistant message's reasoning."""
    out: list[dict[str, Any]] = []
    origins: list[str] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
        origins.append("instructions")
    thought: Optional[str] = None
    for at, item in enumerate(items):
        i = at - earlier  # (its index in the body's input; below 0: kept from an earlier response)
        where = f"input[{i}]" if i >= 0 else "previous_response_id"
        kind = item.get("type", "message")
        if kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise APIError(400, f"{where}: a reasoning item's content is a list of text parts", param=where)
            texts = [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
            thought = "".join(texts) or None
            continue
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise APIError(400, f"{where}.role must be one of {', '.join(ROLES)}", param=f"{where}.role")
            text = _text(f"{where}.content", item.get("content"))
            role = "system" if role == "developer" else role
            if role == "system" and len(out) == len([m for m in out if m["role"] == "system"]) and out:
                out[-1]["content"] += "\n\n" + text  # (one system message, first)
                continue
            msg: dict[str, Any] = {"role": role, "content": text}
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise APIError(400, f"{where}: a function_call needs call_id, name and arguments (strings)",
                               param=f"{where}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":  # (its text, or calls made together)
                out[-1].setdefault("tool_calls", []).append(call)
                continue
            msg = {"role": "assistant", "content": None, "tool_calls": [call]}
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or output is None:
                raise APIError(400, f"{where}: a function_call_output needs call_id and output", param=f"{where}")
            msg = {"role": "tool", "tool_call_id": item["call_id"],
                   "content": output if isinstance(output, str) else _text(f"{where}.output", output)}
        else:
            raise APIError(400, f"{where}: items of type {kind!r} are not supported here", param=f"{where}.type")
        if msg["role"] == "assistant" and thought is not None:
            msg["reasoning_content"], thought = thought, None
        out.append(msg)
        origins.append(where)
    return out, origins


def _text(field: str, content: Any) -> str:
    """`content` (at `field`) as text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS and
                                         isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise APIError(400, f"{field} must be text, or a list of input_text/output_text parts", param=field)


def _tools(tools: Any) -> Any:
    """Flat function tools ({"type": "function", "name", ...}) as chat's; anything else as it is, for chat's checks."""
    if not isinstance(tools, list):
        return tools
    out = []
    for i, tool in enumerate(tools):
        if isinstance(tool, dict) and tool.get("type") not in (None, "function"):
            raise APIError(400, f"tools[{i}]: only function tools are supported here, got {tool.get('type')!r}",
                           param=f"tools[{i}].type")
        flat = isinstance(tool, dict) and "function" not in tool
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}} if flat else tool)
    return out


def _choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _format(text: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """`text.format` as chat's response_format (None: free text); a json_schema one needs its schema."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, f"text.format must be an object with a type, got {type(fmt).__name__}",
                       param="text.format")
    if fmt.get("type") is None:
        raise APIError(400, "text.format needs a type: text, json_object or json_schema", param="text.format.type")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "text.format: a json_schema format needs its schema (a JSON Schema object)",
                           param="text.format.schema")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return {"type": fmt.get("type")}


# -- the answer ---------------------------------------------------------------------------------


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
                "tools": b.tools or [], "top_p": b.top_p, "truncation": "disabled", "usage": usage, "user": None,
                "metadata": b.metadata or {}}

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
    def call(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
        fn = call["function"]
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                "name": fn["name"], "arguments": fn["arguments"] if status == "completed" else "", "status": status}


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
        if kind == "reasoning":
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

    def call(self, call: dict[str, Any]) -> list[str]:
        out, at = self.close(), len(self.output)
        item = Shape.call(call)
        out += [self.event("response.output_item.added", output_index=at, item=Shape.call(call, "in_progress")),
                self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                           delta=item["arguments"]),
                self.event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                           arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=at, item=item)]
        self.output.append(item)
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
