"""Tool calls in generated text, whole or as it streams: Qwen3's JSON form and Qwen3.5/3.6's XML form.

Both sit between `<tool_call>` and `</tool_call>`; the body's form picks mlx-lm's parser for it:

    Qwen3 (hermes JSON, mlx-lm's json_tools):
        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>
    Qwen3.5 / 3.6 / Qwen3-Coder (XML, mlx-lm's qwen3_coder):
        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        </function>
        </tool_call>

XML values are typeless: they take the type the request's tool schema gives the parameter.

A block ends at the first `</tool_call>` that is not inside a JSON string or an XML parameter value, so
an argument may hold the closing tag itself. A JSON block that does not parse, or is still open when the
text ends, is text. An XML block is a call once its `<function=NAME>` is read, and its arguments stream
(tool_xml.py), as vLLM streams them: one the budget ends inside its arguments is a call cut short (`cut`),
its arguments as far as they came; one a stop string or token ends is closed as its tags would close it.
Text next to a call loses the whitespace on that side (the newlines around the tags).

`ToolCallParser` takes the text in pieces and hands out what it can decide: text, held back only while
it may begin `<tool_call>` (or is whitespace that a call would drop), whole calls (JSON), and a streamed
call's beginning, its arguments' parts and its end. However the text is cut, the calls and the joined
text are the same as for the whole text at once (`parse_tool_calls`).
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from .tool_xml import XmlCall, function_name, tag_prefix

log = logging.getLogger(__name__)

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
XML_FUNCTION = "<function="


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI hands arguments out
    id: str = field(default_factory=_call_id)
    cut: bool = False  # the text ended inside it: its arguments are as far as they came

    def to_dict(self, index: int | None = None) -> dict[str, Any]:
        """The call as `message.tool_calls[i]`, or with `index` as a streamed `delta.tool_calls[i]`."""
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


# ("text", str), ("call", ToolCall): a whole one; a streamed one: ("begin", ToolCall) (its id and name),
# ("arguments", str) (the next part of them), ("end", ToolCall) (all of them)
Event = tuple[str, Any]


def _inside_value(body: str) -> bool:
    """Whether the end of a block's body so far is inside a JSON string or an XML parameter value."""
    s = body.lstrip()
    if s.startswith(XML_FUNCTION):
        return s.count("<parameter=") > s.count("</parameter>")
    in_string = escaped = False
    for ch in s:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = in_string
        elif ch == '"':
            in_string = not in_string
    return in_string


def _parse_one(item: Any) -> ToolCall:
    if not isinstance(item, dict):
        raise TypeError(f"a tool call is an object, got {type(item).__name__}")
    name = item.get("name")
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = json.loads(args) if args.strip() else {}
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a tool call needs a function name, got {name!r}")
    if not isinstance(args, dict):
        raise TypeError(f"a tool call's arguments are an object, got {type(args).__name__}")
    return ToolCall(name.strip(), json.dumps(args, ensure_ascii=False))


def parse_block(body: str, tools: list[dict[str, Any]] | None = None) -> list[ToolCall] | None:
    """The calls in one `<tool_call>` block's body, or None when it does not parse."""
    from mlx_lm.tool_parsers import json_tools, qwen3_coder

    s = body.strip()
    try:
        if s.startswith(XML_FUNCTION):
            parsed = qwen3_coder.parse_tool_call(s, tools)
        else:
            parsed = json_tools.parse_tool_call(s, tools)
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = [_parse_one(item) for item in items]
    except Exception as e:  # noqa: BLE001 - whatever the model wrote, a call that does not parse is text
        log.info("a tool call did not parse (%s: %s); it is returned as text", type(e).__name__, e)
        return None
    return calls or None


