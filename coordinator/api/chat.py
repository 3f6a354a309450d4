"""What a chat body becomes for the checkpoint's chat template: its messages, tools and tool_choice.

Tools are rendered by the checkpoint's own template, `apply_chat_template(messages, tools=...)`, and so
are the assistant's earlier `tool_calls` (arguments handed to it as objects, as Qwen's templates iterate
them) and `role: "tool"` results. A template with no notion of tools (one that renders the same with and
without them: the tiny and demo checkpoints' plain ChatML) gets Qwen3's conventions written into the
messages instead: the tools, with the JSON call format, in the system message; earlier calls as
`<tool_call>` blocks in the assistant's text; tool results as `<tool_response>` blocks in a user turn.

tool_choice (the output is parsed by tools.py):
- "auto", the default with tools: tools rendered, the output parsed for calls.
- "none": tools neither rendered nor parsed for (earlier calls and results in the messages still are).
- "required", or a named function: templates have no such notion. Where the last stage holds output to a
  grammar, the reply is held, as vLLM holds it, to JSON: the named function's arguments, or a list of calls
  ({"name", "parameters"}), one unless calls may be parallel; the system message ends with an instruction
  to write just that. Elsewhere the tools are rendered, the instruction asks for (that) function's call, and
  an output with no call that parses comes back as text, with the finish reason it had.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import APIError, validation_error

if TYPE_CHECKING:
    from .models import ChatCompletionRequest, ChatMessage, ContentPart

CHOICES = ("none", "auto", "required")
# apply_chat_template's own arguments: never a template variable from `chat_template_kwargs`
TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})

# Qwen3's tool prompt (hermes JSON calls), for templates that do not render tools themselves.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FORMAT = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
REQUIRED = "In this reply you must call at least one of the functions you are provided with."
NAMED = 'In this reply you must call the function "{name}".'
# Where the reply is held to the call (`ToolSpec.held`): what it is held to.
REQUIRED_HELD = ('In this reply you must call {which} of the functions you are provided with: reply with only a JSON '
                 'array of calls, each {{"name": <function-name>, "parameters": <args-json-object>}}.')
NAMED_HELD = 'In this reply you must call the function "{name}": reply with only its arguments, as a JSON object.'

_PROBE_TOOL = {"type": "function", "function": {"name": "mtpipe_probe", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}


@dataclass
class ToolSpec:
    """A request's tools (as dicts, as templates and parsers take them) and what it asked of them."""

    tools: list[dict[str, Any]]
    choice: str  # "auto", "none", "required", or "function" for a named one
    name: str | None = None  # the named function
    parallel: bool = True  # False: only the first call is returned
    held: bool = False  # "required" or named: the reply is held to `call_schema` (set where it can be)

    @property
    def active(self) -> bool:
        """Tools rendered into the prompt and the output parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def must_call(self) -> bool:
        return self.active and self.choice in ("required", "function")

    def instruction(self) -> str | None:
        if not self.active:
            return None
        if self.choice == "required":
            return REQUIRED_HELD.format(which="one or more" if self.parallel else "one") if self.held else REQUIRED
        if self.choice == "function":
            return (NAMED_HELD if self.held else NAMED).format(name=self.name)
        return None

    def call_schema(self) -> dict[str, Any]:
        """The JSON Schema a reply that must call is held to: the named function's arguments, or a list of
        calls, each {"name", "parameters"} of one of the tools (one call unless they may be parallel). Each
        tool's parameters go under the list's `$defs`, their references to their own root (`#`,
        `#/$defs/...`, `#/properties/...`) pointed there."""
        params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}
        if self.choice == "function":
            return params[self.name]
        defs, calls = {}, []
        for i, (name, schema) in enumerate(params.items()):
            defs[f"tool{i}"] = rooted(schema, f"#/$defs/tool{i}")
            calls.append({"type": "object", "properties": {"name": {"const": name},
                                                           "parameters": {"$ref": f"#/$defs/tool{i}"}},
                          "required": ["name", "parameters"], "additionalProperties": False})
        return {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                "$defs": defs}


SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
SCHEMA_DATA = frozenset({"const", "enum", "default", "examples"})  # values, never schemas: left as they are


def rooted(schema: Any, root: str) -> Any:
    """`schema` with its references to its own root (`#...`) pointing under `root` (a JSON pointer) instead."""
    if not isinstance(schema, dict):
        return [rooted(s, root) for s in schema] if isinstance(schema, list) else schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):  # (not "#anchor")
            out[key] = root + value[1:]
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: rooted(s, root) for name, s in value.items()}
        else:
            out[key] = value if key in SCHEMA_DATA else rooted(value, root)
    return out


def tool_spec(body: ChatCompletionRequest) -> ToolSpec | None:
    """The body's `tools` and `tool_choice`, checked: a bad one is a 400 naming it."""
    from pydantic import ValidationError

    from .models import ToolsBody

    for legacy, instead in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(body, legacy) is not None:  # (its answer would be a message's function_call, not tool_calls)
            raise APIError(400, f"{legacy} (OpenAI's deprecated function calling) is not supported: send {instead}",
                           param=legacy)
    tools: list[dict[str, Any]] = []
    if body.tools is not None:
        if not isinstance(body.tools, list):
            raise APIError(400, f"tools must be a list of function tools, got {type(body.tools).__name__}",
                           param="tools", code="invalid_type")
        try:
            parsed = ToolsBody.model_validate({"tools": body.tools}).tools
        except ValidationError as e:
            raise validation_error(e.errors(include_url=False)) from None
        seen: set[str] = set()
        for i, tool in enumerate(parsed):
            if tool.function.name in seen:
                raise APIError(400, f"tools[{i}].function.name: {tool.function.name!r} is given twice", param="tools")
            seen.add(tool.function.name)
        tools = [t.model_dump(exclude_none=True) for t in parsed]
    choice, name = _tool_choice(body.tool_choice, tools)
    if not tools and body.tool_choice is None:
        return None
    return ToolSpec(tools, choice, name, body.parallel_tool_calls is not False)


