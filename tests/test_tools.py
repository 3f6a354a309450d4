"""Tool calling: the parser, the prompt, and round trips through the live API with the official client.

The parser runs on outputs in the two real formats (Qwen3's JSON calls, Qwen3.5/3.6's XML calls), well
formed and not, whole and streamed in any cut. The round trips run on a copy of the tiny checkpoint whose
tokenizer spells two tokens as whole tool calls (one per format), so `logit_bias` on one of them makes the
random model call a tool; one copy keeps the plain ChatML template (tools written into the messages), the
other has a Qwen3.5-style template that renders tools, calls and results itself.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpipe.coordinator.api.chat import REQUIRED, ToolSpec, renders_tools, rooted, template_input
from mtpipe.coordinator.api.tools import ToolCallParser, parse_tool_calls
from mtpipe.node.protocol import SamplingParams

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "threshold": {"type": "number"}, "options": {"type": "object"}, "tags": {"type": "array"}},
        "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}}}}}
TOOLS = [WEATHER, SEARCH]

# -- the parser on recorded outputs ------------------------------------------------------------

# (output, content outside the calls, [(name, arguments)])
RECORDED: dict[str, tuple[str, str, list[tuple[str, dict[str, Any]]]]] = {
    "qwen3_single": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
        "", [("get_weather", {"city": "Paris", "days": 3})]),
    "qwen3_text_before_several": (
        ("I'll look both up.\n<tool_call>\n"
         '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
         '{"name": "search", "arguments": {"query": "Tokyo weather"}}\n</tool_call>'),
        "I'll look both up.", [("get_weather", {"city": "Paris"}), ("search", {"query": "Tokyo weather"})]),
    "qwen3_text_after": (
        '<tool_call>\n{"name": "search", "arguments": {"query": "mlx"}}\n</tool_call>\n\nWaiting for results.',
        "Waiting for results.", [("search", {"query": "mlx"})]),
    "qwen3_text_on_both_sides": (
        ('Let me check. <tool_call>\n{"name": "search", "arguments": {"query": "mlx"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "search", "arguments": {"query": "mtp"}}\n</tool_call> Then I will answer.'),
        "Let me check. Then I will answer.", [("search", {"query": "mlx"}), ("search", {"query": "mtp"})]),
    "qwen3_nested_and_tags_in_strings": (
        ('Writing it.\n<tool_call>\n{"name": "write_file", "arguments": {"path": "a.py", '
         '"content": "s = \\"</tool_call>\\"\\nt = \'<tool_call>\'\\n", '
         '"meta": {"tags": ["<tool_call>", "</tool_call>"], "n": {"deep": [1, 2.5, null, true]}}}}\n</tool_call>'),
        "Writing it.", [("write_file", {"path": "a.py", "content": "s = \"</tool_call>\"\nt = '<tool_call>'\n",
                                        "meta": {"tags": ["<tool_call>", "</tool_call>"],
                                                 "n": {"deep": [1, 2.5, None, True]}}})]),
    "qwen3_arguments_as_string": (
        '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}\n</tool_call>',
        "", [("search", {"query": "x"})]),
    "qwen3_malformed_json": (
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>\nDone.',
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>\nDone.', []),
    "qwen3_no_name": (
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>', []),
    "qwen3_open_quote": (  # the closing tag sits inside a string that never ends: the block never closes
        '<tool_call>\n{"name": "search, "arguments": {}}\n</tool_call> more',
        '<tool_call>\n{"name": "search, "arguments": {}}\n</tool_call> more', []),
    "qwen3_unclosed": (
        'Let me search.\n<tool_call>\n{"name": "search", "arguments": {"query": "ml',
        'Let me search.\n<tool_call>\n{"name": "search", "arguments": {"query": "ml', []),
    "qwen3_call_then_unclosed": (
        '<tool_call>\n{"name": "search", "arguments": {"query": "a"}}\n</tool_call>\n<tool_call>\n{"name": "sea',
        '<tool_call>\n{"name": "sea', [("search", {"query": "a"})]),
    "qwen35_thinking_then_call": (
        ("The user wants the weather in Paris for three days.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
        "The user wants the weather in Paris for three days.\n</think>",
        [("get_weather", {"city": "Paris", "days": 3})]),
    "qwen35_several_typed": (
        ("Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
        "<parameter=metric>\ntrue\n</parameter>\n<parameter=threshold>\n2.5\n</parameter>\n<parameter=options>\n"
        '{"hourly": {"from": 6, "to": [18, 20]}}\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n'
        "</function>\n</tool_call>\n<tool_call>\n<function=search>\n<parameter=query>\nline one\nline two\n"
        "</parameter>\n</function>\n</tool_call>"),
        "Checking.", [("get_weather", {"city": "New York", "metric": True, "threshold": 2.5,
                                       "options": {"hourly": {"from": 6, "to": [18, 20]}}, "tags": ["a", "b"]}),
                      ("search", {"query": "line one\nline two"})]),
    "qwen35_tags_in_values": (
        ("<tool_call>\n<function=search>\n<parameter=query>\nwhat does </tool_call> mean after <tool_call>?\n"
        "</parameter>\n</function>\n</tool_call>\nThat was the call."),
        "That was the call.", [("search", {"query": "what does </tool_call> mean after <tool_call>?"})]),
    "qwen35_no_function_close": (  # (a call once its function is named: `</tool_call>` closes it)
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
        "", [("get_weather", {"city": "Paris"})]),
    "qwen35_bad_integer": (  # an integer parameter that is not one: the text the model wrote
        "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>",
        "", [("get_weather", {"days": "three"})]),
    "qwen35_values_json_cannot_hold": (  # (a set, a complex number, NaN as mlx-lm reads them: the text written)
        "<tool_call>\n<function=get_weather>\n<parameter=options>\n{1, 2}\n</parameter>\n<parameter=tags>\n[1j]\n"
        "</parameter>\n<parameter=threshold>\n1\n</parameter>\n</function>\n</tool_call>",
        "", [("get_weather", {"options": "{1, 2}", "tags": "[1j]", "threshold": 1})]),
    "qwen35_nan_in_an_object": (
        "<tool_call>\n<function=get_weather>\n<parameter=options>\n{\"a\": NaN}\n</parameter>\n</function>\n"
        "</tool_call>",
        "", [("get_weather", {"options": '{"a": NaN}'})]),
    "qwen35_unclosed_parameter": (  # (cut short: its arguments as far as they came)
        "Calling.\n<tool_call>\n<function=search>\n<parameter=query>\nunfinished",
        "Calling.", [("search", '{"query": "unfinished')]),
    "qwen35_unclosed_typed": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=options>\n{\"a\": [1",
        "", [("get_weather", '{"city": "Rome", "options": {"a": [1')]),
    "qwen35_unclosed_block": (  # (its function closed: a whole call, whose `</tool_call>` did not come)
        "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</function>\n</tool",
        "", [("search", {"query": "x"})]),
    "qwen35_unclosed_python_literal": (  # (a value that cannot begin JSON: none of it, never JSON no client reads)
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=metric>\nTrue",
        "", [("get_weather", '{"city": "Rome", "metric": ')]),
    "qwen35_unclosed_python_list": (
        "<tool_call>\n<function=get_weather>\n<parameter=tags>\n['a', ", "", [("get_weather", '{"tags": ')]),
    "qwen35_unclosed_at_a_closing_tag": (  # (what may begin its `</parameter>` is no part of the value)
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</para", "", [("get_weather", '{"days": 3')]),
    "qwen35_unclosed_string_at_a_closing_tag": (
        "<tool_call>\n<function=search>\n<parameter=query>\nab\n</param", "", [("search", '{"query": "ab')]),
    "qwen35_unclosed_name": (
        "<tool_call>\n<function=get_weather>\n<parameter=ci", "", [("get_weather", "")]),
    "qwen35_null_and_empty": (
        ("<tool_call>\n<function=search>\n<parameter=query>\nNull\n</parameter>\n<parameter=other>\nnullish"
         "\n</parameter>\n<parameter=empty></parameter>\n<parameter=lines>\n\n\nx\n\n</parameter>\n</function>\n</tool_call>"),
        "", [("search", {"query": None, "other": "nullish", "empty": "", "lines": "\n\nx\n"})]),
    "qwen35_no_parameters_and_text_between": (
        "<tool_call>\n<function=search>\nstray </param text\n</function> more\n</tool_call>\nok",
        "ok", [("search", {})]),
    "qwen35_unnamed_function": (  # (no name: not a call)
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call>\n<function=>\n</function>\n</tool_call>", []),
    "qwen35_function_tag_cut": (
        "Hi <tool_call>\n<functi", "Hi <tool_call>\n<functi", []),
    "qwen35_escapes_in_a_string": (
        '<tool_call>\n<function=search>\n<parameter=query>\nsay "hi"\\ \t é ☃\n</parameter>\n</function>\n</tool_call>',
        "", [("search", {"query": 'say "hi"\\ \t é ☃'})]),
    "mixed_formats": (
        ('<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>\n<tool_call>\n<function=search>\n'
        "<parameter=query>\nx\n</parameter>\n</function>\n</tool_call>"),
        "", [("search", {}), ("search", {"query": "x"})]),
    "no_call": (
        "if a < b and c <tool", "if a < b and c <tool", []),
    "no_call_trailing_space": (
        "  text with spaces  \n", "  text with spaces  \n", []),
}


def _calls(calls: list[Any]) -> list[tuple[str, Any]]:
    """Each call's name and arguments, parsed; a call cut short keeps its arguments' text."""
    return [(c.name, c.arguments if c.cut else json.loads(c.arguments)) for c in calls]


def _partial_json_reads(arguments: str) -> None:
    """Arguments, whole or cut short, read as Anthropic's and OpenAI's clients read streamed JSON (jiter's
    partial mode): one that does not read fails a client's whole stream."""
    try:
        from jiter import from_json
    except ImportError:
        return
    if arguments:
        from_json(arguments.encode(), partial_mode=True)


