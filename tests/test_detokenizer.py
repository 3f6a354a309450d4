"""TextStream on the demo model's tokenizer: streamed text is exactly `decode`, cut at stop strings."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from mtpipe.coordinator.engine.build import load_tokenizer
from mtpipe.coordinator.engine.detokenizer import TextStream
from mtpipe.coordinator.engine.request import GenerationRequest, take_tokens
from mtpipe.models.config import load_config
from mtpipe.models.registry import DEMO_MODEL

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    " leading space",
    "  two leading spaces",
    "trailing space ",
    " ",
    "x = '中文' + '😀'  # 日本語 ünïcödé\n",
    "emoji at the end 🎉",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEMO_MODEL, load_config(DEMO_MODEL).eos_token_ids)


def stream(tok, tokens: list[int], stop: list[str] = ()) -> tuple[list[str], TextStream, int]:
    """As the engine drives it: one release per token until a stop, then the final release.

    Returns the released chunks (the last one from the final release), the stream, and how many
    tokens were added."""
    text = TextStream(tok, list(stop))
    chunks, n = [], 0
    for t in tokens:
        text.add(t)
        n += 1
        if text.stopped:
            break
        chunks.append(text.release(final=False))
    chunks.append(text.release(final=True))
    return chunks, text, n


def test_demo_tokenizer_uses_the_bpe_detokenizer(tok) -> None:
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

    assert isinstance(TextStream(tok, []).detokenizer, BPEStreamingDetokenizer)


@pytest.mark.parametrize("s", TEXTS)
def test_streamed_text_is_decode(tok, s: str) -> None:
    ids = tok.encode(s)
    chunks, text, _ = stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids) == s
    assert not text.stopped


def test_multibyte_characters_split_across_tokens(tok) -> None:
    s = "中文😀"
    ids = tok.encode(s)
    # The vocabulary has no token for these: each character is spread over byte tokens.
    assert len(ids) > len(s) and all(tok.decode([i]) == "\ufffd" for i in ids)
    chunks, _, _ = stream(tok, ids)
    assert "".join(chunks) == s
    assert all("\ufffd" not in c for c in chunks)  # no half character is ever released
    assert [c for c in chunks if c] == ["中", "文", "😀"]  # each as soon as it is complete


def test_random_token_sequences_are_decode(tok) -> None:
    # Random ids give invalid and truncated UTF-8, lone spaces and specials mid-text, the byte 0 too.
    vocab = list(range(len(tok)))
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.choice(vocab) for _ in range(rng.randint(1, 40))]
        chunks, _, _ = stream(tok, ids)
        assert "".join(chunks) == tok.decode(ids), ids


def test_nul_byte(tok) -> None:
    """(mlx-lm's BPE detokenizer alone gives "aĀb": it takes the byte 0 for none.)"""
    ids = tok.encode("a\x00b")
    assert "".join(stream(tok, ids)[0]) == "a\x00b"


@pytest.mark.parametrize("s", ["ok 😀", "中", "x é"])
def test_incomplete_utf8_at_the_end_is_flushed(tok, s: str) -> None:
    ids = tok.encode(s)[:-1]  # the last character's final byte never comes
    expected = tok.decode(ids)
    assert expected.endswith("\ufffd")
    chunks, _, _ = stream(tok, ids)
    assert "\ufffd" not in "".join(chunks[:-1])  # held back while generating
    assert "".join(chunks) == expected


def test_lone_byte_token_at_the_end_is_flushed(tok) -> None:
    # A single token whose own text ends in U+FFFD (the lead byte of a 3-byte character).
    lead = tok.encode("中")[0]
    ids = tok.encode("abc") + [lead]
    assert tok.decode([lead]) == "\ufffd"
    assert "".join(stream(tok, ids)[0]) == "abc\ufffd"


def _boundaries(tok, ids: list[int]) -> list[int]:
    """Character offsets in decode(ids) where a token ends (for text whose tokens are whole chars)."""
    return [len(tok.decode(ids[:k])) for k in range(1, len(ids))]


def test_stop_string_across_tokens_cuts_exactly(tok) -> None:
    s = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n"
    ids = tok.encode(s)
    spanning = 0
    for b in _boundaries(tok, ids):
        stop = s[max(0, b - 2) : b + 2]
        if any(stop in tok.decode([i]) for i in ids):
            continue
        spanning += 1
        chunks, text, n = stream(tok, ids, [stop])
        assert "".join(chunks) == s[: s.index(stop)] and text.stopped
        # Stopped at the token that completed the stop string, not later (also when that is a lone
        # space token, which the detokenizer holds back: below).
        end = s.index(stop) + len(stop)
        c = next(k for k in range(1, len(ids) + 1) if len(tok.decode(ids[:k])) >= end)
        assert n == c
    assert spanning >= 10


def test_stop_string_ending_in_a_lone_space_token(tok) -> None:
    # The BPE detokenizer holds a lone space token until the next token; a stop string it completes
    # is still found at that token (what it holds is asked of a copy), and the text is cut exactly.
    s = "print(add(1, 2))"
    ids = tok.encode(s)
    k = next(k for k in range(len(ids)) if tok.decode(ids[:k]) == "print(add(1, ")
    assert tok.decode([ids[k - 1]]) == " "
    chunks, text, n = stream(tok, ids, ["1, "])
    assert "".join(chunks) == "print(add(" and text.stopped and n == k
    chunks, text, _ = stream(tok, ids[:k], ["1, "])
    assert "".join(chunks) == "print(add(" and text.stopped
    # max_tokens ending on that space: the request stopped at the stop string, not at its length
    text = TextStream(tok, ["1, "])
    assert take_tokens(ids[:k], set(), text, 0, k) == (ids[:k], "stop")
    assert text.release(final=True) == "print(add("


def test_stop_string_inside_a_multibyte_character_sequence(tok) -> None:
    s = "a 😀 b 中文 c"
    ids = tok.encode(s)
    for stop, expected in [("😀", "a "), ("中文", "a 😀 b "), ("b 中", "a 😀 "), ("文 c", "a 😀 b 中")]:
        chunks, text, _ = stream(tok, ids, [stop])
        assert "".join(chunks) == expected and text.stopped


def test_earliest_of_several_stop_strings_wins(tok) -> None:
    s = "alpha beta gamma delta"
    ids = tok.encode(s)
    chunks, text, _ = stream(tok, ids, ["delta", "ta gam", "zzz"])
    assert "".join(chunks) == "alpha be" and text.stopped


def test_hold_back_never_releases_a_stop_prefix(tok) -> None:
    # "x = " begins the stop string twice before it is complete; the first is released in time,
    # the second never.
    s = "x = 1\nx = 2\ny = 3\n"
    stop = "x = 2"
    ids = tok.encode(s)
    expected = s[: s.index(stop)]
    chunks, text, _ = stream(tok, ids, [stop])
    so_far = ""
    for c in chunks:
        so_far += c
        assert expected.startswith(so_far)
    assert so_far == expected and text.stopped
    assert "".join(chunks[:-1])  # some text went out before the end


def test_unmatched_stop_prefix_is_released_at_the_end(tok) -> None:
    s = "value = compute(x) + ret"
    ids = tok.encode(s)
    chunks, text, _ = stream(tok, ids, ["return"])
    assert not text.stopped and "".join(chunks) == s
    # While generating, the last len("return") - 1 characters were held back.
    assert "".join(chunks[:-1]) == s[: len(s) - len("return") + 1]


def test_engine_text_is_decode_on_the_demo_model() -> None:
    from mtpipe.coordinator.engine.build import local_engine
    from mtpipe.training.corpus import heldout_prompts

    engine = local_engine(DEMO_MODEL, dtype=mx.float32)
    for prompt_text in heldout_prompts(2, chars=300):
        prompt = engine.tokenizer.encode(prompt_text)
        r = engine.complete(GenerationRequest(prompt, max_tokens=64, mtp_depth=2))
        assert r.text == engine.tokenizer.decode(r.tokens)


def test_token_bytes_are_the_tokens_own(tok) -> None:
    """logprobs' `bytes`: each token's own bytes, so that a character split over tokens comes back whole
    from their concatenation (its parts decoded alone are replacement characters)."""
    from mtpipe.coordinator.engine.detokenizer import token_bytes

    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(token_bytes(tok, t) for t in ids).decode("utf-8") == tok.decode(ids)
    split = [t for t in tok.encode("😀🎉", add_special_tokens=False) if "\ufffd" in tok.decode([t])]
    assert split and all(token_bytes(tok, t) != "\ufffd".encode() for t in split)


def test_a_stop_that_ends_in_a_held_back_space_stops_at_that_token(tok) -> None:
    """The detokenizer holds a lone space back until the next token: a stop string that ends in it
    stops the request at the space's token, and the token after it is neither handed out nor counted."""
    head, space = tok.encode("Answer:"), tok.encode(" ")
    assert len(space) == 1
    tokens = head + space + tok.encode("42") + tok.encode(" and more")
    text = TextStream(tok, ["Answer: "])
    new, finish = take_tokens(tokens, set(), text, 0, 100)
    assert (new, finish) == (head + space, "stop") and text.release(final=True) == ""
    text = TextStream(tok, ["Answer: 4"])  # one a later token completes: streamed as before
    new, finish = take_tokens(tokens, set(), text, 0, 100)
    assert finish == "stop" and len(new) == len(head) + 2 and text.release(final=True) == ""
    text = TextStream(tok, ["nowhere"])  # and text without a stop is still exactly decode
    new, finish = take_tokens(tokens, set(), text, 0, 100)
    assert finish is None and new == tokens and text.release(final=True) == tok.decode(tokens)


def test_special_tokens_add_no_text_when_skipped(tok) -> None:
    """vLLM's default: the text is `decode(..., skip_special_tokens=True)`, streamed; `<|im_start|>` is
    among the tokens left out though the tokenizer's special tokens map does not list it."""
    from mtpipe.coordinator.engine.detokenizer import special_ids

    specials = sorted(special_ids(tok))
    assert tok.convert_tokens_to_ids("<|im_start|>") in specials
    assert set(tok.all_special_ids) <= set(specials)
    vocab = [i for i in range(len(tok)) if "Ā" not in tok.convert_ids_to_tokens(i)]
    rng = random.Random(1)
    for _ in range(100):
        ids = [rng.choice(specials) if rng.random() < 0.2 else rng.choice(vocab) for _ in range(rng.randint(1, 30))]
        text = TextStream(tok, [], skip_special=True)
        chunks = []
        for t in ids:
            text.add(t)
            chunks.append(text.release(final=False))
        chunks.append(text.release(final=True))
        assert "".join(chunks) == tok.decode(ids, skip_special_tokens=True), ids
    kept = TextStream(tok, [])
    kept.add(specials[0])
    assert kept.release(final=True) == tok.decode([specials[0]]) != ""


def test_a_stop_string_that_is_a_skipped_special_token_still_stops(tok) -> None:
    """`stop: ["<|im_start|>"]` catches a runaway turn though the token adds no text; the text before it
    is kept whole, and with `keep_stop` the stop string ends the text as it would if shown."""
    start = tok.convert_tokens_to_ids("<|im_start|>")
    ids = tok.encode("def f(x):\n    return x ")
    for keep in (False, True):
        text = TextStream(tok, ["<|im_start|>"], skip_special=True, keep_stop=keep)
        for t in [*ids, start, *ids]:
            text.add(t)
        assert text.stopped
        assert text.release(final=True) == tok.decode(ids) + ("<|im_start|>" if keep else "")


def test_thinking_and_tool_tags_are_never_skipped() -> None:
    """Tags the API splits replies at stay in the text even where a tokenizer marks them special."""
    from types import SimpleNamespace

    from mtpipe.coordinator.engine.detokenizer import special_ids

    marked = {i: SimpleNamespace(special=True) for i in (5, 6, 8)}
    tokenizer = SimpleNamespace(added_tokens_decoder={**marked, 9: SimpleNamespace(special=False)}, all_special_ids=[7],
                                think_start_tokens=(5,), think_end_tokens=(6,), tool_call_start_tokens=None)
    assert special_ids(tokenizer) == {7, 8}


def test_a_stop_string_within_min_tokens_never_stops(tok) -> None:
    """vLLM's min_tokens: a stop string that ends within the first `after` tokens' text is passed over,
    also one whose last character the detokenizer held back (a lone space) until a later token."""
    ids = tok.encode(" is Lee, and I'm here", add_special_tokens=False)
    lee = next(i for i in range(len(ids)) if "Lee" in tok.decode(ids[: i + 1])) + 1  # tokens up to its end
    for after, stops in ((lee - 1, True), (lee, False)):
        text = TextStream(tok, ["Lee"], after=after)
        for t in ids:
            text.add(t)
        assert text.stopped is stops and ("Lee" in text.release(final=True)) is not stops
    spaced = [tok.encode(x, add_special_tokens=False)[0] for x in ("x", "a", " ", "b")]
    assert tok.decode(spaced) == "xa b"
    for after in (3, 4):  # ("a " ends with the third token: its space comes out with the fourth)
        text = TextStream(tok, ["a "], after=after)
        for t in spaced:
            text.add(t)
        assert not text.stopped and text.release(final=True) == "xa b"
    text = TextStream(tok, ["a "], after=2)
    for t in spaced:
        text.add(t)
    assert text.stopped and text.release(final=True) == "x"
