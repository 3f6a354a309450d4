"""logprobs, penalties and logit_bias through the live API with the official client."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from helpers import thinking_tags  # noqa: E402
from test_api import LiveServer  # noqa: E402

from mtpipe.coordinator.api.app import create_app  # noqa: E402
from mtpipe.coordinator.engine.batch import BatchEngine  # noqa: E402
from mtpipe.coordinator.engine.build import batch_engine  # noqa: E402
from mtpipe.coordinator.engine.request import GenerationRequest  # noqa: E402
from mtpipe.node.protocol import SamplingParams  # noqa: E402

MODEL = "tiny-dense"


@pytest.fixture(scope="module")
def engine(dense_ckpt: Path) -> Iterator[BatchEngine]:
    e = batch_engine(dense_ckpt, dtype=mx.float32)
    yield e
    e.close()


@pytest.fixture(scope="module")
def client(engine: BatchEngine) -> Iterator[Any]:
    with LiveServer(create_app(engine, MODEL)) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)


PROMPT = "def add(a, b):\n    return"


def test_chat_logprobs_match_the_engine_at_every_depth(client: Any, engine: BatchEngine) -> None:
    from mtpipe.coordinator.engine.detokenizer import token_bytes

    messages = [{"role": "user", "content": PROMPT}]
    tokens = engine.encode_chat(messages)
    ref = engine.complete(GenerationRequest(tokens, 12, SamplingParams(top_logprobs=3)))
    for depth in (0, 2, "auto"):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                           logprobs=True, top_logprobs=3, extra_body={"mtp_depth": depth})
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens == len(ref.tokens)
        for entry, token in zip(content, ref.tokens):
            assert entry.token == engine.tokenizer.decode([token])
            assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy
            assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-6
            assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                     reverse=True)
            assert entry.bytes == list(token_bytes(engine.tokenizer, token))
        assert bytes(b for e in content for b in e.bytes).decode(errors="replace") == r.choices[0].message.content
        first = content[0].logprob
        assert first == pytest.approx(content[0].top_logprobs[0].logprob)
        if depth == 0:
            baseline = [e.logprob for e in content]
        else:
            assert [e.logprob for e in content] == pytest.approx(baseline, abs=1e-5)


def test_streamed_completion_logprobs(client: Any) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == whole.usage.completion_tokens
    def raw(token: str) -> bytes:  # (a token with no text of its own is named by its bytes: "bytes:\\xNN")
        return bytes(int(h, 16) for h in token[6:].split("\\x")[1:]) if token.startswith("bytes:") else token.encode()

    assert b"".join(map(raw, lp.tokens)).decode(errors="replace") == whole.choices[0].text
    assert all(o <= len(whole.choices[0].text) for o in lp.text_offset)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    streamed = []
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2,
                                           stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_logprobs_name_tokens_by_id_as_vllm_does_when_asked(client: Any, engine: BatchEngine) -> None:
    """vLLM's return_tokens_as_token_ids: every token of the logprobs (the alternatives', an echoed
    prompt's, a stream's) is "token_id:N", N the token emitted; the text is as it is."""
    messages = [{"role": "user", "content": PROMPT}]
    ref = engine.complete(GenerationRequest(engine.encode_chat(messages), 8, SamplingParams()))
    ids = {"return_tokens_as_token_ids": True}
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body=ids)
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == [f"token_id:{t}" for t in ref.tokens]
    assert all(e.top_logprobs[0].token == e.token and e.top_logprobs[1].token.startswith("token_id:")
               for e in content)
    assert r.choices[0].message.content == ref.text
    prompt = engine.tokenizer.encode(PROMPT)
    done = engine.complete(GenerationRequest(prompt, 6, SamplingParams()))
    streamed = [t for c in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                                     logprobs=1, echo=True, stream=True, extra_body=ids)
                for t in (c.choices[0].logprobs.tokens if c.choices and c.choices[0].logprobs else [])]
    assert streamed == [f"token_id:{t}" for t in prompt + done.tokens]
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1,
                                      extra_body=ids).choices[0].logprobs
    assert all(set(top) >= {name} for top, name in zip(whole.top_logprobs, whole.tokens))
    r = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=4, temperature=0, top_logprobs=1,
                                extra_body=ids)
    shown = r.output[-1].content[0].logprobs
    assert shown and all(lp.token.startswith("token_id:") for lp in shown)


def test_completion_logprobs_of_tokens_that_split_a_character() -> None:
    """Byte tokens of one character (a byte-level BPE's): each starts where its character does, never past
    the text, and is named by its bytes (OpenAI's "bytes:\\xNN"), so alternatives keep distinct names."""
    from mtpipe.coordinator.api.generation import ResponseFormat

    def entry(raw: bytes, logprob: float, top: list | None = None) -> dict:
        return {"token": raw.decode(errors="replace"), "bytes": list(raw), "logprob": logprob,
                "top_logprobs": top if top is not None else []}

    fmt = ResponseFormat(chat=False, model=MODEL)
    first = fmt.logprobs([entry(b"\xc3", -0.1, [entry(b"\xc3", -0.1), entry(b"\xc4", -2.0)]), entry(b"\xa9", -0.2)])
    later = fmt.logprobs([entry(b" a", -0.3), entry("ü".encode(), -0.4)])  # (the next chunk of a stream)
    text = "é aü"
    assert first["tokens"] == ["bytes:\\xc3", "bytes:\\xa9"] and later["tokens"] == [" a", "ü"]
    assert first["text_offset"] + later["text_offset"] == [0, 0, 1, 3]
    assert all(o < len(text) for o in first["text_offset"] + later["text_offset"])
    assert first["top_logprobs"][0] == {"bytes:\\xc3": -0.1, "bytes:\\xc4": -2.0}
    assert first["top_logprobs"][1] == {"bytes:\\xa9": -0.2}  # the sampled token, always (OpenAI's logprobs + 1)


def test_completion_top_logprobs_always_hold_the_sampled_token(client: Any) -> None:
    """A sampled token outside the most likely ones is still in its position's top logprobs, as OpenAI
    gives it: up to `logprobs` + 1 entries."""
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=2.0, seed=3, logprobs=1)
    lp = out.choices[0].logprobs
    assert all(top.get(token) == pytest.approx(value) and len(top) <= 2
               for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    assert any(len(top) == 2 for top in lp.top_logprobs)  # (at temperature 2, some token was not the likeliest)


def test_penalties_and_bias_change_the_output_identically_at_every_depth(client: Any, engine: BatchEngine) -> None:
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    banned = engine.tokenizer.encode(plain.choices[0].text)[0]
    outs = []
    for depth in (0, 3, "auto"):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                      presence_penalty=1.0, frequency_penalty=0.5,
                                      logit_bias={str(banned): -100}, extra_body={"mtp_depth": depth})
        outs.append(r.choices[0].text)
    assert outs[0] == outs[1] == outs[2] != plain.choices[0].text
    assert banned not in engine.tokenizer.encode(outs[0])[:1]
    forced = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                       logit_bias={str(banned): 100})
    assert engine.tokenizer.encode(forced.choices[0].text)[:4] == [banned] * 4