def _streamed(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, Any]]]:
    """The text and calls of `text` fed in pieces; a streamed call's parts, joined, are its arguments, and its
    whole arguments are `json.dumps` of themselves (the layout the whole block parsed at once would have)."""
    parser = ToolCallParser(TOOLS)
    events = []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        events += parser.feed(text[a:b])
    events += parser.finish()
    calls, parts = [], None
    for kind, value in events:
        if kind == "begin":
            assert parts is None and value.arguments == ""
            parts, begun = [], value
        elif kind == "arguments":
            parts.append(value)
        elif kind == "end":
            assert (value.id, value.name) == (begun.id, begun.name) and "".join(parts) == value.arguments
            assert value.cut or json.dumps(json.loads(value.arguments), ensure_ascii=False) == value.arguments
            _partial_json_reads(value.arguments)
            calls.append(value)
            parts = None
        elif kind == "call":
            assert parts is None
            calls.append(value)
    assert parts is None
    return "".join(v for k, v in events if k == "text"), _calls(calls)


@pytest.mark.parametrize("name", RECORDED)
def test_parse_recorded(name: str) -> None:
    text, content, calls = RECORDED[name]
    got_content, got = parse_tool_calls(text, TOOLS)
    assert got_content == content
    assert _calls(got) == calls
    assert all(c.id.startswith("call_") and int(c.id[5:], 16) >= 0 for c in got)
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("name", RECORDED)
def test_stream_any_cut(name: str) -> None:
    text, content, calls = RECORDED[name]
    assert _streamed(text, list(range(1, len(text)))) == (content, calls)  # one character at a time
    rng = random.Random(1234)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
        assert _streamed(text, cuts) == (content, calls), cuts


