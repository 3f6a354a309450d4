"""A Responses API body (`POST /v1/responses`) read as the chat request it asks for.

`instructions` and its `input` items become messages (text messages of any role, `function_call` items
as an assistant's calls, `function_call_output` items as tool results), its flat function tools chat's
tools, `text.format` a response_format, `max_output_tokens` the token budget; a request that goes on
from a kept response (`previous_response_id`) has that response's conversation first. An error is named
as this endpoint names its fields (`renamed`).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Optional, TypeVar

from .errors import APIError, validation_error

if TYPE_CHECKING:
    from .models import ChatCompletionRequest, ResponsesRequest
    from .response_store import ResponseStore

T = TypeVar("T")
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# chat's field names as this endpoint's (in errors)
FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text",
          "top_logprobs": "top_logprobs"}
# OpenAI's `include` values: the logprobs are given where asked; the others name what a response here never holds
INCLUDABLE = frozenset({"message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
                        "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
                        "computer_call_output.output.image_url", "code_interpreter_call.outputs"})


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
            text = _text(f"{where}.content", item.get("content"), refusals=role == "assistant")
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


def _text(field: str, content: Any, refusals: bool = False) -> str:
    """`content` (at `field`) as text: a string, or text parts joined; with `refusals` (an assistant's
    message, a response's output sent back) a refusal part's refusal too."""
    if isinstance(content, str):
        return content

    def text(p: Any) -> Optional[str]:
        if not isinstance(p, dict):
            return None
        if refusals and p.get("type") == "refusal":
            return p["refusal"] if isinstance(p.get("refusal"), str) else None
        return p["text"] if p.get("type") in TEXT_PARTS and isinstance(p.get("text"), str) else None

    if isinstance(content, list) and all(text(p) is not None for p in content):
        return "".join(text(p) or "" for p in content)
    parts = "input_text/output_text" + ("/refusal" if refusals else "")
    raise APIError(400, f"{field} must be text, or a list of {parts} parts", param=field)


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


def leading_instructions(items: list[dict[str, Any]]) -> int:
    """How many system or developer messages open the conversation: truncation keeps them (a client's
    system prompt as an input item), as it keeps `instructions`."""
    n = 0
    while n < len(items) and items[n].get("type", "message") == "message" and items[n].get("role") in (
            "system", "developer"):
        n += 1
    return n


def from_turn(items: list[dict[str, Any]], start: int) -> list[dict[str, Any]]:
    """The conversation with its turns before `start` dropped, its opening instructions kept."""
    lead = leading_instructions(items)
    return items if start <= lead else [*items[:lead], *items[start:]]


def turn_starts(items: list[dict[str, Any]]) -> list[int]:
    """Where the conversation may begin once its first turns are dropped (truncation "auto"): at its start,
    or at a user's message past its opening instructions (never between a call and its output)."""
    lead = leading_instructions(items)
    return [0] + [i for i, item in enumerate(items) if i > lead and item.get("type", "message") == "message"
                  and item.get("role") == "user"]


async def fewest_dropped(items: list[dict[str, Any]], attempt: Callable[[int], Awaitable[T]], overflow: APIError) -> T:
    """`attempt(start)` from the first turn start (`turn_starts`) at which the conversation fits the context:
    the fewest first turns dropped, found by halving; `overflow` (the whole conversation's error) where none fits."""
    starts = turn_starts(items)[1:]
    low, high, found = 0, len(starts) - 1, None
    while low <= high:
        mid = (low + high) // 2
        try:
            found, high = await attempt(starts[mid]), mid - 1
        except APIError as e:
            if e.code != "context_length_exceeded":
                raise
            low = mid + 1
    if found is None:
        raise overflow
    return found
