"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) on the chat path.

A body is read as a chat request: `system` the system message; each message's content blocks as chat
messages (text; an assistant's `tool_use` blocks as its tool calls and its `thinking` blocks as its
reasoning; a user's `tool_result` blocks as tool messages, before its text); tools (`input_schema`) and
tool_choice (`any` is chat's "required", `tool` a named function) as chat's; `stop_sequences` its stop
strings; `thinking` Qwen's `enable_thinking`. It runs as one choice, as a chat request does
(responses.py), and is answered as a Message whose content holds a thinking block (a thinking model's
thought), a text block and a tool_use block per call; streamed, as the Messages API's events
(`message_start`, `content_block_start` / `_delta` / `_stop`, `message_delta`, `message_stop`), built from
that choice's chat chunks. Errors have Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`.
`GET /v1/models` answers Anthropic's clients (they send `anthropic-version`) with its ModelInfo shapes.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Optional

from .errors import APIError, anthropic_body, validation_error
from .generation import ResponseFormat
from .responses import choice_chunks, one_choice

if TYPE_CHECKING:
    from ..engine.request import GenerationRequest, GenerationStats
    from .chat import ToolSpec
    from .models import ChatCompletionRequest, MessagesRequest
    from .reasoning import ReasoningSplit
    from .service import Service

ENDPOINT = "/v1/messages"
STOPS = {"length": "max_tokens", "tool_calls": "tool_use"}


def renamed(e: APIError, origins: list[str]) -> APIError:
    """A chat request's error as this endpoint names its fields: a chat message by the message or block it
    came from (`origins`), a tool's field without chat's `function.` (its errors go out in Anthropic's
    shape: errors.py `body_for`)."""
    def ours(text: str) -> str:
        text = re.sub(r"messages\[(\d+)\]", lambda at: origins[int(at.group(1))] if int(at.group(1)) < len(origins)
                      else at.group(0), text)
        return re.sub(r"(tools\[\d+\])\.function\.", r"\1.", text)

    message = ours(e.message)
    message = message.replace("tool_choice 'required'", 'tool_choice {"type": "any"}').replace(
        "max_completion_tokens", "max_tokens")
    return APIError(e.status, message, param=ours(e.param) if e.param else None, code=e.code, type=e.type,
                    headers=e.headers)


# -- the body, as a chat request ----------------------------------------------------------------


def chat_body(body: MessagesRequest, counting: bool = False,
              defaults: Optional[dict[str, Any]] = None) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat request a Messages body asks for, and where each of its messages came from (for errors:
    `renamed`); a 400 where it cannot be one (`counting`: only its prompt is wanted, as count_tokens asks,
    so max_tokens may be left out, and is not checked)."""
    from pydantic import ValidationError

    from .models import ChatCompletionRequest, _GenerationBody

    if body.max_tokens is None and not counting:
        raise APIError(400, "max_tokens: Field required", param="max_tokens")
    skip = {"stop", "n", "stream_options", "response_format"}
    shared = body.model_dump(include=set(_GenerationBody.model_fields) - skip, exclude_none=True)
    system = _text("system", body.system) if body.system is not None else ""
    if body.temperature is not None and not 0 <= body.temperature <= 1:  # (Anthropic's range, not OpenAI's)
        raise APIError(400, f"temperature: must be in [0, 1], got {body.temperature}", param="temperature")
    kwargs = dict(body.chat_template_kwargs or {})
    # Extended thinking only where asked, as Anthropic's default is (Qwen's templates read enable_thinking),
    # unless the server's own template variables (`defaults`: --chat-template-args) say otherwise.
    if body.thinking is not None or "enable_thinking" not in (defaults or {}):
        kwargs.setdefault("enable_thinking", _thinking(body.thinking, None if counting else body.max_tokens))
    choice, parallel = _choice(body.tool_choice)
    messages, origins = _messages(body.messages)
    if system:
        messages, origins = [{"role": "system", "content": system}, *messages], ["system", *origins]
    prefill = bool(messages) and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
    # (a last assistant message is Anthropic's prefill: the reply goes on from it)
    chat = {**shared, "messages": messages, "stop": body.stop_sequences,
            "response_format": _format(body.output_config), "continue_final_message": prefill or None,
            "tools": _tools(body.tools), "tool_choice": choice, "parallel_tool_calls": parallel,
            "chat_template_kwargs": kwargs or None}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None}), origins
    except ValidationError as e:
        raise renamed(validation_error(e.errors(include_url=False)), origins) from None


def _format(config: Any) -> Optional[dict[str, Any]]:
    """Anthropic's structured output (`output_config.format`) as chat's response_format."""
    if config is not None and not isinstance(config, dict):
        raise APIError(400, "output_config: must be an object", param="output_config")
    fmt = config.get("format") if config is not None else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                       param="output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _text(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" and
                                         isinstance(b.get("text"), str) for b in content):
        return "\n".join(b["text"] for b in content)  # (as chat joins its content parts)
    raise APIError(400, f"{where} must be text, or a list of text blocks", param=where)


# Each block kind read here: the role that sends it, and its fields' types ((type, what, needed));
# a field left out that is not needed is taken as empty.
BLOCKS: dict[str, tuple[Optional[str], dict[str, tuple[type, str, bool]]]] = {
    "text": (None, {"text": (str, "a string", True)}),
    "tool_use": ("assistant", {"id": (str, "a string", True), "name": (str, "a string", True),
                               "input": (dict, "an object", True)}),
    "thinking": ("assistant", {"thinking": (str, "a string", False), "signature": (str, "a string", False)}),
    "redacted_thinking": ("assistant", {"data": (str, "a string", False)}),
    "tool_result": ("user", {"tool_use_id": (str, "a string", True), "is_error": (bool, "a boolean", False)}),
}
JSON_TYPES = {bool: "a boolean", str: "a string", int: "a number", float: "a number", list: "an array",
              dict: "an object", type(None): "null"}


def _kind(at: str, block: dict[str, Any], role: str) -> str:
    """A block's type, once its fields have the types it needs: a 400 naming the field that does not (not a 500
    where a list or an object is used as a name)."""
    kind = block.get("type")
    if not isinstance(kind, str):
        raise APIError(400, f"{at}.type: must be a string, got {JSON_TYPES.get(type(kind), 'a value')}",
                       param=f"{at}.type")
    sender, fields = BLOCKS.get(kind, (role, None))
    if fields is None or sender not in (None, role):
        raise APIError(400, f"{at}: {kind!r} blocks are not supported here"
                            f"{' in ' + role + ' messages' if fields is not None else ''}", param=f"{at}.type")
    for field, (kind_of, what, needed) in fields.items():
        value = block.get(field)
        if value is None and needed:
            raise APIError(400, f"{at}: a {kind} block needs its {field} ({what})", param=f"{at}.{field}")
        if value is not None and not isinstance(value, kind_of):
            raise APIError(400, f"{at}.{field}: must be {what}, got {JSON_TYPES.get(type(value), 'a value')}",
                           param=f"{at}.{field}")
    return kind


def _messages(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    out: list[dict[str, Any]] = []
    origins: list[str] = []  # (each chat message's: the message, or the tool_result block, it came from)
    for i, m in enumerate(messages):
        role, content, where = m.get("role"), m.get("content"), f"messages[{i}]"
        if role not in ("user", "assistant"):
            raise APIError(400, f"{where}.role must be user or assistant", param=f"{where}.role")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
            raise APIError(400, f"{where}.content must be text or a list of content blocks", param=f"{where}.content")
        text, calls, thought = [], [], []
        for j, b in enumerate(blocks):
            kind = _kind(f"{where}.content[{j}]", b, role)
            if kind == "text":
                text.append(b["text"])
            elif kind == "tool_use":
                calls.append({"id": b["id"], "type": "function", "function": {
                    "name": b["name"], "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False)}})
            elif kind in ("thinking", "redacted_thinking"):
                thought.append(b.get("thinking") or "")
            else:  # (a tool_result)
                out.append(_result(f"{where}.content[{j}]", b))
                origins.append(f"{where}.content[{j}]")
        if role == "user" and (text or not blocks):
            out.append({"role": "user", "content": "\n".join(text)})
            origins.append(where)
        elif role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(text) or (None if calls else "")}
            if calls:
                msg["tool_calls"] = calls
            if thought:
                msg["reasoning_content"] = "".join(thought)
            out.append(msg)
            origins.append(where)
    return out, origins


def _result(at: str, block: dict[str, Any]) -> dict[str, Any]:
    """A tool_result block as chat's tool message."""
    content = block.get("content")
    result = "" if content is None else _text(f"{at}.content", content)
    return {"role": "tool", "tool_call_id": block["tool_use_id"],
            "content": f"Error: {result}" if block.get("is_error") else result}


def _thinking(thinking: Any, max_tokens: Optional[int]) -> bool:
    """Whether Anthropic's `thinking` turns extended thinking on: {"type": "enabled", "budget_tokens": N}
    (N at least 1024 and under max_tokens, as Anthropic has it), {"type": "adaptive"} (the model's choice:
    on), {"type": "disabled"} or none (off)."""
    if thinking is None:
        return False
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "adaptive":
        return True
    if kind not in ("enabled", "disabled"):
        raise APIError(400, 'thinking.type: must be {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} '
                            'or {"type": "disabled"}', param="thinking.type")
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1024
                              or (max_tokens is not None and budget >= max_tokens)):
        raise APIError(400, f"thinking.budget_tokens: must be at least 1024 and less than max_tokens, got {budget}",
                       param="thinking.budget_tokens")
    return kind == "enabled"


