"""A reply held to a call (tool_choice "required" or a named function, chat.py `ToolSpec.call_schema`), read
as it streams, as ToolCallParser's events (tools.py): each call's id and name once its name is whole, its
arguments part by part as they come, its end once they close.

The grammar lays the reply out as `json.dumps` would: a named function's reply is its arguments; a
required one's is a list `[{"name": ..., "parameters": ...}, ...]`, whose parameters are a call's
arguments. Nothing else is in it, so a call's arguments end where their JSON value does.
"""

from __future__ import annotations

import json
import re

from .partial_json import json_closing
from .tools import Event, ToolCall

CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')  # (its arguments follow)


class HeldCalls:
    def __init__(self, name: str | None):
        self.name = name  # the named function's (None: a list of calls)
        self._text = ""
        self._at = 0  # where the next call's head may begin (past the last call)
        self._call: ToolCall | None = None  # the call whose arguments are streaming
        self._from = 0  # where its arguments begin
        self._sent = 0  # how far they were handed out
        self._depth, self._in_string, self._escaped = 0, False, False

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._text += text
        if self.name is not None:  # (the whole reply is the call's arguments)
            if self._call is None and text:
                self._call = ToolCall(self.name, "")
                out.append(("begin", self._call))
            if text:
                out.append(("arguments", text))
            return out
        while True:
            if self._call is None:
                head = CALL_HEAD.search(self._text, self._at)
                if head is None or head.end() == len(self._text):  # (the space before its arguments may go on)
                    return out
                self._call = ToolCall(json.loads(head.group(1)), "")
                self._from = self._sent = head.end()
                self._depth, self._in_string, self._escaped = 0, False, False
                out.append(("begin", self._call))
            end = self._value_end()
            upto = len(self._text) if end < 0 else end
            if upto > self._sent:
                out.append(("arguments", self._text[self._sent:upto]))
                self._sent = upto
            if end < 0:
                return out
            out.append(("end", ToolCall(self._call.name, self._text[self._from:end], self._call.id)))
            self._call, self._at = None, end

    def finish(self, by_budget: bool = True) -> list[Event]:
        """The reply ended: a call still open is cut short where the budget (`by_budget`) ended it, its
        arguments as far as they came; where a stop string did, they are closed (partial_json.py), so
        that a client that parses them (a strict tool's) can."""
        if self._call is None:
            return []
        out: list[Event] = []
        arguments = self._text if self.name is not None else self._text[self._from:]
        closing = json_closing(arguments)  # ("": whole; None: nothing closes it)
        if not by_budget and closing:
            out.append(("arguments", closing))
            arguments, closing = arguments + closing, ""
        out.append(("end", ToolCall(self._call.name, arguments, self._call.id, cut=closing != "")))
        self._call = None
        return out

    def _value_end(self) -> int:
        """Where the open call's arguments (one JSON value) end in the text so far, or -1 while they go on."""
        depth, in_string, escaped = self._depth, self._in_string, self._escaped
        for i in range(self._sent, len(self._text)):
            ch = self._text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
                    if depth == 0:
                        return i + 1
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                if depth == 0:  # (a number or a word, ended by its call's close)
                    return i
                depth -= 1
                if depth == 0:
                    return i + 1
            elif ch == "," and depth == 0:
                return i
        self._depth, self._in_string, self._escaped = depth, in_string, escaped
        return -1
