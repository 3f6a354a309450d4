"""OpenAI's Responses API (`/v1/responses`) through the official client: the same generation as the chat
request it reads as, in the Responses shape, whole and as its semantic events."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import mlx.core as mx
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

from helpers import LiveServer, thinking_tags  # noqa: E402

from mtpipe.coordinator.api.app import create_app  # noqa: E402
from mtpipe.coordinator.engine.batch import BatchEngine  # noqa: E402
from mtpipe.coordinator.engine.build import batch_engine  # noqa: E402

MODEL = "tiny-dense"
PROMPT = "def add(a, b):\n    return"
COUNT = {"type": "function", "name": "count", "description": "Count days", "parameters": {
    "type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["days"],
    "additionalProperties": False}}


@pytest.fixture(scope="module")
def engine(dense_ckpt: Path) -> Iterator[BatchEngine]:
    eng = batch_engine(dense_ckpt, stages=2, dtype=mx.float32)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server_url(engine: BatchEngine) -> Iterator[str]:
    with LiveServer(create_app(engine, MODEL)) as server:
        yield server.url


@pytest.fixture(scope="module")
def client(server_url: str) -> Any:
    return openai.OpenAI(base_url=server_url + "/v1", api_key="none", max_retries=0)


def events_of(client: Any, **ask: Any) -> list[Any]:
    events = list(client.responses.create(model=MODEL, stream=True, **ask))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events


def test_text_whole_and_streamed_is_the_chat_reply(client: Any) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                                 {"role": "user", "content": PROMPT}],
                                          max_tokens=12, temperature=0)
    ask = {"instructions": "Be brief.", "max_output_tokens": 12, "temperature": 0,
           "input": [{"role": "user", "content": [{"type": "input_text", "text": PROMPT}]}]}
    r = client.responses.create(model=MODEL, **ask)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == chat.choices[0].message.content and [o.type for o in r.output] == ["message"]
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    finished = chat.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if finished else "completed")
    assert (r.incomplete_details.reason if finished else r.incomplete_details) == \
        ("max_output_tokens" if finished else None)
    events = events_of(client, **ask)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text == events[-1].response.output_text
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    same = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=12, temperature=0)
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=12, temperature=0)
    assert same.output_text == plain.choices[0].message.content  # (a string input: one user message)


def test_the_objects_validate_strictly_as_the_sdk_models_them(client: Any, engine: BatchEngine) -> None:
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    raw = client.responses.with_raw_response.create(model=MODEL, input=PROMPT, max_output_tokens=4, temperature=0,
                                                    stream_options={"include_obfuscation": False})
    Response.model_validate(json.loads(raw.text), strict=True)
    stream = client.responses.with_raw_response.create(model=MODEL, input=PROMPT, max_output_tokens=4, stream=True,
                                                    temperature=0)  # (sampled, it may end within 4)
    stream.http_response.read()
    events = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.incomplete"
    for event in events:
        TypeAdapter(ResponseStreamEvent).validate_python(event, strict=True)


def test_logprobs_and_a_json_schema(client: Any) -> None:
    r = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=6, temperature=0, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in lps)
    assert r.top_logprobs == 2 and r.reasoning.effort is None  # (what was asked, as OpenAI echoes it)
    assert client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=1,
                                   reasoning={"effort": "low"}).reasoning.effort == "low"
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    held = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=32, temperature=0,
                                   text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    value = json.loads(held.output_text)
    assert set(value) == {"n"} and 0 <= value["n"] <= 9


def test_a_call_and_its_output_sent_back(client: Any) -> None:
    ask = {"model": MODEL, "input": "How many days?", "tools": [COUNT], "max_output_tokens": 32, "temperature": 0,
           "tool_choice": {"type": "function", "name": "count"}}
    r = client.responses.create(**ask)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "count" and 1 <= json.loads(call.arguments)["days"] <= 9 and call.call_id.startswith("call_")
    events = events_of(client, **{k: v for k, v in ask.items() if k != "model"})
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == call.arguments
    assert events[-1].response.output[-1].type == "function_call"
    turn = [{"role": "user", "content": "How many days?"},
            {"type": "function_call", "call_id": call.call_id, "name": "count", "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "3 days"}]
    turn.insert(1, {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Counting."}]})
    follow = client.responses.create(model=MODEL, input=turn, tools=[COUNT], max_output_tokens=4, temperature=0)
    assert follow.usage.input_tokens > r.usage.input_tokens
    chat = client.chat.completions.create(model=MODEL, tools=[{"type": "function", "function": {
        k: v for k, v in COUNT.items() if k != "type"}}], max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": "How many days?"},
        {"role": "assistant", "content": "Counting.", "tool_calls": [{"id": call.call_id, "type": "function",
                                                                      "function": {"name": "count",
                                                                                   "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "3 days"}])
    assert follow.usage.input_tokens == chat.usage.prompt_tokens  # (the same conversation as chat's: one turn)


def test_a_call_the_budget_cut_is_incomplete(client: Any) -> None:
    """A function_call that max_output_tokens cut (its arguments not whole JSON) is "incomplete", in the
    response and in the stream's output_item.done, as OpenAI's; a whole call before it stays "completed"."""
    ask = {"input": "How many days?", "tools": [COUNT], "tool_choice": "required", "temperature": 0}
    for budget in (3, 24, 40, 60, 80):  # (from a call begun to two whole ones, on this model)
        r = client.responses.create(model=MODEL, max_output_tokens=budget, **ask)
        events = events_of(client, max_output_tokens=budget, **ask)
        done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
        for calls in ([o for o in r.output if o.type == "function_call"], done, events[-1].response.output):
            whole = []
            for call in calls:
                try:
                    whole.append(isinstance(json.loads(call.arguments), dict))
                except ValueError:
                    whole.append(False)
            assert [c.status for c in calls] == ["completed" if w else "incomplete" for w in whole]
        assert [c.arguments for c in done] == [o.arguments for o in r.output if o.type == "function_call"]
    cut = client.responses.create(model=MODEL, max_output_tokens=60, **ask)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert [o.status for o in cut.output] == ["completed", "incomplete"]  # (the second call cut, on this model)
    named = client.responses.create(model=MODEL, input="How many days?", tools=[COUNT], max_output_tokens=2,
                                    tool_choice={"type": "function", "name": "count"})
    assert [(o.type, o.status) for o in named.output] == [("function_call", "incomplete")]


def test_what_was_asked_is_echoed(client: Any) -> None:
    """user, truncation and service_tier are echoed (the tier "default" where none, or "auto", was asked);
    completed_at is set once a response has completed, whole and streamed."""
    import time

    before = time.time()
    ask = {"input": PROMPT, "max_output_tokens": 2, "user": "u-7", "truncation": "auto", "service_tier": "flex"}
    r = client.responses.create(model=MODEL, **ask)
    assert (r.user, r.truncation, r.service_tier) == ("u-7", "auto", "flex")
    assert r.status == "incomplete" and r.completed_at is None
    ended = {"input": PROMPT, "max_output_tokens": 64, "temperature": 0, "extra_body": {"stop": [" "]}}
    plain = client.responses.create(model=MODEL, service_tier="auto", **ended)
    assert (plain.user, plain.truncation, plain.service_tier) == (None, "disabled", "default")
    assert plain.status == "completed" and before - 1 <= plain.completed_at <= time.time() + 1
    streamed = events_of(client, user="u-8", **ended)
    assert streamed[0].response.completed_at is None and streamed[0].response.user == "u-8"
    assert streamed[-1].response.status == "completed" and streamed[-1].response.completed_at >= int(before)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=2, service_tier="fastest")
    assert e.value.body["param"] == "service_tier"


def test_truncation_auto_drops_the_first_turns_that_overflow(client: Any) -> None:
    """truncation "auto": an input past the context loses its first turns, as few as let it fit (OpenAI's);
    "disabled" (the default) refuses it, as does "auto" where the last turn alone overflows."""
    long = [{"role": "user", "content": "a b c d " * 1500}, {"role": "assistant", "content": "Noted."}]
    turns = [*long, {"role": "user", "content": "How many?"}, {"role": "assistant", "content": "Two."},
             {"role": "user", "content": "And then?"}]
    ask = {"model": MODEL, "max_output_tokens": 2, "instructions": "Be brief."}
    for truncation in ({}, {"truncation": "disabled"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(input=turns, **ask, **truncation)
        assert e.value.body["code"] == "context_length_exceeded"
    cut = client.responses.create(input=turns, truncation="auto", **ask)
    assert cut.truncation == "auto" and cut.usage.input_tokens == \
        client.responses.create(input=turns[2:], **ask).usage.input_tokens  # (the long turn gone, the rest kept)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input=[*turns, *long[:1]], truncation="auto", **ask)
    assert e.value.body["code"] == "context_length_exceeded"
    # A system prompt sent as the first input item stays, as `instructions` does
    system = {"role": "developer", "content": "Answer in one word."}
    kept = client.responses.create(input=[system, *turns], truncation="auto", **ask)
    assert kept.usage.input_tokens == client.responses.create(input=[system, *turns[2:]], **ask).usage.input_tokens
    # and input_tokens counts what that request is fed (the whole input where it is not truncated)
    count = {"model": MODEL, "instructions": ask["instructions"], "input": [system, *turns]}
    assert client.responses.input_tokens.count(**count, truncation="auto").input_tokens == kept.usage.input_tokens
    assert client.responses.input_tokens.count(**count).input_tokens > kept.usage.input_tokens


def test_input_tokens_counts_the_prompt_a_request_is_fed(client: Any, engine: BatchEngine) -> None:
    """POST /v1/responses/input_tokens: the prompt a Responses body would be fed (its instructions, tools,
    the response it goes on from), counted and not generated; also past the context."""
    first = client.responses.create(model=MODEL, input="How many?", max_output_tokens=3, temperature=0)
    for ask in ({"input": PROMPT}, {"input": "How many days?", "instructions": "Be brief.", "tools": [COUNT],
                                    "tool_choice": "required"},
                {"input": "And then?", "previous_response_id": first.id}, {"input": PROMPT, "reasoning": {
                    "effort": "none"}}):
        counted = client.responses.input_tokens.count(model=MODEL, **ask)
        assert counted.object == "response.input_tokens"
        assert counted.input_tokens == client.responses.create(model=MODEL, max_output_tokens=1,
                                                               **ask).usage.input_tokens
    metrics = str(client.base_url).removesuffix("/v1/") + "/metrics"

    def prompt_tokens_generated() -> float:
        (line,) = [x for x in httpx.get(metrics).text.splitlines() if x.startswith("mtpipe_prompt_tokens_total ")]
        return float(line.split()[1])

    before = prompt_tokens_generated()
    past = client.responses.input_tokens.count(model=MODEL, input="a b c d " * 1500)
    assert past.input_tokens > engine.max_context and prompt_tokens_generated() == before  # (nothing generated)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_tokens.count(model=MODEL, input=[{"type": "computer_call"}])
    assert e.value.body["param"] == "input[0].type"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_tokens.count(model=MODEL)
    assert e.value.body["param"] == "input"


def test_thinking_comes_as_a_reasoning_item(client: Any, engine: BatchEngine) -> None:
    """With made-up thinking tags (the prompt's last tag opens the thought, a piece of the reply closes
    it), the thought is a reasoning item before the message, whole and streamed."""
    plain = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=24, temperature=0).output_text
    end = plain[len(plain) // 3 : len(plain) // 3 + 4]
    thought, answer = plain[: plain.index(end)], plain[plain.index(end) + len(end):].lstrip("\r\n")
    with thinking_tags(engine.tokenizer, end):
        ask = {"input": PROMPT, "max_output_tokens": 24, "temperature": 0}
        r = client.responses.create(model=MODEL, **ask, include=["message.output_text.logprobs"])
        assert [o.type for o in r.output] == ["reasoning", "message"]
        assert "".join(lp.token for lp in r.output[1].content[0].logprobs).endswith(r.output_text)  # (its own)
        assert r.output[0].content[0].text == thought and r.output_text == answer
        assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
        events = events_of(client, **ask)
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer
        assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]


def test_a_response_goes_on_from_a_kept_one(client: Any) -> None:
    """previous_response_id: the kept conversation (its input and output) comes before the new input, as
    if sent whole; GET reads a kept response, DELETE forgets it; store false keeps nothing."""
    first = client.responses.create(model=MODEL, input="How many?", max_output_tokens=6, temperature=0)
    assert first.store is True and client.responses.retrieve(first.id).output_text == first.output_text
    scored = client.responses.create(model=MODEL, input="x", max_output_tokens=4, top_logprobs=2)
    assert scored.output[0].content[0].logprobs and not client.responses.retrieve(scored.id).output[0].content[0].logprobs
    chained = client.responses.create(model=MODEL, previous_response_id=first.id, input="And then?",
                                      max_output_tokens=6, temperature=0)
    whole = client.responses.create(model=MODEL, max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": "How many?"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}])
    assert chained.previous_response_id == first.id
    assert (chained.usage.input_tokens, chained.output_text) == (whole.usage.input_tokens, whole.output_text)
    again = client.responses.create(model=MODEL, previous_response_id=chained.id, input="More.", max_output_tokens=2)
    assert again.usage.input_tokens > chained.usage.input_tokens  # (a chain of three)
    streamed = events_of(client, input="x", max_output_tokens=2)[-1].response
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    unkept = client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, previous_response_id=first.id, input="x", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    assert e.value.body["code"] == "previous_response_not_found"  # (OpenAI's: clients send the whole input then)


def test_a_kept_responses_input_items_are_listed(client: Any) -> None:
    """GET /v1/responses/{id}/input_items: the conversation that led to a response (the responses it followed,
    their output, then its own input), as the client types them, newest first unless asked, paged by id."""
    first = client.responses.create(model=MODEL, input="How many?", max_output_tokens=4, temperature=0)
    chained = client.responses.create(model=MODEL, previous_response_id=first.id, max_output_tokens=4, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "And then?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "count", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "2"}])
    items = client.responses.input_items.list(chained.id, order="asc")
    assert [i.type for i in items.data] == ["message", "message", "message", "function_call", "function_call_output"]
    assert items.data[0].role == "user" and items.data[0].content[0].text == "How many?"
    assert items.data[1].id == first.output[0].id and items.data[1].content[0].text == first.output_text
    assert items.data[2].content[0].type == "input_text" and items.data[4].output == "2"
    assert len({i.id for i in items.data}) == 5 and not items.has_more
    assert [i.id for i in client.responses.input_items.list(first.id).data] == [items.data[0].id]  # (kept ids)
    newest = client.responses.input_items.list(chained.id, limit=3)
    assert [i.id for i in newest.data] == [i.id for i in items.data[::-1][:3]] and newest.has_more
    rest = client.responses.input_items.list(chained.id, limit=3, after=newest.last_id)
    assert [i.id for i in rest.data] == [i.id for i in items.data[1::-1]] and not rest.has_more
    assert [i.id for i in client.responses.input_items.list(chained.id, limit=2)] \
        == [i.id for i in items.data[::-1]]
    for ask, param in [({"after": "msg_nope"}, "after"), ({"limit": 101}, "limit"), ({"order": "up"}, "order")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.input_items.list(chained.id, **ask)
        assert e.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input[0].content"),
    ({"input": [{"type": "computer_call", "id": "c"}]}, "input[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": []}, "input"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "x", "include": ["bogus.field"]}, "include"),
    ({"input": "x", "background": True}, "background"),
    ({"input": [{"type": "reasoning", "content": -4}, {"role": "user", "content": "x"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "nope", "output": "1"}],
      "instructions": "Be brief."}, "input[1]"),
    ({"input": "x", "tools": [{"type": "function", "name": "has space"}]}, "tools[0].name"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
    ({"input": "x", "text": {"format": "json"}}, "text.format"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                   "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[2].output"),
    ({"input": "x", "text": {"format": {"name": "n"}}}, "text.format.type"),
])
def test_refused_with_the_field_named(client: Any, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, **body)
    assert e.value.body["param"] == param, e.value.body


def test_a_refused_turn_sent_back_reads_as_its_text(client: Any) -> None:
    """A response's output message with a refusal part, sent back as input (an assistant's), reads as
    that text; a user's refusal part is a 400."""
    def input_tokens(part: dict[str, Any], role: str = "assistant") -> int:
        items = [{"role": "user", "content": "x"}, {"role": role, "content": [part]}, {"role": "user", "content": "why?"}]
        return client.responses.input_tokens.count(model=MODEL, input=items).input_tokens

    said = "I can't help with that."
    assert input_tokens({"type": "refusal", "refusal": said}) == input_tokens({"type": "output_text", "text": said})
    with pytest.raises(openai.BadRequestError) as e:
        input_tokens({"type": "refusal", "refusal": "no"}, role="user")
    assert e.value.body["param"] == "input[1].content"