def _tools(tools: Any) -> Any:
    if not isinstance(tools, list):
        return tools
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise APIError(400, f"tools[{i}]: only client tools (name, input_schema) are supported here, got {kind!r}",
                           param=f"tools[{i}].type")
        if not isinstance(tool.get("input_schema"), dict):
            raise APIError(400, f"tools[{i}].input_schema: Field required (a JSON Schema object)",
                           param=f"tools[{i}].input_schema")
        fn = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _choice(choice: Any) -> tuple[Any, Optional[bool]]:
    """Chat's tool_choice and parallel_tool_calls for Anthropic's tool_choice."""
    if not isinstance(choice, dict):
        return choice, None
    if not isinstance(choice.get("disable_parallel_tool_use", False), bool):
        raise APIError(400, "tool_choice.disable_parallel_tool_use: must be a boolean",
                       param="tool_choice.disable_parallel_tool_use")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise APIError(400, 'tool_choice.name: tool_choice {"type": "tool"} needs the name of the tool (a string)',
                           param="tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    if kind not in ("auto", "any", "none"):
        raise APIError(400, f"tool_choice.type: must be auto, any, tool or none, got {kind!r}",
                       param="tool_choice.type")
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


# -- the model listing, as Anthropic's clients read it --------------------------------------------


def model_info(name: str, created: int) -> dict[str, Any]:
    """The served model as Anthropic's ModelInfo (`GET /v1/models/{id}`): `created_at` in RFC 3339, UTC."""
    stamp = datetime.fromtimestamp(created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": "model", "id": name, "display_name": name, "created_at": stamp}


def model_page(name: str, created: int, after_id: Optional[str], before_id: Optional[str]) -> dict[str, Any]:
    """Anthropic's model list (`GET /v1/models`): the one model served, on one page; a page after or before
    it (after_id, before_id) holds none."""
    data = [] if after_id or before_id else [model_info(name, created)]
    first = data[0]["id"] if data else None
    return {"data": data, "has_more": False, "first_id": first, "last_id": first}


# -- the answer ---------------------------------------------------------------------------------


class _Blocks:
    """A Message's content blocks as the chat chunks bring them, and the stream's events for them."""

    def __init__(self, model: str, req: GenerationRequest):
        self.id = "msg_" + uuid.uuid4().hex
        self.model, self.req = model, req
        self.content: list[dict[str, Any]] = []
        self.open: Optional[str] = None  # the kind of the last block, while text may still come to it
        self.stopped: Optional[tuple[str, Optional[str], dict[str, Any]]] = None  # (stop_reason, sequence, usage)
        self.begun = False  # message_start was sent
        self._input: list[str] = []  # the open tool_use block's input JSON so far

    @staticmethod
    def event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"

    def message(self, stop: Optional[str], sequence: Optional[str], usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": self.content,
                "stop_reason": stop, "stop_sequence": sequence, "usage": usage}

    def text(self, kind: str, delta: str) -> list[str]:
        """A piece of the thinking block's text or the text block's, opening that block first if need be."""
        out = []
        if self.open != kind:
            out += self.close()
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            self.content.append(block)
            self.open = kind
            out.append(self.event("content_block_start", index=len(self.content) - 1, content_block=dict(block)))
        self.content[-1][kind] += delta
        return out + [self.event("content_block_delta", index=len(self.content) - 1,
                                 delta={"type": f"{kind}_delta", kind: delta})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        if self.open == "tool_use":  # (a call max_tokens cut short: its input as far as it came, read as the
            # client's stream accumulator reads the same parts: jiter's partial mode, its strings cut short left out)
            from jiter import from_json

            try:
                value = from_json("".join(self._input).encode(), partial_mode=True)
            except ValueError:
                value = {}
            self.content[-1]["input"] = value if isinstance(value, dict) else {}
        self.open = None
        return [self.event("content_block_stop", index=len(self.content) - 1)]

    def call(self, delta: dict[str, Any]) -> list[str]:
        """A chat tool_calls delta: one with an id opens a tool_use block, and any part of its arguments
        streams into the open one as `input_json_delta`."""
        out: list[str] = []
        fn = delta["function"]
        if "id" in delta:
            out = self.close()
            self.content.append({"type": "tool_use", "id": delta["id"], "name": fn["name"], "input": {}})
            self.open, self._input = "tool_use", []
            out.append(self.event("content_block_start", index=len(self.content) - 1,
                                  content_block=dict(self.content[-1])))
        if self.open == "tool_use" and (part := fn.get("arguments")):
            self._input.append(part)
            out.append(self.event("content_block_delta", index=len(self.content) - 1,
                                  delta={"type": "input_json_delta", "partial_json": part}))
        return out


def _usage(prompt: int, cached: int, output: int = 0) -> dict[str, Any]:
    """Anthropic's usage: input tokens are those not read from a kept prefix (those are cache reads)."""
    return {"input_tokens": prompt - cached, "output_tokens": output, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def _final_usage(stats: GenerationStats) -> dict[str, Any]:
    return _usage(stats.prompt_tokens, stats.cached_tokens, stats.generation_tokens)


async def _chunks(service: Service, blocks: _Blocks, choice: Any, run: Any, started: float,
                  tools: Optional[ToolSpec]) -> AsyncIterator[str]:
    """The Messages events of one choice's chat chunks (an error is raised: the caller answers it)."""
    finals: list[Any] = [None]
    chat = ResponseFormat(True, blocks.model)
    cached: list[int] = []  # (from the engine's first chunk: the prompt's tokens read from a kept prefix)
    async for chunk in choice_chunks(service, ENDPOINT, choice, run, chat, started, tools, finals, 0,
                                     lambda first: cached.append(first.cached_tokens or 0)):
        if cached and not blocks.begun:  # (message_start once the prompt is in: its usage is final then)
            blocks.begun = True
            usage = _usage(len(blocks.req.prompt_tokens), cached[0])
            yield blocks.event("message_start", message={**blocks.message(None, None, usage), "content": []})
        (part,) = chunk["choices"]
        delta = part["delta"]
        for kind, key in (("thinking", "reasoning"), ("text", "content")):
            if delta.get(key):
                for event in blocks.text(kind, delta[key]):
                    yield event
        for call in delta.get("tool_calls") or []:
            for event in blocks.call(call):
                yield event
        if finish := part["finish_reason"]:
            for event in blocks.close():
                yield event
            sequence = part.get("stop_reason") if isinstance(part.get("stop_reason"), str) else None
            called = finish != "length" and any(b["type"] == "tool_use" for b in blocks.content)  # (forced too)
            stop = "tool_use" if called else "stop_sequence" if sequence is not None else STOPS.get(finish, "end_turn")
            blocks.stopped = (stop, sequence, _final_usage(finals[0]))
            yield blocks.event("message_delta", delta={"stop_reason": stop, "stop_sequence": sequence},
                               usage=_final_usage(finals[0]))
            yield blocks.event("message_stop")


async def respond_to(service: Service, body: MessagesRequest, req: GenerationRequest, tools: Optional[ToolSpec],
                     thinking: Optional[ReasoningSplit], request: Any, started: float, model: str) -> Any:
    """A Messages body's Message: streamed, or whole as its stream builds it."""
    blocks = _Blocks(model, req)
    return await one_choice(service, req, thinking, request, bool(body.stream),
                            lambda choice, run, raising: _events(service, blocks, choice, run, started, tools,
                                                                 raising),
                            lambda: None if blocks.stopped is None else blocks.message(*blocks.stopped))


async def _events(service: Service, blocks: _Blocks, choice: Any, run: Any, started: float,
                  tools: Optional[ToolSpec], raising: bool) -> AsyncIterator[str]:
    """The Messages events of one choice; an error ends them with an `error` event (`raising`: raised)."""
    try:
        async for event in _chunks(service, blocks, choice, run, started, tools):
            yield event
    except Exception as e:
        run.cancel(by_client=False)
        error = e if isinstance(e, APIError) else service.server_error(e)
        if raising:
            raise error from None
        yield blocks.event("error", error=anthropic_body(error.status, error.message)["error"])
    finally:
        run.cancel()
