"""Anthropic's Messages API (`/v1/messages`) through the official anthropic client: the same generation as
the chat request it reads as, in the Messages shape, whole and streamed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import mlx.core as mx
import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

from helpers import LiveServer, thinking_tags  # noqa: E402

from mtpipe.coordinator.api.app import create_app  # noqa: E402
from mtpipe.coordinator.engine.batch import BatchEngine  # noqa: E402
from mtpipe.coordinator.engine.build import batch_engine  # noqa: E402

MODEL = "tiny-dense"
KEY = "sk-test-key"
PROMPT = "def add(a, b):\n    return"
GREEDY = {"temperature": 0}  # (the anthropic client has no temperature argument: sent as an extra field)
COUNT = {"name": "count", "description": "Count days", "input_schema": {
    "type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["days"],
    "additionalProperties": False}}


@pytest.fixture(scope="module")
def engine(dense_ckpt: Path) -> Iterator[BatchEngine]:
    eng = batch_engine(dense_ckpt, stages=1, dtype=mx.float32)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server(engine: BatchEngine) -> Iterator[LiveServer]:
    with LiveServer(create_app(engine, MODEL, api_key=KEY)) as s:
        yield s


@pytest.fixture(scope="module")
def claude(server: LiveServer) -> Any:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def test_text_whole_and_streamed_is_the_chat_reply(claude: Any, client: Any) -> None:
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}])
    ask = {"model": MODEL, "max_tokens": 12, "extra_body": GREEDY, "system": "Be brief.",
           "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]}
    m = claude.messages.create(**ask)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert m.usage.output_tokens == chat.usage.completion_tokens
    with claude.messages.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.content[0].text == m.content[0].text and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens
    # message_start's input usage is the final one: the same prompt again reads its kept prefix
    start = events[0].message.usage
    assert final.usage.cache_read_input_tokens > 0
    assert (start.input_tokens, start.cache_read_input_tokens) == (final.usage.input_tokens,
                                                                   final.usage.cache_read_input_tokens)
    counted = claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=ask["messages"])
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_a_stop_sequence_is_named(claude: Any) -> None:
    text = claude.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": PROMPT}]).content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    m = claude.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, stop_sequences=[stop],
                               messages=[{"role": "user", "content": PROMPT}])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop) and m.content[0].text == text[: text.index(stop)]


def test_a_forced_tool_and_its_result_sent_back(claude: Any, client: Any) -> None:
    ask = {"model": MODEL, "max_tokens": 32, "extra_body": GREEDY, "tools": [COUNT],
           "tool_choice": {"type": "tool", "name": "count"}, "messages": [{"role": "user", "content": "How many?"}]}
    m = claude.messages.create(**ask)
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "count" and 1 <= use.input["days"] <= 9
    with claude.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [use.input]
    turn = [{"role": "user", "content": "How many?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Counting."},
                                              {"type": "tool_use", "id": use.id, "name": "count", "input": use.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "3 days"}]}]
    follow = claude.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, tools=[COUNT], messages=turn)
    chat = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, tools=[
        {"type": "function", "function": {"name": "count", "description": "Count days",
                                          "parameters": COUNT["input_schema"]}}], messages=[
        {"role": "user", "content": "How many?"},
        {"role": "assistant", "content": "Counting.", "tool_calls": [{"id": use.id, "type": "function", "function": {
            "name": "count", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "3 days"}])
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_thinking_comes_as_a_thinking_block(claude: Any, engine: BatchEngine) -> None:
    plain = claude.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": PROMPT}]).content[0].text
    end = plain[len(plain) // 3 : len(plain) // 3 + 4]
    thought, answer = plain[: plain.index(end)], plain[plain.index(end) + len(end):].lstrip("\r\n")
    with thinking_tags(engine.tokenizer, end):
        ask = {"model": MODEL, "max_tokens": 24, "extra_body": GREEDY, "messages": [{"role": "user", "content": PROMPT}]}
        m = claude.messages.create(**ask)
        assert [(b.type, getattr(b, "thinking", None) or b.text) for b in m.content] == \
            [("thinking", thought), ("text", answer)]
        with claude.messages.stream(**ask) as stream:
            final = stream.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == thought


def test_errors_in_anthropics_shape_and_the_key_as_x_api_key(server: LiveServer, claude: Any) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x"}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-x", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    missing = server.client.post("/v1/messages", json={"model": MODEL, "messages": []},
                                 headers={"x-api-key": KEY})
    assert missing.status_code == 400 and missing.json()["error"]["type"] == "invalid_request_error"


def test_prefill_blocks_and_structured_output(server: LiveServer, claude: Any, client: Any) -> None:
    """A last assistant message is continued (as chat's continue_final_message); text blocks join as chat's
    content parts do; output_config.format holds the reply to a schema."""
    turn = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "a +"}]
    m = claude.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY, messages=turn)
    chat = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=turn,
                                          extra_body={"continue_final_message": True})
    assert m.content[0].text == chat.choices[0].message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    blocks = [{"type": "text", "text": "One."}, {"type": "text", "text": "Two.", "cache_control": {"type": "ephemeral"}}]
    counted = claude.messages.count_tokens(model=MODEL, system=blocks, messages=[{"role": "user", "content": blocks}])
    fed = server.client.post("/tokenize", json={"messages": [{"role": "system", "content": "One.\nTwo."},
                                                             {"role": "user", "content": "One.\nTwo."}]},
                             headers={"x-api-key": KEY}).json()
    assert counted.input_tokens == fed["count"]
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    held = claude.messages.create(model=MODEL, max_tokens=32, messages=[{"role": "user", "content": PROMPT}],
                                  extra_body={**GREEDY, "output_config": {"format": {"type": "json_schema",
                                                                                     "schema": schema}}})
    assert set(json.loads(held.content[0].text)) == {"n"}


def test_every_error_on_its_paths_is_anthropics(server: LiveServer) -> None:
    for headers, body, status, kind in (({"x-api-key": "wrong"}, {}, 401, "authentication_error"),
                                        ({"x-api-key": KEY}, {"model": MODEL, "max_tokens": 4, "tools": [
                                            {"name": "has space", "input_schema": {"type": "object"}}],
                                          "messages": [{"role": "user", "content": "hi"}]}, 400,
                                         "invalid_request_error")):
        r = server.client.post("/v1/messages", json=body, headers=headers)
        assert r.status_code == status and r.json()["type"] == "error" and r.json()["error"]["type"] == kind, r.text
    assert "tools[0].name" in r.json()["error"]["message"]  # (its own field names, not chat's)
    use = {"type": "tool_use", "id": "t1", "name": "count", "input": {"days": 1}}
    wrong = server.client.post("/v1/messages", headers={"x-api-key": KEY}, json={
        "model": MODEL, "max_tokens": 4, "system": "S", "tools": [COUNT], "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": [use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "1"},
                                         {"type": "tool_result", "tool_use_id": "nope", "content": "2"}]}]})
    assert wrong.status_code == 400 and wrong.json()["error"]["message"].startswith("messages[2].content[1]")
    # A block or a tool_choice that lacks a field is told in the Messages API's own terms.
    hi = {"role": "user", "content": "hi"}
    for turns, tool_choice, says in (
            ([{"role": "user", "content": [{"type": "text"}]}], None, "messages[0].content[0]: a text block needs its text"),
            ([hi], {"type": "tool"}, 'tool_choice {"type": "tool"} needs the name'),
            ([hi, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "input": {}}]}], None,
             "messages[1].content[0]: a tool_use block needs its name"),
            ([hi, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "count"}]}], None,
             "messages[1].content[0]: a tool_use block needs its input"),  # (as Anthropic's API requires it)
            ([{"role": "user", "content": [use]}], None, "'tool_use' blocks are not supported here in user messages")):
        body = {"model": MODEL, "max_tokens": 4, "messages": turns, "tools": [COUNT],
                **({"tool_choice": tool_choice} if tool_choice else {})}
        r = server.client.post("/v1/messages", headers={"x-api-key": KEY}, json=body)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    openai_shape = server.client.post("/v1/chat/completions", json={}, headers={"x-api-key": "wrong"}).json()
    assert "type" not in openai_shape and openai_shape["error"]["code"] == "invalid_api_key"


def test_anthropics_rules_for_its_own_fields(server: LiveServer) -> None:
    """What Anthropic's API refuses is refused (its ranges, its thinking, its tools and tool_choice), and
    extended thinking is off unless asked, as Anthropic's default is (Qwen's enable_thinking)."""
    from mtpipe.coordinator.api.messages_api import chat_body
    from mtpipe.coordinator.api.models import MessagesRequest

    hi = [{"role": "user", "content": "hi"}]
    for extra, param in (({"temperature": 1.5}, "temperature"), ({"thinking": {"type": "bogus"}}, "thinking.type"),
                         ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking.budget_tokens"),
                         ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking.budget_tokens"),
                         ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
                         ({"tools": [COUNT], "tool_choice": {"type": "bogus"}}, "tool_choice.type")):
        r = server.client.post("/v1/messages", headers={"x-api-key": KEY},
                               json={"model": MODEL, "max_tokens": 1100, "messages": hi, **extra})
        assert r.status_code == 400 and r.json()["type"] == "error", (extra, r.text)
        assert param in r.json()["error"]["message"], (extra, r.text)
    assert "auto, any, tool or none" in r.json()["error"]["message"]

    def thinks(**extra: Any) -> Any:
        asked = {"model": MODEL, "max_tokens": 2048, "messages": hi, **extra}
        chat, _ = chat_body(MessagesRequest.model_validate(asked))
        return chat.chat_template_kwargs["enable_thinking"]

    assert thinks() is False and thinks(thinking={"type": "disabled"}) is False
    assert thinks(thinking={"type": "enabled", "budget_tokens": 1024}) is True and thinks(thinking={"type": "adaptive"})
    assert thinks(chat_template_kwargs={"enable_thinking": True}) is True  # (the template's own variables win)


def test_a_forced_tool_use_cut_short_is_a_tool_use_block(claude: Any) -> None:
    """max_tokens ends a forced call before it closes: a tool_use block (its input what parses), not the
    call's JSON as text, and stop_reason max_tokens, as Anthropic's API answers."""
    m = claude.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, tools=[COUNT],
                               tool_choice={"type": "tool", "name": COUNT["name"]},
                               messages=[{"role": "user", "content": PROMPT}])
    assert m.stop_reason == "max_tokens" and [b.type for b in m.content] == ["tool_use"], m.content
    assert m.content[0].name == COUNT["name"] and isinstance(m.content[0].input, dict)
    # The input as far as it came, as the client's own stream accumulator builds it from the same parts.
    inputs = []
    for budget in range(4, 12):
        ask = {"model": MODEL, "max_tokens": budget, "extra_body": GREEDY, "tools": [COUNT],
               "tool_choice": {"type": "tool", "name": COUNT["name"]}, "messages": [{"role": "user", "content": PROMPT}]}
        whole = claude.messages.create(**ask)
        with claude.messages.stream(**ask) as stream:
            streamed = stream.get_final_message()
        assert [b.input for b in streamed.content] == [b.input for b in whole.content], (budget, whole.content)
        inputs += [b.input for b in whole.content if whole.stop_reason == "max_tokens"]
    assert any(inputs), inputs  # (one cut after a whole value, on this model)


def test_malformed_blocks_and_fields_are_400s_naming_the_field(server: LiveServer) -> None:
    """A block or a field of the wrong type (a list as a block's type, true as its thinking) is a 400 in
    Anthropic's shape naming that field, on both paths that read the body, never a 500."""
    hi = {"role": "user", "content": "hi"}

    def said(role: str, *blocks: dict[str, Any]) -> list[dict[str, Any]]:
        return [hi, {"role": role, "content": list(blocks)}] if role == "assistant" else [{"role": role,
                                                                                           "content": list(blocks)}]

    use = {"type": "tool_use", "id": "t1", "name": "count", "input": {"days": 1}}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"messages": said("user", {"type": ["text"], "text": "hi"})}, "messages[0].content[0].type"),
        ({"messages": said("user", {"type": {"a": 1}, "text": "hi"})}, "messages[0].content[0].type"),
        ({"messages": said("user", {"type": 3, "text": "hi"})}, "messages[0].content[0].type"),
        ({"messages": said("user", {"type": "text", "text": ["hi"]})}, "messages[0].content[0].text"),
        *[({"messages": said("assistant", {"type": "thinking", "thinking": bad, "signature": ""})},
           "messages[1].content[0].thinking") for bad in (True, -1, ["x"], {"x": 1})],
        ({"messages": said("assistant", {"type": "thinking", "thinking": "x", "signature": 5})},
         "messages[1].content[0].signature"),
        ({"messages": said("assistant", {"type": "redacted_thinking", "data": {}})}, "messages[1].content[0].data"),
        ({"messages": said("assistant", {**use, "id": 7})}, "messages[1].content[0].id"),
        ({"messages": said("assistant", {**use, "name": ["count"]})}, "messages[1].content[0].name"),
        *[({"messages": said("assistant", {**use, "input": bad})}, "messages[1].content[0].input")
          for bad in ([1], "{}", 3)],
        ({"messages": said("user", {"type": "tool_result", "tool_use_id": ["t1"], "content": "1"})},
         "messages[0].content[0].tool_use_id"),
        *[({"messages": said("user", {"type": "tool_result", "tool_use_id": "t1", "content": bad})},
           "messages[0].content[0].content") for bad in (0, False, {"a": 1}, [{"type": "text", "text": 1}], [["x"]])],
        ({"messages": said("user", {"type": "tool_result", "tool_use_id": "t1", "content": "1", "is_error": "yes"})},
         "messages[0].content[0].is_error"),
        ({"messages": [hi], "system": [{"type": ["text"], "text": "S"}]}, "system"),
        ({"messages": [hi], "tools": [COUNT], "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}},
         "tool_choice.disable_parallel_tool_use"),
        ({"messages": [hi], "tools": [COUNT], "tool_choice": {"type": ["auto"]}}, "tool_choice.type"),
        ({"messages": [hi], "tools": [COUNT], "tool_choice": {"type": "tool", "name": {"n": 1}}}, "tool_choice.name"),
        ({"messages": [hi], "tools": [{**COUNT, "name": ["count"]}]}, "tools[0].name"),
        ({"messages": [hi], "tools": [{**COUNT, "type": ["custom"]}]}, "tools[0]"),
        ({"messages": [hi], "thinking": {"type": ["enabled"]}}, "thinking.type"),
        ({"messages": [hi], "output_config": ["json"]}, "output_config"),
        ({"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role"),
    ]
    for extra, field in cases:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = server.client.post(path, headers={"x-api-key": KEY}, json={"model": MODEL, "max_tokens": 4, **extra})
            assert r.status_code == 400, (path, extra, r.text)
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error", r.text
            assert field in r.json()["error"]["message"], (path, extra, r.text)


def test_models_in_anthropics_shape_for_its_clients(server: LiveServer, claude: Any, client: Any) -> None:
    """Anthropic's clients (they send anthropic-version) read /v1/models as ModelInfo, with Anthropic's 404;
    OpenAI's get OpenAI's model objects, as before."""
    from datetime import datetime, timezone

    (info,) = list(claude.models.list())
    page = claude.models.list()
    assert (page.has_more, page.first_id, page.last_id) == (False, MODEL, MODEL)
    assert (info.type, info.id, info.display_name) == ("model", MODEL, MODEL)
    assert info.created_at.tzinfo is not None and abs(info.created_at - datetime.now(timezone.utc)).days < 1
    assert claude.models.retrieve(MODEL) == info
    assert claude.models.list(after_id=MODEL).data == []
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.models.retrieve("claude-x")
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    refused = server.client.get("/v1/models", headers={"x-api-key": "wrong", "anthropic-version": "2023-06-01"})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    # Without the header: OpenAI's shapes
    (card,) = client.models.list().data
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "mtpipe") and isinstance(card.created, int)
    missing = server.client.get("/v1/models/claude-x", headers={"x-api-key": KEY})
    assert missing.status_code == 404 and "type" not in missing.json()
    assert missing.json()["error"]["code"] == "model_not_found"