def test_bad_processor_values_are_400(client: Any) -> None:
    for kwargs, param in [({"presence_penalty": 5.0}, "presence_penalty"),
                          ({"logit_bias": {"x": 1}}, "logit_bias"),
                          ({"extra_body": {"repetition_penalty": -1.0}}, "repetition_penalty")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, **kwargs)
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       logprobs=True, top_logprobs=21)


def test_special_tokens_leave_the_text_unless_kept(client: Any, engine: BatchEngine) -> None:
    """As vLLM: a generated special token (here `<|im_start|>`, forced by a bias) adds no text, streamed
    or whole, unless `skip_special_tokens` is false, or tools are given (a parser may need their tags);
    usage and logprobs still count and name it."""
    special = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    forced = {"logit_bias": {str(special): 100}, "max_tokens": 3, "temperature": 0}
    r = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=0, **forced)
    assert r.choices[0].text == "" and r.usage.completion_tokens == 3
    assert r.choices[0].logprobs.tokens == ["<|im_start|>"] * 3
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **forced)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ""
    kept = client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"skip_special_tokens": False}, **forced)
    assert kept.choices[0].text == "<|im_start|>" * 3
    messages = [{"role": "user", "content": PROMPT}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    chat = client.chat.completions.create(model=MODEL, messages=messages, **forced)
    assert chat.choices[0].message.content == ""
    with_tools = client.chat.completions.create(model=MODEL, messages=messages, tools=[tool], **forced)
    assert with_tools.choices[0].message.content == "<|im_start|>" * 3
    skipped = client.chat.completions.create(model=MODEL, messages=messages, tools=[tool],
                                             extra_body={"skip_special_tokens": True}, **forced)
    assert skipped.choices[0].message.content == ""


def test_vllm_stop_extensions(client: Any, engine: BatchEngine) -> None:
    """vLLM's `stop_token_ids` end a request as EOS does, `ignore_eos` lets EOS through (here forced by a
    bias: every token is EOS, none in the text), `include_stop_str_in_output` keeps the stop string, and
    the stop token's text; the token that ends a request is counted, with its log-probability, as in
    vLLM; a stop token outside the vocabulary is refused."""
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0)
    tokens = [engine.tokenizer.convert_tokens_to_ids(t) for t in plain.choices[0].logprobs.tokens]
    at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    for keep in (False, True):
        cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0,
                                        extra_body={"stop_token_ids": [tokens[at]], "include_stop_str_in_output": keep})
        assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == at + 1
        want = plain.choices[0].logprobs.token_logprobs[: at + 1]
        assert cut.choices[0].logprobs.token_logprobs == pytest.approx(want, abs=1e-5)
        assert cut.choices[0].model_extra["stop_reason"] == tokens[at]  # (vLLM's: what ended it)
        assert cut.choices[0].text == engine.tokenizer.decode(tokens[: at + keep])
    assert plain.choices[0].model_extra["stop_reason"] is None
    eos = sorted(engine.eos)[0]
    forced = {"max_tokens": 4, "temperature": 0, "logit_bias": {str(eos): 100}}
    eos_text = engine.tokenizer.convert_ids_to_tokens(eos)
    for keep in (False, True):  # (EOS is a special token: its text is left out either way, and stops as a token)
        extra = {"include_stop_str_in_output": keep, "stop": [eos_text]}
        ended = client.completions.create(model=MODEL, prompt=PROMPT, **forced, logprobs=0, extra_body=extra)
        assert (ended.choices[0].finish_reason, ended.usage.completion_tokens, ended.choices[0].text) == ("stop", 1, "")
        assert ended.choices[0].model_extra["stop_reason"] is None and len(ended.choices[0].logprobs.tokens) == 1
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, **forced, logprobs=0, extra_body=extra,
                                                stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 1  # (streamed: the same count, the same entry)
        assert [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == \
            ended.choices[0].logprobs.tokens
    through = client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"ignore_eos": True}, **forced)
    assert through.choices[0].finish_reason == "length" and through.usage.completion_tokens == 4
    assert through.choices[0].text == ""
    text = plain.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    for keep, expected in ((False, text[: text.index(stop)]), (True, text[: text.index(stop) + len(stop)])):
        whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                          extra_body={"include_stop_str_in_output": keep})
        streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                             stream=True, extra_body={"include_stop_str_in_output": keep})
        streamed = list(streamed)
        assert whole.choices[0].text == "".join(c.choices[0].text for c in streamed if c.choices) == expected
        assert whole.choices[0].model_extra["stop_reason"] == stop == streamed[-1].choices[0].model_extra["stop_reason"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"stop_token_ids": [10**6]})
    assert e.value.body["param"] == "stop_token_ids"