XML_VALUES = {  # (parameter, a strategy of its text as a model writes it): WEATHER's types, and one it has not
    "city": st.text(st.sampled_from("ab \n\t\"\\<>/=éN"), max_size=12),
    "days": st.integers(-99, 99).map(str),
    "metric": st.sampled_from(["true", "false", "True"]),
    "threshold": st.floats(-1e3, 1e3, allow_nan=False).map(repr),
    "tags": st.lists(st.text("xy", max_size=2), max_size=3).map(json.dumps),
    "unknown": st.text(st.sampled_from("nulN \n<"), max_size=6),
}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(sorted(XML_VALUES)), min_size=0, max_size=4, unique=True).flatmap(
    lambda keys: st.tuples(st.just(keys), st.tuples(*[XML_VALUES[k] for k in keys]))), st.data())
def test_streamed_xml_calls_are_what_mlx_lms_parser_reads(params: tuple[list[str], tuple[str, ...]], data: Any) -> None:
    """A well-formed Qwen3.5 call, fed in any cut: its streamed arguments are what mlx-lm's qwen3_coder
    parser reads from the whole block, as `json.dumps` lays them out (where that parser reads it at all)."""
    from mtpipe.coordinator.api.tools import parse_block

    keys, values = params
    body = "<function=get_weather>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in zip(keys, values)) + \
        "</function>"
    text = f"<tool_call>\n{body}\n</tool_call>"
    cuts = sorted(data.draw(st.sets(st.integers(1, len(text) - 1), max_size=10)))
    content, calls = _streamed(text, cuts)
    assert content == "" and len(calls) == 1
    whole = parse_block(body, TOOLS)
    if whole is not None:  # (one whose value is not of its type is the text the model wrote, where mlx-lm's is no call)
        assert calls == _calls(whole), (text, cuts)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-999, 999) | st.text(st.sampled_from('ab{}[],:"\\ é\n'), max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text("kq{\"", max_size=3), inner, max_size=3),
    max_leaves=8)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["get_weather", "se\"arch"]), JSON_VALUES), max_size=3), st.booleans(),
       st.data())
def test_a_held_reply_streams_its_calls_as_they_come(calls: list[tuple[str, Any]], named: bool, data: Any) -> None:
    """A reply held to calls (required: a list; named: the arguments alone), as json.dumps lays it out and
    cut anywhere: each call begins once its name is whole, its parts join to its arguments, and it ends
    once they close; the text cut short ends with the open call cut."""
    from mtpipe.coordinator.api.tool_held import HeldCalls

    if named:  # (a function's arguments: an object)
        calls = [(n, p if isinstance(p, dict) else {"v": p}) for n, p in calls[:1]] or [("get_weather", {})]
        text = json.dumps(calls[0][1], ensure_ascii=False)
    else:
        text = json.dumps([{"name": n, "parameters": p} for n, p in calls], ensure_ascii=False)
    end = data.draw(st.integers(1, len(text)))  # (where the budget ended it)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, end - 1)), max_size=8)) - {end})
    held = HeldCalls(calls[0][0] if named else None)
    events = []
    for a, b in zip([0, *cuts], [*cuts, end]):
        events += held.feed(text[a:b])
    events += held.finish()
    got, parts = [], None
    for kind, value in events:
        if kind == "begin":
            assert parts is None
            parts, begun = [], value
        elif kind == "arguments":
            parts.append(value)
        else:
            assert kind == "end" and value.id == begun.id and "".join(parts) == value.arguments
            got.append(value)
            parts = None
    assert parts is None
    at_once = HeldCalls(calls[0][0] if named else None)
    assert [c.arguments for k, c in at_once.feed(text[:end]) + at_once.finish() if k == "end"] == [
        c.arguments for c in got]  # (however the text is cut)
    whole = [c for c in got if not c.cut]
    assert [(c.name, json.loads(c.arguments)) for c in whole] == [(n, p) for n, p in calls][:len(whole)]
    if end == len(text):
        assert len(whole) == len(got) == len(calls)
    else:
        assert len(got) - len(whole) <= 1 and all(not c.cut for c in got[:-1])


def test_a_call_the_budget_ends_after_its_function_closed_finishes_tool_calls() -> None:
    """Its arguments are whole: a client is told to run it ("tool_calls"), as if its `</tool_call>` had come."""
    from mtpipe.coordinator.api.deltas import CallDeltas
    from mtpipe.coordinator.api.generation import ResponseFormat
    from mtpipe.coordinator.engine.request import GenerationChunk

    for text in (RECORDED["qwen35_unclosed_block"][0], RECORDED["qwen35_unclosed_parameter"][0]):
        calls = CallDeltas(ToolCallParser(TOOLS), parallel=True)
        calls.deltas(ResponseFormat(True, "m"), GenerationChunk(text, [1], finish_reason="length"), None)
        assert calls.finish("length") == ("tool_calls" if text.endswith("</tool") else "length")


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) |
                    st.text(), lambda c: st.lists(c) | st.dictionaries(st.text(), c), max_leaves=6), st.booleans())
def test_json_cut_anywhere_begins_json_and_closes(value: Any, ascii: bool) -> None:
    from mtpipe.coordinator.api.partial_json import json_closing, json_start

    text = json.dumps(value, ensure_ascii=ascii)
    for at in range(len(text) + 1):
        assert json_start(text[:at]) and (closing := json_closing(text[:at])) is not None, text[:at]
        json.loads(text[:at] + closing)
    assert json_closing(text) == "" and not json_start("True") and json_closing("{'a'") is None


STOPPED = {  # (a stop string or token ended the text inside a Qwen3.5 call: the arguments it is closed with)
    "<tool_call>\n<function=search>\n<parameter=query>\nPar": {"query": "Par"},
    "<tool_call>\n<function=search>\n<parameter=query>\nnul": {"query": "nul"},
    "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</para": {"days": 3},
    "<tool_call>\n<function=get_weather>\n<parameter=metric>\nTrue": {"metric": True},
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=ci": {"city": "Rome"},
    "<tool_call>\n<function=search>\n</func": {},
}


