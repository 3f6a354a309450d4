"""A Qwen3.5 / 3.6 tool call (the XML form, tools.py) read as it streams: its arguments as JSON, part by part.

Once `<function=NAME>` is read the block is a call, whatever follows (as vLLM's parser streams it): each
`<parameter=KEY>` adds `"KEY": ` to the arguments at once, a string value (the tool's schema says so, or
names no such parameter) then streams as its characters come, and any other value (a number, an object)
comes whole once its `</parameter>` is read, typed as mlx-lm's qwen3_coder parser types it; one that does
not parse as its type, or reads as what JSON cannot hold (a Python set, NaN), is the string the model wrote.
`</function>` (or `</tool_call>`) closes them. The JSON is `json.dumps` of the arguments however the text is
cut: the same as the whole block parsed at once.
"""

from __future__ import annotations

import json
from typing import Any

from .partial_json import json_start

CLOSE = "</tool_call>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
FUNCTION_END = "</function>"
NAME_END = " \t\n\r\f\v<>"  # what ends a function's or a parameter's name (mlx-lm's `[^\s<>]+`)
STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}  # (qwen3_coder's, whose values stay text)


def function_name(body: str) -> tuple[str, int] | None:
    """The name of the function a block's body (after `<tool_call>`, its leading space gone) opens, and
    where its parameters begin; None while the name may still go on."""
    at = len("<function=")
    while at < len(body) and body[at] in " \t\n\r\f\v":
        at += 1
    end = at
    while end < len(body) and body[end] not in NAME_END:
        end += 1
    if end == len(body):
        return None
    return body[at:end], end + (body[end] == ">")


def _escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def tag_prefix(text: str, *tags: str) -> int:
    """The length of the longest end of `text` that one of `tags` begins with (short of a whole tag): what
    must be held back while the next text may complete the tag."""
    best = 0
    for tag in tags:
        for n in range(min(len(text), len(tag) - 1), best, -1):
            if tag.startswith(text[-n:]):
                best = n
                break
    return best