def _tool_choice(raw: Any, tools: list[dict[str, Any]]) -> tuple[str, str | None]:
    from pydantic import ValidationError

    from .models import NamedToolChoice

    if raw is None:
        return ("auto" if tools else "none"), None
    if isinstance(raw, str):
        if raw not in CHOICES:
            raise APIError(400, f"tool_choice must be one of {', '.join(CHOICES)} or a function, got {raw!r}",
                           param="tool_choice")
        if raw == "required" and not tools:
            raise APIError(400, "tool_choice 'required' needs tools", param="tool_choice")
        return raw, None
    try:
        named = NamedToolChoice.model_validate(raw)
    except ValidationError:
        raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                            '"function": {"name": ...}}', param="tool_choice") from None
    names = [t["function"]["name"] for t in tools]
    if named.function.name not in names:
        known = f"; the tools are {', '.join(names)}" if names else "; no tools were given"
        raise APIError(400, f"tool_choice names the function {named.function.name!r}, which is not among the "
                            f"tools{known}", param="tool_choice")
    return "function", named.function.name


# -- messages -----------------------------------------------------------------------------------


def chat_messages(body: ChatCompletionRequest, answered: bool = False) -> list[dict[str, Any]]:
    """The messages as the template takes them. As vLLM's, a tool message may answer a call no longer in
    the conversation (a client that pruned it), and a call sent back without its id gets one; with
    `answered` (OpenAI's Responses API and Anthropic's refuse that) it must answer an earlier call."""
    out: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for i, m in enumerate(body.messages):
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": _content(i, m)}
        if m.name is not None:
            msg["name"] = m.name
        thought = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if thought is not None and role == "assistant":  # (Qwen's templates read `reasoning_content`)
            msg["reasoning_content"] = thought
        if m.tool_calls:
            if role != "assistant":
                raise APIError(400, f"messages[{i}]: only assistant messages carry tool_calls, not {m.role!r} ones",
                               param="messages")
            msg["tool_calls"] = [{"id": c.id or f"c{i:05d}{j:03d}", "type": "function",  # (9 characters, as some want)
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for j, c in enumerate(m.tool_calls)]
            call_ids.update(c["id"] for c in msg["tool_calls"])
        if role == "tool":
            if not m.tool_call_id:
                raise APIError(400, f"messages[{i}]: a tool message needs the tool_call_id it answers",
                               param="messages")
            if answered and m.tool_call_id not in call_ids:
                raise APIError(400, f"messages[{i}]: tool_call_id {m.tool_call_id!r} answers no tool call of an "
                                    "earlier assistant message", param="messages")
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _content(i: int, m: ChatMessage) -> str:
    """A message's text. Only an assistant's message may go without content (one that made calls, as in
    OpenAI's; one whose reply was all thought, which vLLM sends as null and agents send back)."""
    if m.content is None and m.role != "assistant":
        raise APIError(400, f"messages[{i}]: {m.role} messages need content", param="messages")
    if m.content is None and m.refusal is not None:  # (an assistant's refused turn, as OpenAI's reply carried it)
        return m.refusal
    if not isinstance(m.content, list):
        return m.content or ""
    return "\n".join(_part_text(i, m.role, part) for part in m.content)


def _part_text(i: int, role: str, part: ContentPart) -> str:
    """A content part's text: a text part's, or an assistant's refusal part's (OpenAI's clients send a
    refused turn back so)."""
    if part.type == "refusal" and role == "assistant":
        if part.refusal is None:
            raise APIError(400, f"messages[{i}]: a refusal content part needs its refusal", param="messages")
        return part.refusal
    if part.type != "text":
        allowed = "text and refusal" if role == "assistant" else "text"
        raise APIError(400, f"messages[{i}]: only {allowed} content parts are supported, got {part.type!r}",
                       param="messages")
    if part.text is None:
        raise APIError(400, f"messages[{i}]: a text content part needs its text", param="messages")
    return part.text


def echoed(body: ChatCompletionRequest) -> str | None:
    """vLLM's chat `echo`: the text a reply is shown after, the last message's where the reply is in its
    role (the assistant's, or, without the generation prompt, any: the reply goes on in the last
    message's turn); None where nothing is echoed."""
    if not body.echo or not body.messages or (body.add_generation_prompt and body.messages[-1].role != "assistant"):
        return None
    return _content(len(body.messages) - 1, body.messages[-1])


def _arguments(arguments: str | dict[str, Any]) -> Any:
    """A call's arguments as an object where they are one (templates iterate them), else as sent."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):  # (nested past the parser's depth: as sent too)
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


# -- rendering ----------------------------------------------------------------------------------


def renders_tools(tokenizer: Any, variables: dict[str, Any] | None = None) -> bool:
    """Whether the chat template has a notion of tools: it renders a prompt differently with one (with
    `variables`, the server's: --chat-template-args)."""
    probe = [{"role": "user", "content": "?"}]
    try:
        plain = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False, **(variables or {}))
        with_tools = tokenizer.apply_chat_template(probe, tools=[_PROBE_TOOL], add_generation_prompt=True,
                                                   tokenize=False, **(variables or {}))
    except Exception:  # noqa: BLE001 - a template that refuses the probe gets the written-in conventions
        return False
    return with_tools != plain


def template_input(messages: list[dict[str, Any]], spec: ToolSpec | None,
                   native: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for `apply_chat_template`; `native`: the template renders tools itself."""
    tools = spec.tools if spec is not None and spec.active else None
    instruction = spec.instruction() if spec is not None else None
    if native:
        return _with_system(messages, instruction), tools
    written = _tools_prompt(tools) if tools else None
    extra = "\n\n".join(s for s in (written, instruction) if s)
    return _with_system(_written_turns(messages), extra), None


def _tools_prompt(tools: list[dict[str, Any]]) -> str:
    return TOOLS_PREAMBLE + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_FORMAT


def _with_system(messages: list[dict[str, Any]], extra: str | None) -> list[dict[str, Any]]:
    """`extra` at the end of the system message (templates want it first), or as one of its own."""
    if not extra:
        return messages
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        content = f"{first['content']}\n\n{extra}" if first["content"] else extra
        return [{**first, "content": content}, *messages[1:]]
    return [{"role": "system", "content": extra}, *messages]


def _written_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier calls and their results written into the text, as Qwen3's template writes them."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
            continue
        calls = [c["function"] for c in m.get("tool_calls") or []]
        m = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        if calls:
            blocks = "\n".join("<tool_call>\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]},
                                                             ensure_ascii=False) + "\n</tool_call>" for c in calls)
            m["content"] = f"{m['content']}\n{blocks}" if m["content"] else blocks
        out.append(m)
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


def text_size(messages: list[dict[str, Any]]) -> int:
    """About how many characters the messages hold (content, tool calls): what tokenizing costs."""
    size = 0
    for m in messages:
        for key in ("content", "tool_calls", "reasoning_content"):
            value = m.get(key)
            if value:
                size += len(value) if isinstance(value, str) else len(str(value))
    return size


def check_template_variables(variables: dict[str, Any] | None) -> None:
    """`chat_template_kwargs` (vLLM's): variables of the template, never arguments of its call."""
    reserved = sorted(TEMPLATE_ARGUMENTS.intersection(variables or {}))
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {reserved[0]!r}: it is an argument of the template "
                            "call, not a variable of the template", param="chat_template_kwargs")


def template_variables(kwargs: dict[str, Any] | None, reasoning_effort: str | None) -> dict[str, Any] | None:
    """The template's variables: `chat_template_kwargs`, and OpenAI's reasoning_effort as the variable and
    as Qwen's enable_thinking ("none" turns thought off), as vLLM maps it; what the kwargs say wins."""
    variables = dict(kwargs or {})
    if reasoning_effort is not None:
        variables.setdefault("reasoning_effort", reasoning_effort)
        variables.setdefault("enable_thinking", reasoning_effort != "none")
    return variables or None


FINER_EFFORTS = ("xhigh", "max")  # OpenAI's efforts above "high", which most templates do not know


def template_effort(tokenizer: Any, effort: str | None) -> str | None:
    """OpenAI's reasoning_effort as the model's chat template takes it: an effort above "high" is "high"
    where the template names no such value (a template that knows only low, medium and high would
    otherwise see a value it never compares with)."""
    if effort not in FINER_EFFORTS:
        return effort
    template = str(getattr(tokenizer, "chat_template", None) or "")
    return effort if f"'{effort}'" in template or f'"{effort}"' in template else "high"


def check_request_template(template: str | None) -> None:
    """A request's own `chat_template` (vLLM's field): refused, as vLLM refuses one unless its server trusts
    requests' templates; this one renders every prompt with its own (the model's, or --chat-template)."""
    if template is not None:
        raise APIError(400, "a request's chat_template is not accepted: prompts are rendered with the server's "
                            "chat template (chat_template_kwargs sets its variables)", param="chat_template")