@pytest.mark.parametrize("text", STOPPED)
def test_a_call_a_stop_ends_is_closed_as_its_tags_would_close_it(text: str) -> None:
    """Not the budget: the call is whole, its arguments JSON (a client's helper parses a strict tool's, and
    fails on arguments cut short), as vLLM's parser reads a call left open."""
    _, (call,) = parse_tool_calls(text, TOOLS, by_budget=False)
    assert not call.cut and call.arguments == json.dumps(STOPPED[text])
    parser = ToolCallParser(TOOLS)
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish(by_budget=False)
    assert "".join(v for k, v in events if k == "arguments") == call.arguments
    assert [(k, v.cut) for k, v in events if k == "end"] == [("end", False)]


def test_stream_releases_text_early() -> None:
    parser = ToolCallParser(TOOLS)
    assert parser.feed("Hello there <tool") == [("text", "Hello there")]  # " <tool" may begin a call
    assert parser.feed("kit") == [("text", " <toolkit")]
    assert parser.feed(" <tool_call>\n{\"name\": \"search\", \"arguments\": {}}") == []
    events = parser.feed("\n</tool_call>\n")
    assert [k for k, _ in events] == ["call"] and events[0][1].name == "search"
    assert parser.feed("after") == [("text", " after")] and parser.finish() == []  # (not "Hello thereafter")


# -- the prompt ----------------------------------------------------------------------------------

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    {"role": "tool", "content": "rain", "tool_call_id": "call_2"},
]