def test_min_tokens_holds_back_what_ends_a_request(client: Any, engine: BatchEngine) -> None:
    """vLLM's `min_tokens`: EOS and `stop_token_ids` are refused (masked inside the verify, so the tokens are
    the same at every MTP depth) and stop strings not looked for until that many tokens were generated."""
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0)
    tokens = [engine.tokenizer.convert_tokens_to_ids(t) for t in plain.choices[0].logprobs.tokens]
    at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    held = []
    for depth in (0, 3, "auto"):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0,
                                      extra_body={"stop_token_ids": [tokens[at]], "min_tokens": at + 2,
                                                  "mtp_depth": depth})
        held.append([engine.tokenizer.convert_tokens_to_ids(t) for t in r.choices[0].logprobs.tokens])
        assert r.usage.completion_tokens >= at + 2 and tokens[at] not in held[-1][: at + 2]
    assert held[0] == held[1] == held[2] and held[0][:at] == tokens[:at]
    eos = sorted(engine.eos)[0]
    forced = {"max_tokens": 6, "temperature": 0, "logit_bias": {str(eos): 100}}
    for depth in (0, 2):
        r = client.completions.create(model=MODEL, prompt=PROMPT, **forced, extra_body={"min_tokens": 3,
                                                                                           "mtp_depth": depth})
        assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 4)  # (3, then the EOS)
    text = plain.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    early = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                      extra_body={"min_tokens": 12})
    assert early.choices[0].text == text and early.choices[0].finish_reason == "length"
    for extra in ({"min_tokens": 5}, {"min_tokens": -1}, {"min_tokens": 2, "guided_regex": "[a-z]+"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body=extra)
        assert e.value.body["param"] == "min_tokens"


# A template that opens an empty thought where Qwen's enable_thinking is false.
THINKING_TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
                     "<|im_start|>assistant\n{%- if enable_thinking is defined and not enable_thinking %}"
                     "<think>\n\n</think>\n\n{%- endif %}")


