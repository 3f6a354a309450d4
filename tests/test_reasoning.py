"""A reasoning model's reply split into thinking and answer (coordinator/api/reasoning.py)."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mtpipe.coordinator.api.reasoning import PROMPT_TAIL, ReasoningSplit, reasoning_split

START, END = "<think>", "</think>"


def whole(text: str, opened: bool) -> tuple[str, str]:
    """The split of a whole reply, written plainly: what any cutting of it into chunks must give."""
    if not opened:
        lead = text.lstrip()
        if not lead.startswith(START):
            return "", text
        text = lead[len(START):]
    at = text.find(END)
    if at < 0:
        return text, ""
    return text[:at], text[at + len(END):].lstrip("\r\n")


def streamed(pieces: list[str], opened: bool) -> tuple[str, str]:
    split = ReasoningSplit(START, END, thinking=opened, answered=opened)
    out = [split.feed(p) for p in pieces] + [split.feed("", final=True)]
    return "".join(t for t, _ in out), "".join(a for _, a in out)


def test_a_thought_the_prompt_opened_ends_at_the_closing_tag() -> None:
    assert streamed(["The user", " asks.</th", "ink>\n\n", "Paris."], opened=True) == ("The user asks.", "Paris.")
    assert streamed(["cut off while", " thinking </thi"], opened=True) == ("cut off while thinking </thi", "")


def test_a_reply_may_open_its_thought_itself_but_only_first() -> None:
    assert streamed(["\n<th", "ink>\nhm", "m</think>\n\nYes"], opened=False) == ("\nhmm", "Yes")
    assert streamed(["Hi <think>x</think>"], opened=False) == ("", "Hi <think>x</think>")
    assert streamed(["  ", "<", "b>"], opened=False) == ("", "  <b>")
    assert streamed(["no tags at all"], opened=False) == ("", "no tags at all")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "\n", " ", "a", "b\n"]), max_size=12),
       st.booleans(), st.data())
def test_any_cutting_of_a_reply_splits_as_the_whole_does(parts: list[str], opened: bool, data: st.DataObject) -> None:
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert streamed(pieces, opened) == whole(text, opened)


def test_the_prompt_says_whether_the_reply_begins_inside_a_thought() -> None:
    pieces = {7: START, 8: END, 3: "\n"}
    tokenizer = SimpleNamespace(
        has_thinking=True, think_start=START, think_end=END, think_start_tokens=(7,),
        rfind_think_start=lambda t, start=None: TokenizerWrapper._find(t, (7,), start=start, reverse=True),
        rfind_think_end=lambda t, start=None: TokenizerWrapper._find(t, (8,), start=start, reverse=True),
        decode=lambda ids: "".join(pieces.get(i, "w") for i in ids))
    assert reasoning_split(tokenizer, [1, 2, 7, 3]).thinking  # a template that opens the thought
    assert not reasoning_split(tokenizer, [1, 7, 3, 8, 4]).thinking  # one that closed it (thinking off)
    assert not reasoning_split(tokenizer, [1, 7, 5, 6, 3]).thinking  # the tag written in a message
    assert not reasoning_split(tokenizer, [7] + [1] * PROMPT_TAIL).thinking  # (only the prompt's tail is read)
    assert not reasoning_split(tokenizer, [1, 2], shown=False).shown
    assert reasoning_split(SimpleNamespace(has_thinking=False), [7]) is None