def test_template_input_written_in() -> None:
    """A template without tools: tools, instruction, calls and results written into the messages."""
    msgs, tools = template_input(HISTORY, ToolSpec(TOOLS, "required"), native=False)
    assert tools is None
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    system = msgs[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER) in system and system.endswith(REQUIRED)
    assert msgs[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                                  '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    assert msgs[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
    assert all(set(m) == {"role", "content"} for m in msgs)
    # "none": no tools; a named function: the instruction names it, in a system message of its own.
    msgs, _ = template_input(HISTORY[1:], ToolSpec(TOOLS, "none"), native=False)
    assert msgs[0]["role"] == "user"
    msgs, _ = template_input(HISTORY[1:2], ToolSpec(TOOLS, "function", "search"), native=False)
    assert msgs[0]["role"] == "system" and msgs[0]["content"].endswith('call the function "search".')


def test_template_input_native() -> None:
    msgs, tools = template_input(HISTORY, ToolSpec(TOOLS, "auto"), native=True)
    assert tools == TOOLS and msgs == HISTORY
    msgs, tools = template_input(HISTORY, ToolSpec(TOOLS, "none"), native=True)
    assert tools is None and msgs == HISTORY
    msgs, _ = template_input(HISTORY, ToolSpec(TOOLS, "required"), native=True)
    assert msgs[0]["content"] == "Be brief.\n\n" + REQUIRED and msgs[1:] == HISTORY[1:]


# -- checkpoints whose output the test controls ----------------------------------------------------

CALL_TEXT = {
    "json": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    "xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
           "</parameter>\n</function>\n</tool_call>",
}
CALL_ARGS = {"city": "Paris", "days": 3}

# A Qwen3.5-style template (XML calls) that renders tools, earlier calls and tool results itself.
NATIVE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}"
    "{{- '\\n' + (tool | tojson) }}{%- endfor %}{{- '\\n</tools>\\n\\nCall a function as <tool_call>\\n"
    "<function=name>\\n<parameter=p>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>' }}"
    "{%- if messages[0].role == 'system' %}{{- '\\n\\n' + messages[0].content }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}{%- if not loop.first %}{{- raise_exception('system first') }}{%- endif %}"
    "{%- elif message.role == 'user' %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + message.content }}"
    "{%- for tool_call in message.tool_calls or [] %}{%- set call = tool_call.function %}"
    "{{- '\\n<tool_call>\\n<function=' + call.name + '>\\n' }}{%- for name, value in call.arguments | items %}"
    "{{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' }}"
    "{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{%- if loop.previtem and loop.previtem.role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- raise_exception('unexpected role') }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _byte_chars() -> dict[int, str]:
    """How byte-level BPE vocabularies spell bytes (GPT-2's map)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(keep, keep)), 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = 256 + extra, extra + 1
    return {b: chr(c) for b, c in chars.items()}


def forced_checkpoint(src: Path, out: Path, template: str | None = None) -> dict[str, int]:
    """A copy of `src` whose last two BPE merges' tokens are spelled as whole tool calls: {format: token}."""
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (out / f.name).symlink_to(f)
        else:
            shutil.copy(f, out / f.name)
    tok = json.loads((src / "tokenizer.json").read_text())
    merges, vocab = tok["model"]["merges"], tok["model"]["vocab"]
    chars = _byte_chars()
    ids = {}
    for fmt, text in CALL_TEXT.items():
        a, b = merges.pop()
        assert a + b not in {part for m in merges for part in m}  # a last merge builds nothing further
        ids[fmt] = vocab.pop(a + b)
        vocab["".join(chars[x] for x in text.encode())] = ids[fmt]
    (out / "tokenizer.json").write_text(json.dumps(tok))
    if template is not None:
        config = json.loads((out / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (out / "tokenizer_config.json").write_text(json.dumps(config))
    return ids


# -- the live API ---------------------------------------------------------------------------------

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

MODEL = "tiny-tools"


class Live:
    def __init__(self, engine: Any, server: Any, ids: dict[str, int], native: bool):
        self.engine, self.server, self.ids, self.native = engine, server, ids, native
        self.client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module", params=["written", "native"])
def live(request: pytest.FixtureRequest, dense_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    import mlx.core as mx
    from test_api import LiveServer

    from mtpipe.coordinator.api.app import create_app
    from mtpipe.coordinator.engine.build import batch_engine

    native = request.param == "native"
    out = tmp_path_factory.mktemp("tools") / request.param
    ids = forced_checkpoint(dense_ckpt, out, NATIVE_TEMPLATE if native else None)
    engine = batch_engine(out, stages=1, dtype=mx.float32)
    assert renders_tools(engine.tokenizer) is native
    try:
        with LiveServer(create_app(engine, MODEL)) as server:
            yield Live(engine, server, ids, native)
    finally:
        engine.close()


def _bias(live: Live, fmt: str) -> dict[str, int]:
    if not hasattr(SamplingParams(), "logit_bias"):
        pytest.skip("the engine has no logit_bias yet: the test cannot make the tiny model call a tool")
    return {str(live.ids[fmt]): 100}


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_forced_token_spells_a_call(live: Live) -> None:
    assert live.engine.tokenizer.decode([live.ids["json"], live.ids["xml"]]) == CALL_TEXT["json"] + CALL_TEXT["xml"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fmt", ["json", "xml"])
def test_round_trip(live: Live, fmt: str, stream: bool) -> None:
    """tools -> tool_calls (finish_reason tool_calls) -> the calls and a tool message back -> an answer."""
    c = live.client
    args = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 1, "temperature": 0,
            "logit_bias": _bias(live, fmt)}
    if stream:
        chunks = list(c.chat.completions.create(**args, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
        assert {d.index for d in deltas} == {0} and (deltas[0].type, deltas[0].function.name) == ("function",
                                                                                                   "get_weather")
        assert all(d.id is None and d.function.name is None for d in deltas[1:])  # (the rest: arguments' parts)
        assert len(deltas) == 1 if fmt == "json" else len(deltas) > 1 and deltas[0].function.arguments == ""
        call_id, name = deltas[0].id, deltas[0].function.name
        arguments = "".join(d.function.arguments or "" for d in deltas)
        assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert finishes == ["tool_calls"]
    else:
        r = c.chat.completions.create(**args)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [t.type for t in choice.message.tool_calls] == ["function"]
        call_id, name, arguments = (choice.message.tool_calls[0].id, choice.message.tool_calls[0].function.name,
                                    choice.message.tool_calls[0].function.arguments)
        assert r.usage.completion_tokens == 1
    assert call_id.startswith("call_") and name == "get_weather" and json.loads(arguments) == CALL_ARGS
    messages = [*ASK,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 21, "sky": "clear"}'}]
    answer = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=6, temperature=0,
                                       logit_bias={str(live.ids[f]): -100 for f in CALL_TEXT})
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None
    assert isinstance(answer.choices[0].message.content, str)
    assert answer.usage.prompt_tokens > c.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1, temperature=0).usage.prompt_tokens


def test_parallel_none_and_logprobs(live: Live) -> None:
    c = live.client
    args = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 2, "temperature": 0,
            "logit_bias": _bias(live, "json")}
    r = c.chat.completions.create(**args)
    calls = r.choices[0].message.tool_calls
    assert [t.function.name for t in calls] == ["get_weather"] * 2 and calls[0].id != calls[1].id
    one = c.chat.completions.create(**args, parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1
    stream = list(c.chat.completions.create(**args, stream=True, logprobs=True, top_logprobs=2))
    deltas = [tc for ch in stream if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas] == [0, 1] and len({d.id for d in deltas}) == 2
    entries = [e for ch in stream if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert len(entries) == 2 and all(len(e.top_logprobs) == 2 for e in entries)
    # tool_choice "none": tools not rendered, the output is text.
    none = c.chat.completions.create(**args, tool_choice="none")
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"
    assert none.choices[0].message.content == CALL_TEXT["json"] * 2


def test_tools_rendered(live: Live) -> None:
    """Tools reach the prompt (through the template or written in); "none" leaves them out; "required" and a
    named function add an instruction; an output with no call under "required" is text."""
    c = live.client

    def prompt(**kw: Any) -> int:
        r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, temperature=0, **kw)
        return r.usage.prompt_tokens

    plain = prompt()
    with_tools = prompt(tools=TOOLS)
    assert with_tools > plain and prompt(tools=TOOLS, tool_choice="none") == plain
    assert prompt(tools=TOOLS, tool_choice="required") > with_tools
    assert prompt(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "search"}}) > with_tools
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=4,
                                  temperature=0, logit_bias={str(i): -100 for i in live.ids.values()})
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
    assert isinstance(r.choices[0].message.content, str)


def _post(live: Live, **body: Any) -> Any:
    return live.server.client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, **body})