class ToolCallParser:
    """Generated text in, as it comes; out, in order: ("text", str) and ("call", ToolCall) events."""

    def __init__(self, tools: list[dict[str, Any]] | None = None):
        self.tools = tools
        self._buf = ""  # not decided yet: a possible start of `<tool_call>`, or an open block
        self._in_block = False
        self._scanned = 0  # in an open block: where the next `</tool_call>` may start
        self._pending_ws = ""  # trailing whitespace of the text: released if text follows, dropped if a call does
        self._after_call = False  # whitespace right after a call is dropped
        self._texted = False  # text came before: text after a call is kept apart from it
        self._gap = ""  # the whitespace around the calls since the last text (one run of it separates)
        self._whole = False  # in a block read whole (JSON), not streamed
        self._xml: XmlCall | None = None  # the streamed call the block is
        self._call: ToolCall | None = None  # its id and name

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._buf += text
        self._advance(out, final=False)
        return out

    def finish(self, by_budget: bool = True) -> list[Event]:
        """The end of the text: an open JSON block, or a held-back start of one, is text; a streamed call is
        cut short where the budget (`by_budget`) ended it inside its arguments, else closed."""
        out: list[Event] = []
        self._advance(out, final=True)
        if self._xml is not None and self._call is not None:
            cut = by_budget and self._xml.open  # (one whose function closed is whole: its arguments are)
            self._arguments(self._xml.cut() if cut else self._xml.close(), out)
            out.append(("end", ToolCall(self._call.name, self._xml.arguments, self._call.id, cut=cut)))
            self._xml = self._call = None
            self._buf, self._in_block = "", False
        if self._buf:
            self._text(self._buf, out)
            self._buf = ""
            self._in_block = False
        if self._pending_ws:
            out.append(("text", self._pending_ws))
            self._pending_ws = ""
        return out

    def _advance(self, out: list[Event], final: bool) -> None:
        while self._buf:
            if not self._in_block:
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = 0 if final else tag_prefix(self._buf, OPEN)
                    self._text(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                self._text(self._buf[:at], out)
                self._buf = self._buf[at:]
                self._in_block, self._whole = True, False
                self._scanned = len(OPEN)
            if not self._whole:
                if not self._streamed(out, final):
                    return
                if not self._whole:  # (a streamed call ended: the rest is the text after it)
                    continue
            end = self._block_end()
            if end < 0:
                return
            block, self._buf = self._buf[:end], self._buf[end:]
            self._in_block = False
            calls = parse_block(block[len(OPEN): -len(CLOSE)], self.tools)
            if calls is None:
                self._text(block, out)
            else:
                self._calling()
                out.extend(("call", c) for c in calls)

    def _streamed(self, out: list[Event], final: bool) -> bool:
        """An open block read as a streamed call, as far as the text goes: False while it is not yet known
        whether the block is one, or while it is one and has not ended; True when the rest of `_buf` is
        the text after it, or when the block is to be read whole."""
        if self._xml is None:
            body = self._buf[len(OPEN):].lstrip()
            opened = function_name(body) if body.startswith(XML_FUNCTION) else None
            if opened is None or not opened[0]:
                undecided = XML_FUNCTION.startswith(body) or (body.startswith(XML_FUNCTION) and opened is None)
                if undecided and not final:
                    return False
                self._whole = True
                return True
            name, at = opened
            self._calling()
            self._xml, self._call = XmlCall(name, self.tools), ToolCall(name, "")
            out.append(("begin", self._call))
            text = body[at:]
        else:
            text = self._buf
        self._buf = ""
        parts, rest = self._xml.feed(text)
        self._arguments(parts, out)
        if rest is None:
            return False
        out.append(("end", ToolCall(self._call.name, self._xml.arguments, self._call.id)))  # type: ignore[union-attr]
        self._xml = self._call = None
        self._buf, self._in_block = rest, False
        return True

    @staticmethod
    def _arguments(parts: list[str], out: list[Event]) -> None:
        if text := "".join(parts):
            out.append(("arguments", text))

    def _calling(self) -> None:
        """A call comes next: the whitespace before it is dropped, and the text after it kept apart."""
        if not self._after_call:
            self._gap = self._pending_ws
        self._pending_ws = ""
        self._after_call = True

    def _block_end(self) -> int:
        """Where the open block ends (just past its `</tool_call>`), or -1 while it has not ended."""
        while True:
            at = self._buf.find(CLOSE, self._scanned)
            if at < 0:
                self._scanned = max(self._scanned, len(self._buf) - len(CLOSE) + 1)
                return -1
            self._scanned = at + 1
            if not _inside_value(self._buf[len(OPEN): at]):
                return at + len(CLOSE)

    def _text(self, s: str, out: list[Event]) -> None:
        if self._after_call:
            body = s.lstrip()
            self._gap = self._gap or s[: len(s) - len(body)]
            if not body:
                return
            s, self._after_call = body, False
            if self._texted:  # ("a <call> b" reads "a b", not "ab")
                self._pending_ws = self._gap
        body = s.rstrip()
        if body:
            out.append(("text", self._pending_ws + body))
            self._texted = True
            self._pending_ws = s[len(body):]
        else:
            self._pending_ws += s


def parse_tool_calls(text: str, tools: list[dict[str, Any]] | None = None,
                     by_budget: bool = True) -> tuple[str, list[ToolCall]]:
    """The text outside the calls, and the calls, of a whole generation (`by_budget`: its budget ended it)."""
    parser = ToolCallParser(tools)
    events = parser.feed(text) + parser.finish(by_budget)
    return "".join(v for k, v in events if k == "text"), [v for k, v in events if k in ("call", "end")]