class XmlCall:
    """One call's body after `<function=NAME>`: `feed` hands out the arguments' JSON as it is decided."""

    def __init__(self, name: str, tools: list[dict[str, Any]] | None):
        self.name, self.tools = name, tools
        self.properties = _properties(name, tools)
        self.arguments = ""  # handed out so far
        self._buf = ""
        self._state = "between"  # between parameters | in a parameter's name | in its value | after </function>
        self._key = ""
        self._streams = False  # the value is a string, handed out as it comes
        self._value = ""  # the value so far (its first line break gone); what of it is not handed out yet
        self._started = False  # the value's first character was read (a line break there is dropped)
        self._opened = False  # its opening quote was handed out
        self._keys = 0

    def feed(self, text: str) -> tuple[list[str], str | None]:
        """The arguments' parts `text` decides, and the text after the block's `</tool_call>` (None: not yet)."""
        self._buf += text
        out: list[str] = []
        readers = {"between": self._between, "name": self._name, "value": self._read_value, "after": self._after}
        while True:
            before = (self._state, len(self._buf))
            rest = readers[self._state](out)
            if rest is not None or (self._state, len(self._buf)) == before:
                self.arguments += "".join(out)
                return out, rest

    @property
    def open(self) -> bool:
        """Whether its arguments are not whole yet (its `</function>` did not come)."""
        return self._state != "after"

    def cut(self) -> list[str]:
        """The text ended inside the call: what came of the value it was in, as it came, but what may begin its
        closing tag (held back); of a value that is not a string, only as far as it may begin JSON (a
        client's partial-JSON reader, as Anthropic's stream accumulator, fails on `True` or `['a'`)."""
        out: list[str] = []
        if self._state == "value" and self._key:
            value = self._value
            if self._streams:
                out.append(("" if self._opened else '"') + _escaped(value))
            elif json_start(value):
                out.append(value)
        self._buf = self._value = ""
        self.arguments += "".join(out)
        return out

    def close(self) -> list[str]:
        """The text ended inside the call for good (a stop string or token, not the budget): the rest of its
        arguments as its closing tags would bring them (as vLLM's parser reads a call left open), whole
        JSON; a name or a tag it was cut inside is left out."""
        self._buf = ""
        if self._state == "name":
            self._state = "between"
        tags = {"value": PARAMETER_END + FUNCTION_END, "between": FUNCTION_END}.get(self._state, "")
        return self.feed(tags + CLOSE)[0]

    # -- the states: each reads what it can of `_buf` ---------------------------------------------

    def _between(self, out: list[str]) -> str | None:
        found = [(at, tag) for tag in (PARAMETER, FUNCTION_END, CLOSE) if (at := self._buf.find(tag)) >= 0]
        if not found:  # (text between parameters is no part of the call)
            self._buf = self._buf[len(self._buf) - tag_prefix(self._buf, PARAMETER, FUNCTION_END, CLOSE):]
            return None
        at, tag = min(found)
        self._buf = self._buf[at + len(tag):]
        if tag == PARAMETER:
            self._state = "name"
            return None
        out.append("{}" if self._keys == 0 else "}")
        if tag == CLOSE:
            return self._buf
        self._state = "after"
        return None

    def _name(self, out: list[str]) -> str | None:
        body = self._buf.lstrip()
        end = next((i for i, ch in enumerate(body) if ch in NAME_END), -1)
        if end < 0:
            return None
        self._key = body[:end]
        self._buf = body[end + (body[end] == ">"):]
        self._state, self._value, self._started, self._opened = "value", "", False, False
        spec = self.properties.get(self._key)
        kind = str(spec.get("type", "")).strip().lower() if isinstance(spec, dict) else ""
        self._streams = not spec or kind in STRING_TYPES
        if self._key:  # (a parameter without a name is skipped, as mlx-lm's parser skips it)
            self._keys += 1
            out.append(("{" if self._keys == 1 else ", ") + json.dumps(self._key, ensure_ascii=False) + ": ")
        return None

    def _read_value(self, out: list[str]) -> str | None:
        """A value ends at the first `</parameter>` (a `</tool_call>` before it is text of the value); one
        line break at each end of it is no part of it."""
        if not self._started and self._buf:
            self._started = True
            self._buf = self._buf[1:] if self._buf[0] == "\n" else self._buf
        at = self._buf.find(PARAMETER_END)
        if at < 0:
            keep = tag_prefix(self._buf, "\n" + PARAMETER_END, PARAMETER_END)
            self._value += self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep:]
            if self._streams and self._key:
                self._stream(out)
            return None
        value = self._value + self._buf[:at]
        self._buf, self._state = self._buf[at + len(PARAMETER_END):], "between"
        value = value[:-1] if value.endswith("\n") else value
        if self._key:
            out.append(self._finished(value))
        return None

    def _stream(self, out: list[str]) -> None:
        """A string value's text so far, once it cannot be the word null (which mlx-lm's parser reads as null)."""
        if not self._opened and "null".startswith(self._value.lower()):
            return
        if self._value:
            out.append(("" if self._opened else '"') + _escaped(self._value))
            self._opened, self._value = True, ""

    def _finished(self, value: str) -> str:
        """The rest of a value's JSON once its whole text is known (`value`: what was not handed out)."""
        if self._opened:
            return _escaped(value) + '"'
        if not self._streams:
            try:  # (what ast.literal_eval reads that JSON cannot hold, a set or NaN, is the text the model wrote)
                return json.dumps(self._typed(value), ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError, RecursionError):
                return json.dumps(value, ensure_ascii=False)
        return "null" if value.lower() == "null" else json.dumps(value, ensure_ascii=False)

    def _typed(self, value: str) -> Any:
        """A value as mlx-lm's qwen3_coder parser types it by the tool's schema; the text, where it does not parse."""
        from mlx_lm.tool_parsers import qwen3_coder

        xml = f"<function={self.name}>\n<parameter={self._key}>\n{value}\n</parameter>\n</function>"
        try:
            return qwen3_coder.parse_tool_call(xml, self.tools)["arguments"][self._key]
        except Exception:  # noqa: BLE001 - a value the model wrote that is not of its type stays its text
            return value

    def _after(self, out: list[str]) -> str | None:
        at = self._buf.find(CLOSE)
        if at < 0:
            self._buf = self._buf[len(self._buf) - tag_prefix(self._buf, CLOSE):]
            return None
        return self._buf[at + len(CLOSE):]


def _properties(name: str, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The named tool's parameters' schemas (as qwen3_coder reads them: none when it names no such tool)."""
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            params = function.get("parameters") or {}
            return params.get("properties") or {} if isinstance(params, dict) else {}
    return {}