@pytest.mark.parametrize(("tools", "where"), [
    ({"type": "function"}, "tools"),
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "retrieval", "function": {"name": "x"}}], "tools[0].type"),
    ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
     "tools[1].function.name"),
])
def test_bad_tools(live: Live, tools: Any, where: str) -> None:
    r = _post(live, messages=ASK, tools=tools)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools" and where in err["message"], err


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "search"}}}, "tool_choice", "no tools"),
    ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages", "assistant"),
])
def test_bad_tool_requests(live: Live, body: dict[str, Any], param: str, says: str) -> None:
    r = _post(live, **{"messages": ASK, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err


def test_conversations_vllm_takes_are_taken(live: Live) -> None:
    """As vLLM's server: a tool message whose call was pruned from the conversation, a call sent back
    without its id, an assistant message whose content is null without calls (a reply that was all thought)."""
    bodies = [
        [*ASK, {"role": "tool", "content": "x", "tool_call_id": "call_9"}],
        [*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
         {"role": "tool", "content": "x", "tool_call_id": "call_9"}],
        [*ASK, {"role": "assistant", "content": None}, {"role": "user", "content": "and?"}],
    ]
    for messages in bodies:
        r = _post(live, messages=messages, tools=TOOLS)
        assert r.status_code == 200, r.text


def test_bad_tool_choice_with_official_client(live: Live) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        live.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1,
                                            tool_choice={"type": "function", "function": {"name": "missing"}})
    assert e.value.status_code == 400 and e.value.body["param"] == "tool_choice"


COUNT = {"type": "function", "function": {"name": "count", "parameters": {
    "type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["days"],
    "additionalProperties": False}}}
FLAG = {"type": "function", "function": {"name": "flag", "parameters": {  # (a reference to its own definitions)
    "type": "object", "properties": {"on": {"$ref": "#/$defs/Switch"}}, "$defs": {"Switch": {"type": "boolean"}},
    "required": ["on"], "additionalProperties": False}}}


def _joined(chunks: list[Any]) -> list[tuple[int, str, str]]:
    """A stream's calls as a client joins their deltas: (index, name, arguments); a delta with an id begins
    one, and the rest add to its arguments."""
    calls: dict[int, list[str]] = {}
    for ch in chunks:
        for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            if d.id is not None:
                assert d.index not in calls and d.function.name
                calls[d.index] = [d.function.name, d.function.arguments or ""]
            else:
                assert d.function.name is None
                calls[d.index][1] += d.function.arguments or ""
    return [(i, name, arguments) for i, (name, arguments) in sorted(calls.items())]


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_required_or_named_is_held_to_the_tools(live: Live, stream: bool) -> None:
    """Where the engine holds output to a grammar, "required" and a named function get a call (vLLM's way:
    the reply is the named function's arguments, or a list of calls, as JSON), whatever the model would
    rather write; a named call finishes "stop" as OpenAI's does, a required one "tool_calls"."""
    c = live.client
    avoid = {str(i): -100 for i in live.ids.values()}  # (the tiny model's own call tokens: it is held, not biased)
    for choice, finish in (({"type": "function", "function": {"name": "count"}}, "stop"), ("required", "tool_calls")):
        args = {"model": MODEL, "messages": ASK, "tools": [FLAG, COUNT], "tool_choice": choice, "max_tokens": 48,
                "temperature": 0, "logit_bias": avoid, "parallel_tool_calls": False}
        if stream:
            chunks = list(c.chat.completions.create(**args, stream=True))
            calls = _joined(chunks)
            assert [i for i, _, _ in calls] == [0]
            assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls]) > 1  # (as they come)
            assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
                [finish]
        else:
            r = c.chat.completions.create(**args)
            assert r.choices[0].finish_reason == finish and r.choices[0].message.content is None
            calls = [(0, t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]
        assert len(calls) == 1
        _, name, arguments = calls[0]
        if choice != "required":
            assert name == "count"
        parsed = json.loads(arguments)
        if name == "count":
            assert set(parsed) == {"days"} and 1 <= parsed["days"] <= 9
        else:
            assert name == "flag" and set(parsed) == {"on"} and isinstance(parsed["on"], bool)


def test_a_held_call_its_budget_cuts_short_is_a_call_not_text(live: Live) -> None:
    """max_tokens ends a reply held to a call before it closes: no JSON as the reply's text (a client would
    show it, or send it back); a named call comes with its arguments as far as they came (as OpenAI hands
    out a call cut short), a required one's list with the calls that came whole; finish "length"."""
    avoid = {str(i): -100 for i in live.ids.values()}
    named = {"type": "function", "function": {"name": "count"}}
    for stream in (False, True):
        for choice, budget in ((named, 4), ("required", 4), ("required", 24)):
            args = {"model": MODEL, "messages": ASK, "tools": [FLAG, COUNT], "tool_choice": choice,
                    "max_tokens": budget, "temperature": 0, "logit_bias": avoid}
            if stream:
                streamed = live.client.chat.completions.create(**args, stream=True)
                streamed = list(streamed)
                chunks = [ch.choices[0] for ch in streamed if ch.choices]
                text = "".join(c.delta.content or "" for c in chunks)
                calls = [(name, arguments) for _, name, arguments in _joined(streamed)]
                finish = [c.finish_reason for c in chunks if c.finish_reason]
            else:
                r = live.client.chat.completions.create(**args).choices[0]
                text, finish = r.message.content or "", [r.finish_reason]
                calls = [(t.function.name, t.function.arguments) for t in r.message.tool_calls or []]
            assert text == "" and finish == ["length"], (choice, budget, text)
            if choice is named:
                assert calls and calls[0][0] == "count" and calls[0][1] and not calls[0][1].endswith("}")
            else:
                assert all(n in ("flag", "count") for n, _ in calls) and (calls or budget < 24), calls


def test_a_named_call_a_stop_string_ends_is_closed_whole_or_streamed(live: Live) -> None:
    """A stop string inside a named call's held arguments: closed, the same call whole and streamed (a
    stream that handed out the arguments it held cannot take them back), which the client's stream helper
    parses for a strict tool (it raised on arguments cut short); finish "stop" as a named call's."""
    count = {"type": "function", "function": {**COUNT["function"], "strict": True}}
    args = {"model": MODEL, "messages": ASK, "tools": [count], "tool_choice": {"type": "function", "function": {
        "name": "count"}}, "max_tokens": 48, "temperature": 0, "stop": ["}"],
            "logit_bias": {str(i): -100 for i in live.ids.values()}}
    whole = live.client.chat.completions.create(**args).choices[0]
    with live.client.chat.completions.stream(**args) as s:
        streamed = s.get_final_completion().choices[0]
    for choice in (whole, streamed):
        assert choice.finish_reason == "stop" and not choice.message.content, choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "count" and set(json.loads(call.function.arguments)) == {"days"}
    assert streamed.message.tool_calls[0].function.parsed_arguments == json.loads(
        whole.message.tool_calls[0].function.arguments)


def test_an_echo_is_no_part_of_a_call(live: Live) -> None:
    """vLLM's chat echo before a held call: the call is what it is without the echo, whose text is the
    reply's content (as vLLM prepends it after the call is parsed), whole or streamed."""
    args = {"model": MODEL, "messages": [*ASK, {"role": "assistant", "content": "Hi "}], "tools": [FLAG, COUNT],
            "tool_choice": {"type": "function", "function": {"name": "count"}}, "max_tokens": 48, "temperature": 0,
            "logit_bias": {str(i): -100 for i in live.ids.values()}}
    going_on = {"continue_final_message": True, "add_generation_prompt": False}
    plain = live.client.chat.completions.create(**args, extra_body=going_on).choices[0].message
    echoed = live.client.chat.completions.create(**args, extra_body={**going_on, "echo": True}).choices[0].message
    assert plain.tool_calls and plain.content is None
    assert [c.function.arguments for c in echoed.tool_calls] == [c.function.arguments for c in plain.tool_calls]
    assert echoed.content == "Hi "
    chunks = list(live.client.chat.completions.create(**args, stream=True, extra_body={**going_on, "echo": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Hi "
    assert "".join(tc.function.arguments or "" for ch in chunks if ch.choices
                   for tc in ch.choices[0].delta.tool_calls or []) == plain.tool_calls[0].function.arguments


TREE = {"type": "function", "function": {"name": "tree", "parameters": {  # (references to its own root)
    "type": "object", "additionalProperties": False, "required": ["label", "children", "alias"],
    "properties": {"label": {"type": "string", "maxLength": 3}, "alias": {"$ref": "#/properties/label"},
                   "children": {"type": "array", "minItems": 1, "maxItems": 1,
                                "items": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"$ref": "#"}]}}}}}}


def a_tree(value: Any, depth: int = 0) -> bool:
    """Whether `value` is an instance of TREE's parameters (at most a few levels deep)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return 0 <= value <= 9
    return (depth < 8 and isinstance(value, dict) and set(value) == {"label", "children", "alias"}
            and all(isinstance(value[k], str) and len(value[k]) <= 3 for k in ("label", "alias"))
            and isinstance(value["children"], list) and len(value["children"]) == 1
            and a_tree(value["children"][0], depth + 1))


def test_references_to_a_tools_own_root_hold_when_a_call_is_required(live: Live) -> None:
    """"required" holds the reply to a list of calls, each tool's parameters under the list's `$defs`: a
    tool's references to its own root (`#`, `#/properties/...`) are pointed there, never at the list."""
    assert rooted({"$ref": "#", "properties": {"default": {"$ref": "#/properties/x"}}, "default": {"$ref": "#"},
                   "items": [{"$ref": "#/$defs/a"}, {"$ref": "other.json#/a"}, {"$ref": "#anchor"}]}, "#/$defs/tool0") == {
        "$ref": "#/$defs/tool0", "properties": {"default": {"$ref": "#/$defs/tool0/properties/x"}},
        "default": {"$ref": "#"},
        "items": [{"$ref": "#/$defs/tool0/$defs/a"}, {"$ref": "other.json#/a"}, {"$ref": "#anchor"}]}
    avoid = {str(i): -100 for i in live.ids.values()}
    trees = 0
    for seed in range(3):
        r = live.client.chat.completions.create(model=MODEL, messages=ASK, tools=[TREE], tool_choice="required",
                                                max_tokens=96, temperature=1.0, seed=seed, logit_bias=avoid)
        if r.choices[0].finish_reason == "length":  # (a deep tree cut short: no call parses)
            continue
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls and calls[0].function.name == "tree", r.choices[0]
        trees += all(a_tree(json.loads(c.function.arguments)) for c in calls)
        assert trees, calls
    assert trees


def test_parameters_llguidance_cannot_hold_strictly_hold_leniently_and_ones_no_call_fits_are_refused(live: Live) -> None:
    """A required call whose parameters use what the grammar does not implement (`not`) is still held to a
    call, those words left out; parameters no call could fit, or no JSON Schema at all, are a 400 before
    any round (never a reply that only the prompt asked to call)."""
    avoid = {str(i): -100 for i in live.ids.values()}
    negated = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9, "not": {"const": 3}}},
        "required": ["n"], "additionalProperties": False}}}
    r = live.client.chat.completions.create(model=MODEL, messages=ASK, tools=[negated], tool_choice="required",
                                            max_tokens=64, temperature=0, logit_bias=avoid, parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls and calls[0].function.name == "pick", r.choices[0]
    assert set(json.loads(calls[0].function.arguments)) == {"n"}
    for parameters in ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 3}},
                        "required": ["n"]},
                       {"type": "object", "properties": {"n": {"type": "nonsense"}}}):
        tool = {"type": "function", "function": {"name": "pick", "parameters": parameters}}
        for choice in ("required", {"type": "function", "function": {"name": "pick"}}):
            resp = _post(live, messages=ASK, tools=[tool], tool_choice=choice, max_tokens=4)
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["param"] == "tool_choice" and "no call to the tools could fit" in err["message"], err


