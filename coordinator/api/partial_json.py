"""JSON cut short: whether a text can begin JSON, and what closes it.

A call's arguments may end before their JSON does: the budget ends them (they go out as they came, and a
client's partial-JSON reader, as Anthropic's stream accumulator, must read them), or a stop string does
(a reply held to a named call's arguments: they are closed, so a client that parses them can).
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

# a number or a word cut short, where a value may begin
PARTIAL_TOKEN = re.compile(
    r"(^|[\[:,])\s*(?:-?(?:\d+\.|\d+(?:\.\d+)?[eE][+-]?)?|t(?:ru?)?|f(?:a(?:ls?)?)?|n(?:ul?)?)\Z")
ESCAPES = ("", "n", "0", "00", "000", "0000")  # what finishes an escape cut short (`\`, `\u`...)
ENDS = ("", '"', '": null', ": null", '"": null', "null", "0", "rue", "ue", "e", "alse", "lse", "se", "ull", "ll", "l")


def json_start(text: str) -> bool:
    """Whether `text` is the start of some JSON value (JSON cut short, as a partial-JSON reader takes it)."""
    in_string, escape, i = False, -1, 0  # (escape: where the last escape in a string began)
    while i < len(text):
        if in_string and text[i] == "\\":
            escape, i = i, i + 2
            continue
        in_string ^= text[i] == '"'
        i += 1
    if in_string:  # (its string closed, an escape cut short left out)
        cut_escape = escape >= 0 and (escape == len(text) - 1 or text[escape + 1] == "u" and len(text) - escape < 6)
        text = (text[:escape] if cut_escape else text) + '"'
    else:  # (a number or a word cut short left out)
        text = PARTIAL_TOKEN.sub(r"\1", text)
    try:
        json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        return e.pos == len(text)  # (only the end was missing)
    except (ValueError, RecursionError):
        return False
    return True


def json_closing(text: str) -> str | None:
    """What, added to JSON `text` cut short, makes it whole: its string, word or number finished, a key or
    value it waits for given as null, its open arrays and objects closed ("" where it is whole; None
    where no end makes it JSON)."""
    if not json_start(text):
        return None
    in_string, opened, i = False, [], 0
    while i < len(text):
        ch = text[i]
        if in_string and ch == "\\":
            i += 2
            continue
        if ch == '"':
            in_string = not in_string
        elif not in_string and ch in "[{":
            opened.append("]" if ch == "[" else "}")
        elif not in_string and ch in "]}" and opened:
            opened.pop()
        i += 1
    closers = "".join(reversed(opened))
    for escape, end in itertools.product(ESCAPES, ENDS):
        try:
            json.loads(text + escape + end + closers, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            continue
        return escape + end + closers
    return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