@contextmanager
def chat_template(engine: BatchEngine, template: str) -> Iterator[None]:
    hf = engine.tokenizer._tokenizer
    before, hf.chat_template = hf.chat_template, template
    try:
        yield
    finally:
        hf.chat_template = before


def test_chat_template_kwargs_reach_the_template(client: Any, engine: BatchEngine) -> None:
    """vLLM's `chat_template_kwargs` (Qwen's enable_thinking, say) are variables of the chat template;
    one that would set an argument of the template call is a 400."""
    with chat_template(engine, THINKING_TEMPLATE):
        messages = [{"role": "user", "content": PROMPT}]
        asked = {}
        for thinking in (True, False):
            r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
            asked[thinking] = r.usage.prompt_tokens
        assert asked[False] > asked[True]  # (the empty thinking block)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                           extra_body={"chat_template_kwargs": {"tokenize": False}})
        assert e.value.body["param"] == "chat_template_kwargs"


def test_a_reasoning_models_thinking_comes_apart_from_its_answer(client: Any, engine: BatchEngine) -> None:
    """With thinking tags in the tokenizer (here made up: the chat prompt's last tag opens the thought,
    a piece of the greedy reply closes it), the reply's thinking goes out as `reasoning_content` and
    `reasoning`, streamed or whole, the answer as `content`; `include_reasoning: false` drops it, and an
    assistant message may carry it back."""
    messages = [{"role": "user", "content": PROMPT}]
    text = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    text = text.choices[0].message.content
    end = text[len(text) // 3 : len(text) // 3 + 4]
    thought, answer = text[: text.index(end)], text[text.index(end) + len(end):].lstrip("\r\n")
    assert thought and answer
    with thinking_tags(engine.tokenizer, end):
        ask = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0}
        r = client.chat.completions.create(**ask).choices[0].message
        assert (r.content, r.model_extra["reasoning_content"], r.model_extra["reasoning"]) == (answer, thought, thought)
        deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **ask) if c.choices]
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thought
        assert "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas) == thought
        assert "".join(d.content or "" for d in deltas) == answer
        logged = [c for c in client.chat.completions.create(stream=True, logprobs=True, **ask,
                                                             stream_options={"include_usage": True})]
        carrying = [c.choices[0] for c in logged if c.choices and c.choices[0].logprobs]
        assert sum(len(c.logprobs.content) for c in carrying) == logged[-1].usage.completion_tokens == 24
        thinking = [c for c in carrying if (c.delta.model_extra or {}).get("reasoning")]
        assert thinking and all(not c.delta.content for c in thinking)  # (its own tokens' logprobs)
        two = client.chat.completions.create(n=2, **ask).choices  # (each choice's reply split on its own)
        assert [(c.message.content, c.message.model_extra["reasoning"]) for c in two] == [(answer, thought)] * 2
        streamed: dict[int, list[str]] = {0: ["", ""], 1: ["", ""]}
        for c in client.chat.completions.create(stream=True, n=2, **ask):
            for choice in c.choices:
                streamed[choice.index][0] += choice.delta.content or ""
                streamed[choice.index][1] += (choice.delta.model_extra or {}).get("reasoning") or ""
        assert streamed == {0: [answer, thought], 1: [answer, thought]}
        dropped = client.chat.completions.create(extra_body={"include_reasoning": False}, **ask).choices[0].message
        assert dropped.content == answer and "reasoning_content" not in (dropped.model_extra or {})
        shown = client.chat.completions.create(extra_body={"include_reasoning": None}, **ask).choices[0].message
        assert shown.model_extra["reasoning"] == thought  # (null: the default, as vLLM's)
        prefilled = client.chat.completions.create(  # (a prefill inside the thought goes on inside it)
            **{**ask, "messages": [*messages, {"role": "assistant", "content": thought[:2]}]},
            extra_body={"continue_final_message": True}).choices[0].message
        assert prefilled.model_extra.get("reasoning")
        for turn in ({"content": answer, "reasoning_content": thought}, {"content": None, "reasoning": thought}):
            again = [*messages, {"role": "assistant", **turn}, {"role": "user", "content": "more"}]
            assert client.chat.completions.create(model=MODEL, messages=again, max_tokens=2).choices[0].message