def test_a_call_a_stop_string_ends_is_whole_to_the_official_clients_helpers(live: Live) -> None:
    """A stop string inside a Qwen3.5 call ends it as its tags would: the clients' stream helpers parse a
    strict tool's arguments (and raised on ones cut short); finish "tool_calls", a completed response,
    Anthropic's "tool_use" with the call's input."""
    anthropic = pytest.importorskip("anthropic")
    bias, stop = _bias(live, "xml"), ["\n</parameter>\n<parameter=days>"]
    fn = {**WEATHER["function"], "strict": True}
    args = {"model": MODEL, "messages": ASK, "tools": [{"type": "function", "function": fn}], "max_tokens": 1,
            "temperature": 0, "logit_bias": bias, "stop": stop}
    with live.client.chat.completions.stream(**args) as s:
        final = s.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [t.function.parsed_arguments for t in final.message.tool_calls] == [{"city": "Paris"}]
    whole = live.client.chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "tool_calls" and json.loads(whole.message.tool_calls[0].function.arguments) == {
        "city": "Paris"}
    with live.client.responses.stream(model=MODEL, input=ASK[0]["content"], tools=[{"type": "function", **fn}],
                                      max_output_tokens=1, temperature=0,
                                      extra_body={"logit_bias": bias, "stop": stop}) as s:
        response = s.get_final_response()
    assert [(o.type, o.status, o.parsed_arguments) for o in response.output] == [
        ("function_call", "completed", {"city": "Paris"})]
    claude = anthropic.Anthropic(base_url=live.server.url, api_key="unused", max_retries=0, timeout=60)
    with claude.messages.stream(model=MODEL, messages=ASK, max_tokens=1, stop_sequences=stop,
                                tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
                                extra_body={"logit_bias": bias, "temperature": 0}) as s:
        message = s.get_final_message()
    assert message.stop_reason == "tool_use" and [b.input for b in message.content] == [{"city": "Paris"}]