def test_count_tokens_counts_what_no_reply_fits(server: LiveServer, claude: Any, engine: BatchEngine) -> None:
    """count_tokens counts a conversation past the context and a body with any max_tokens (clients ask it
    to learn that a conversation has outgrown the context), as the prompt a Message would be fed."""
    long = [{"role": "user", "content": "one two three " * engine.max_context}]
    fed = server.client.post("/tokenize", json={"messages": long}, headers={"x-api-key": KEY}).json()["count"]
    assert fed > engine.max_context
    assert claude.messages.count_tokens(model=MODEL, messages=long).input_tokens == fed
    with pytest.raises(anthropic.BadRequestError):  # (a reply to it has no room)
        claude.messages.create(model=MODEL, max_tokens=4, messages=long)
    hi = [{"role": "user", "content": "hi"}]
    short = claude.messages.count_tokens(model=MODEL, messages=hi).input_tokens
    for extra in ({"max_tokens": 10**9}, {"max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 4096}}):
        r = server.client.post("/v1/messages/count_tokens", headers={"x-api-key": KEY},
                               json={"model": MODEL, "messages": hi, **extra})
        assert r.status_code == 200 and r.json()["input_tokens"] >= short, (extra, r.text)
    # A forced tool's prompt (its instruction too) is counted as the Message's prompt is.
    ask = {"model": MODEL, "tools": [COUNT], "tool_choice": {"type": "tool", "name": "count"}, "messages": hi}
    m = claude.messages.create(**ask, max_tokens=4, extra_body=GREEDY)
    assert claude.messages.count_tokens(**ask).input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