def test_reasoning_effort_none_turns_thinking_off_as_vllm_maps_it(client: Any, engine: BatchEngine) -> None:
    """OpenAI's `reasoning_effort` (and the Responses API's `reasoning.effort`): "none" is Qwen's
    enable_thinking false, any other effort true, unless chat_template_kwargs says otherwise; the template
    reads the effort too. A value OpenAI does not name is a 400."""
    with chat_template(engine, THINKING_TEMPLATE + "{{ reasoning_effort | default('') }}"):
        messages = [{"role": "user", "content": PROMPT}]

        def prompt_tokens(**extra: Any) -> int:
            return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                                  extra_body=extra).usage.prompt_tokens

        plain, off, high = prompt_tokens(), prompt_tokens(reasoning_effort="none"), prompt_tokens(reasoning_effort="high")
        on = prompt_tokens(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
        # (mlx-lm's tokenizer says enable_thinking as the tokenizer thinks, here not: the empty block, unless on)
        assert off > plain and on < off and high < off  # (the effort's word; the block gone where thinking is on)
        r = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=1, reasoning={"effort": "none"})
        assert r.usage.input_tokens == off
        tokenize = str(client.base_url).removesuffix("/v1/") + "/tokenize"  # (it counts the prompt a chat is fed)
        assert httpx.post(tokenize, json={"messages": messages, "reasoning_effort": "none"}).json()["count"] == off
        assert httpx.post(tokenize, json={"messages": messages, "reasoning_effort": "x"}).status_code == 400
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                           extra_body={"reasoning_effort": "extreme"})
        assert e.value.body["param"] == "reasoning_effort"
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=1, reasoning={"effort": "extreme"})
        assert e.value.body["param"] == "reasoning.effort"


def test_efforts_above_high_are_high_unless_the_template_knows_them(client: Any, engine: BatchEngine) -> None:
    """OpenAI's "xhigh" and "max" efforts are taken: a template that names no such value reads "high",
    one that names it reads it; the Responses API echoes what was asked."""
    tokenize = str(client.base_url).removesuffix("/v1/") + "/tokenize"
    messages = [{"role": "user", "content": PROMPT}]

    def tokens(effort: str) -> list[int]:
        answer = httpx.post(tokenize, json={"messages": messages, "reasoning_effort": effort})
        assert answer.status_code == 200, answer.text
        return answer.json()["tokens"]

    with chat_template(engine, THINKING_TEMPLATE + "{{ reasoning_effort | default('') }}"):
        assert tokens("xhigh") == tokens("max") == tokens("high") != tokens("low")
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, reasoning_effort="max")
        assert chat.usage.prompt_tokens == len(tokens("high"))
        r = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=1, reasoning={"effort": "xhigh"})
        assert r.reasoning.effort == "xhigh" and r.usage.input_tokens == len(tokens("high"))
    with chat_template(engine, THINKING_TEMPLATE + "{{ 'finest' if reasoning_effort == 'xhigh' else 'high' }}"):
        assert tokens("xhigh") != tokens("high") == tokens("max")