def test_a_streamed_call_comes_in_parts_to_responses_and_messages_clients(live: Live) -> None:
    """An XML call streams into a Responses function_call item (added in progress, its arguments' deltas,
    done) and an Anthropic tool_use block (its input as input_json_delta parts); the whole response each
    builds from its stream holds the same call."""
    bias = _bias(live, "xml")
    body = {"model": MODEL, "input": ASK[0]["content"], "tools": [{"type": "function", **WEATHER["function"]}],
            "max_output_tokens": 1, "temperature": 0, "logit_bias": bias}
    events = []
    with httpx.stream("POST", live.server.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events if "function_call" in e["type"] or e["type"].startswith("response.output_item")]
    assert kinds[0] == "response.output_item.added" and events[[e["type"] for e in events].index(kinds[0])][
        "item"]["status"] == "in_progress"
    parts = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert parts and "".join(parts) == done["arguments"] and json.loads(done["arguments"]) == CALL_ARGS
    (item,) = events[-1]["response"]["output"]
    assert item["type"] == "function_call" and item["status"] == "completed" and item["arguments"] == done["arguments"]
    whole = httpx.post(live.server.url + "/v1/responses", json=body, timeout=60).json()
    assert [(o["type"], o["name"], json.loads(o["arguments"])) for o in whole["output"]] == [
        ("function_call", "get_weather", CALL_ARGS)]

    claude = {"model": MODEL, "max_tokens": 1, "temperature": 0, "logit_bias": bias, "messages": ASK,
              "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]}
    with httpx.stream("POST", live.server.url + "/v1/messages", json={**claude, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    (start,) = [e for e in events if e["type"] == "content_block_start"]
    assert start["content_block"] == {"type": "tool_use", "id": start["content_block"]["id"], "name": "get_weather",
                                      "input": {}}
    parts = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert parts and json.loads("".join(parts)) == CALL_ARGS
    assert [e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta"] == ["tool_use"]
    whole = httpx.post(live.server.url + "/v1/messages", json=claude, timeout=60).json()
    assert whole["stop_reason"] == "tool_use" and [(b["type"], b["input"]) for b in whole["content"]] == [
        ("tool_use", CALL_ARGS)]


def test_a_held_call_a_stop_string_ends_is_closed_whole_or_streamed() -> None:
    """(A list of calls too, as a named call's arguments: the same closing, streamed or whole.)"""
    from mtpipe.coordinator.api.responses import _calls
    from mtpipe.coordinator.api.tool_held import HeldCalls

    text = '[{"name": "get_weather", "parameters": {"city": "Par'
    held = HeldCalls(None)
    events = held.feed(text) + held.finish(by_budget=False)
    (end,) = [v for k, v in events if k == "end"]
    assert not end.cut and json.loads(end.arguments) == {"city": "Par"}
    assert "".join(v for k, v in events if k == "arguments") == end.arguments
    required = ToolSpec(TOOLS, "required", parallel=True, held=True)
    content, calls, finish = _calls(text, "stop", required)
    assert (content, [c["function"]["arguments"] for c in calls], finish) == ("", [end.arguments], "tool_calls")
    content, calls, finish = _calls(text, "length", required)  # (the budget: as far as it came)
    assert calls[0]["function"]["arguments"] == '{"city": "Par' and finish == "length"


def test_a_held_calls_arguments_begin_past_the_space_before_them() -> None:
    """(Cut just before that space, the streamed arguments began with it where the whole text's did not.)"""
    from mtpipe.coordinator.api.tool_held import HeldCalls

    held = HeldCalls(None)
    events = [e for piece in ('[{"name": "get_weather", "parameters":', " ", '{"city": "Paris"}}]') for e in
              held.feed(piece)] + held.finish()
    assert [v.arguments for k, v in events if k == "end"] == ['{"city": "Paris"}']
    assert "".join(v for k, v in events if k == "arguments") == '{"city": "Paris"}'


def test_a_pattern_llguidance_cannot_read_is_left_out_of_a_held_call_as_its_unimplemented_words_are() -> None:
    """(A look-around in a `pattern`, as validators often write, made a required or named call a 400 saying
    that no call could fit, where "y" fits.) The patterns it reads stay, and so does data that looks like one."""
    from mtpipe.coordinator.api.chat import ToolSpec
    from mtpipe.coordinator.api.formats import held_call

    parameters = {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "^(?!x)"}, "b": {"type": "string", "pattern": "^[a-z]+$"},
        "pattern": {"const": {"pattern": "(?!x)"}}}, "required": ["a"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    for spec in (ToolSpec(tools, "required", held=True), ToolSpec(tools, "function", "f", held=True)):
        fmt = held_call(spec)
        assert not fmt.problem()
        held = fmt.schema if spec.choice == "function" else fmt.schema["$defs"]["tool0"]
        assert held["properties"] == {"a": {"type": "string"}, "b": parameters["properties"]["b"],
                                      "pattern": {"const": {"pattern": "(?!x)"}}}
