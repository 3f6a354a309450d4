"""The OpenAI-compatible API against a live uvicorn server on loopback.

One server runs for the module over a 2-stage in-process pipeline of the tiny dense checkpoint;
the official `openai` client and raw httpx talk to it. Greedy requests are compared with a direct
`engine.complete` of the same request.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from helpers import PROMPTS, LiveServer  # noqa: E402
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from mtpipe.coordinator.api.app import create_app  # noqa: E402
from mtpipe.coordinator.api.serve import nodes_cluster_info  # noqa: E402
from mtpipe.coordinator.engine.batch import BatchEngine  # noqa: E402
from mtpipe.coordinator.engine.build import batch_engine  # noqa: E402
from mtpipe.coordinator.engine.engine import Engine  # noqa: E402
from mtpipe.coordinator.engine.request import GenerationRequest  # noqa: E402
from mtpipe.node.protocol import SamplingParams  # noqa: E402

MODEL = "tiny-dense"
KEY = "test-key-123"


@pytest.fixture(scope="module")
def engine(dense_ckpt: Path) -> BatchEngine:
    return batch_engine(dense_ckpt, stages=2, dtype=mx.float32)


@pytest.fixture(scope="module")
def server(engine: BatchEngine) -> Iterator[LiveServer]:
    with LiveServer(create_app(engine, MODEL)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def direct(engine: Engine, tokens: list[int], max_tokens: int, depth: int = 2) -> Any:
    return engine.complete(GenerationRequest(tokens, max_tokens, SamplingParams(temperature=0.0), mtp_depth=depth))


def active(engine: BatchEngine) -> list[int]:
    """Sequences each stage holds, read on the engine's MLX thread."""
    return engine.thread.call(lambda: [stage.sequences for stage in engine.stages])


def wait_idle(engine: Engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(active(engine)):
        assert time.monotonic() < deadline, f"sequences still held by the stages: {active(engine)}"
        time.sleep(0.02)


def sse_events(lines: Iterator[str]) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


class Scrape:
    """One `GET /metrics`, parsed by prometheus_client's own parser."""

    def __init__(self, url: str):
        r = httpx.get(url + "/metrics")
        assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPE_LATEST
        self.text = r.text
        self.families = {f.name: f for f in text_string_to_metric_families(r.text)}
        self.samples = {(s.name, frozenset(s.labels.items())): s.value
                        for f in self.families.values() for s in f.samples}

    def __call__(self, name: str, **labels: str) -> float:
        """A sample's value; KeyError when the series is not exposed."""
        return self.samples[(name, frozenset(labels.items()))]

    def get(self, name: str, default: float = 0.0, **labels: str) -> float:
        return self.samples.get((name, frozenset(labels.items())), default)


# -- the official client ----------------------------------------------------------------------


def test_models_and_health(server: LiveServer, client: Any) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    card = httpx.get(server.url + f"/v1/models/{MODEL}").json()  # (vLLM's fields too: clients read the context there)
    assert card["max_model_len"] == card["max_context"] > 0 and card["root"] == MODEL and card["parent"] is None
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL and health["mtp"] is True


def test_chat(engine: Engine, client: Any) -> None:
    messages = chat(PROMPTS[0])
    ref = direct(engine, engine.encode_chat(messages), 12)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                       response_format={"type": "text"})  # (the one format served)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == ref.stats.prompt_tokens
    assert r.usage.completion_tokens == ref.stats.generation_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # all but the prompt's last token came from the prefix the direct run kept (coordinator/engine/batch.py)
    assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1
    mtp = r.usage.model_extra["mtp"]
    # The default depth is auto: the rounds it reports add up, whatever depths it picked.
    assert mtp["depth"] == "auto" and sum(mtp["depths"].values()) == mtp["rounds"]
    assert mtp["drafted"] == sum(int(k) * n for k, n in mtp["depths"].items()) >= mtp["accepted"]
    assert not any(active(engine))


def test_an_assistants_refusal_part_is_its_text(client: Any) -> None:
    """A refused turn sent back (OpenAI's assistant content part {"type": "refusal"}) reads as the
    assistant's text; a user's refusal part is a 400."""
    def prompt_tokens(content: Any, **more: Any) -> int:
        messages = [*chat("x"), {"role": "assistant", "content": content, **more}, *chat("why?")]
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens

    refused = prompt_tokens([{"type": "refusal", "refusal": "I can't help with that."}])
    assert refused == prompt_tokens("I can't help with that.") > prompt_tokens("")
    assert prompt_tokens(None, refusal="I can't help with that.") == refused  # (the reply's own field, sent back)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}])
    assert e.value.body["param"] == "messages" and "'refusal'" in e.value.body["message"]


def test_chat_stream(engine: Engine, client: Any) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPTS[1]}]
    ref = direct(engine, engine.encode_chat(messages), 12, depth=1)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"mtp_depth": 1},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.stats.generation_tokens
    assert chunks[-1].usage.model_extra["mtp"]["depth"] == 1
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    # vLLM's continuous_usage_stats: every chunk with its choice's usage so far, the last one's the whole
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"mtp_depth": 1})
    chunks = list(stream)
    counts = [c.usage.completion_tokens for c in chunks[:-1]]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == chunks[-1].usage.completion_tokens
    assert {(c.usage.prompt_tokens, c.usage.total_tokens - c.usage.completion_tokens) for c in chunks} == {
        (chunks[-1].usage.prompt_tokens, chunks[-1].usage.prompt_tokens)}


def test_completions(engine: Engine, client: Any) -> None:
    tokens = engine.tokenizer.encode(PROMPTS[2])
    ref = direct(engine, tokens, 10, depth=0)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=10, temperature=0,
                                  extra_body={"mtp_depth": 0})
    assert r.object == "text_completion" and r.choices[0].text == ref.text
    assert r.usage.prompt_tokens == len(tokens) and r.usage.model_extra["mtp"]["drafted"] == 0
    # Token ids as the prompt, streamed.
    stream = client.completions.create(model=MODEL, prompt=tokens, max_tokens=10, temperature=0, stream=True,
                                       extra_body={"mtp_depth": 0})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason
    # OpenAI's other two forms, a list of one prompt: of text, of token ids.
    for prompt in ([PROMPTS[2]], [tokens]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                      extra_body={"mtp_depth": 0})
        assert r.choices[0].text == ref.text and r.usage.prompt_tokens == len(tokens)


def test_stop_and_seeded_sampling(engine: Engine, client: Any) -> None:
    messages = chat(PROMPTS[3])
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    assert len(text) >= 5
    stop = text[3:5]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == text[: text.find(stop)]
    a, b = (client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.9,
                                           top_p=0.9, seed=7, extra_body={"top_k": 50, "min_p": 0.01})
            for _ in range(2))
    assert a.choices[0].message.content == b.choices[0].message.content
    # Any int64 seed, -1 included (some clients send it), reproduces; null flags are false (OpenAI's schema).
    negative = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.9,
                                               seed=-1, extra_body={"stream": None, "stream_options": None})
                for _ in range(2)]
    assert negative[0].choices[0].message.content == negative[1].choices[0].message.content
    # ...and is a seed of its own: -1 is not 2^63 - 1 (as it was taken modulo 2^63)
    top = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.9, seed=2**63 - 1)
    assert top.choices[0].message.content != negative[0].choices[0].message.content
    # top_k -1 is "off", as clients written for vLLM send it: the same draws as no top_k at all
    off, unset = (client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.9,
                                                 seed=7, extra_body=extra) for extra in ({"top_k": -1}, {}))
    assert off.choices[0].message.content == unset.choices[0].message.content


# -- raw HTTP: the SSE wire format ----------------------------------------------------------------


def test_null_flags_are_false(server: LiveServer) -> None:
    body = {"model": MODEL, "messages": chat("hi"), "max_tokens": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": None}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and '"usage"' not in r.read().decode()
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": None})
    assert r.status_code == 200 and r.json()["object"] == "text_completion"


def test_sse_wire_format(server: LiveServer) -> None:
    body = {"model": MODEL, "messages": chat("hi"), "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(p["object"] == "chat.completion.chunk" and "usage" not in p for p in payloads)
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-1]["choices"][0]["finish_reason"] == "length" and payloads[-1]["choices"][0]["delta"] == {}


# -- concurrency and disconnects ------------------------------------------------------------------


def chat_one(client: Any, messages: list, max_tokens: int, stream: bool) -> str:
    """One greedy chat completion through the openai client, streamed or not; returns its text."""
    if stream:
        chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content


def test_eight_concurrent_requests(engine: Engine, server: LiveServer, client: Any) -> None:
    n, max_tokens = 8, 10
    prompts = [chat(p) for p in PROMPTS[:n]]
    refs = [direct(engine, engine.encode_chat(m), max_tokens).text for m in prompts]
    results: list[str | None] = [None] * n
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = chat_one(client, prompts[i], max_tokens, stream=bool(i % 2))
        except BaseException as e:  # reported below
            errors.append(e)

    peak, health_ms, done = [0], [], threading.Event()

    def watch() -> None:  # how many sequences run at once
        while not done.is_set():
            peak[0] = max(peak[0], *active(engine))
            time.sleep(0.005)

    def ask() -> None:  # whether the event loop still answers (apart: a slow answer hides no overlap)
        while not done.is_set():
            t0 = time.perf_counter()
            httpx.get(server.url + "/health", timeout=10)
            health_ms.append(1000 * (time.perf_counter() - t0))
            time.sleep(0.02)

    watcher, asker = threading.Thread(target=watch), threading.Thread(target=ask)
    watcher.start()
    asker.start()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    done.set()
    watcher.join()
    asker.join()
    assert not errors, errors
    assert results == refs
    assert peak[0] >= 4, f"requests did not overlap (at most {peak[0]} at once)"
    assert health_ms and max(health_ms) < 2000, max(health_ms)
    assert not any(active(engine))
    assert Scrape(server.url)("mtpipe_generations_in_flight") == 0


def test_streaming_disconnect_frees_caches(engine: Engine, server: LiveServer) -> None:
    wait_idle(engine)
    body = {"model": MODEL, "messages": chat("go on"), "max_tokens": 3000, "temperature": 0, "stream": True}
    cancelled = Scrape(server.url)("mtpipe_generations_cancelled_total")
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 4:
                    assert any(active(engine))  # mid-generation
                    break
    wait_idle(engine)
    steps = engine.pipeline.stages[-1].stats.steps
    time.sleep(0.3)
    assert engine.pipeline.stages[-1].stats.steps == steps  # the generation stopped
    assert Scrape(server.url)("mtpipe_generations_cancelled_total") == cancelled + 1


def test_non_streaming_disconnect_frees_caches(engine: Engine, server: LiveServer) -> None:
    wait_idle(engine)
    never_ends = {str(t): -100 for t in engine.eos}  # only max_tokens ends it
    body = {"model": MODEL, "messages": chat("go on"), "max_tokens": 3000, "temperature": 0, "logit_bias": never_ends}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.8))
    wait_idle(engine)
    steps = engine.pipeline.stages[-1].stats.steps
    time.sleep(0.3)
    assert engine.pipeline.stages[-1].stats.steps == steps


def test_a_request_waiting_for_a_slot_leaves_with_its_client_or_gets_a_503(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every generation slot taken, a waiting request whose client leaves never runs, and one that
    waits past the slot timeout gets a 503 with Retry-After, streamed or not."""
    from mtpipe.coordinator.api import service

    wait_idle(engine)
    opened: list[Any] = []

    class Counting:  # the engine, counting the generations the API starts on it
        def __getattr__(self, name: str) -> Any:
            return getattr(engine, name)

        def open(self, req: Any, sink: Any) -> Any:
            opened.append(req)
            return engine.open(req, sink)

    monkeypatch.setattr(service, "SLOT_TIMEOUT_S", 1.0)
    never_ends = {str(t): -100 for t in engine.eos}
    long = {"model": MODEL, "messages": chat("go on"), "max_tokens": 3000, "temperature": 0, "logit_bias": never_ends}
    short = {"model": MODEL, "messages": chat("hi"), "max_tokens": 2, "temperature": 0}
    url = "/v1/chat/completions"
    with LiveServer(create_app(Counting(), MODEL, max_concurrency=1)) as s:
        holding, done = threading.Event(), threading.Event()

        def hold() -> None:  # streams until the test is done with the slot, then leaves
            with httpx.stream("POST", s.url + url, json={**long, "stream": True}, timeout=30) as r:
                lines = r.iter_lines()  # (kept: a dropped iterator closes the response)
                next(lines)
                holding.set()
                done.wait(30)

        holder = threading.Thread(target=hold)
        holder.start()
        assert holding.wait(30)
        with pytest.raises(httpx.ReadTimeout):  # its client leaves while it waits
            httpx.post(s.url + url, json=short, timeout=httpx.Timeout(30, read=0.4))
        for stream in (False, True):
            r = httpx.post(s.url + url, json={**short, "stream": stream}, timeout=30)
            assert r.status_code == 503 and r.headers["Retry-After"], r.text
            assert r.json()["error"]["code"] == "server_busy"
        done.set()
        holder.join()
        wait_idle(engine)
    # only the one that held the slot ever ran (the one whose client left had given its place up before
    # the 503s were answered)
    assert len(opened) == 1


# -- bad input: OpenAI error bodies, nothing touched ----------------------------------------------

M = chat("hi")
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
BAD = [
    # (id, endpoint, body (bytes or JSON-able), status, param)
    ("invalid-json", CHAT, b'{"model": ', 400, None),
    ("empty-body", CHAT, b"", 400, None),
    ("not-an-object", CHAT, [1, 2], 400, None),
    ("missing-messages", CHAT, {"model": MODEL}, 400, "messages"),
    ("messages-not-a-list", CHAT, {"messages": "hi"}, 400, "messages"),
    ("bad-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("content-int", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("temperature-str", CHAT, {"messages": M, "temperature": "hot"}, 400, "temperature"),
    ("temperature-nan", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400,
     "temperature"),
    ("max-tokens-str", CHAT, {"messages": M, "max_tokens": "10"}, 400, "max_tokens"),
    ("max-tokens-float", CHAT, {"messages": M, "max_tokens": 1.5}, 400, "max_tokens"),
    ("stream-str", CHAT, {"messages": M, "stream": "yes"}, 400, "stream"),
    ("stop-int", CHAT, {"messages": M, "stop": 3}, 400, "stop"),
    ("unknown-model", CHAT, {"model": "gpt-4o", "messages": M}, 404, "model"),
    ("unknown-model-text", TEXT, {"model": "gpt-4o", "prompt": "x"}, 404, "model"),
    ("empty-messages", CHAT, {"messages": []}, 400, "messages"),
    ("image-part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("text-part-without-text", CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages"),
    ("user-without-content", CHAT, {"messages": [{"role": "user"}]}, 400, "messages"),
    ("max-tokens-zero", CHAT, {"messages": M, "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-negative", CHAT, {"messages": M, "max_tokens": -5}, 400, "max_tokens"),
    ("max-completion-tokens-zero", CHAT, {"messages": M, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("max-tokens-beyond-context", CHAT, {"messages": M, "max_tokens": 10**9}, 400, "max_tokens"),
    ("max-tokens-beyond-context-text", TEXT, {"prompt": "x", "max_tokens": 4096}, 400, "max_tokens"),
    ("prompt-longer-than-context", TEXT, {"prompt": [5] * 4096}, 400, "prompt"),
    ("no-room-for-drafts", TEXT, {"prompt": [5] * 4094, "mtp_depth": 2, "max_tokens": 2}, 400, "mtp_depth"),
    ("chat-longer-than-context", CHAT, {"messages": chat("a b c d " * 1500)}, 400, "messages"),
    ("temperature-negative", CHAT, {"messages": M, "temperature": -0.5}, 400, "temperature"),
    ("top-p-zero", CHAT, {"messages": M, "top_p": 0}, 400, "top_p"),
    ("top-p-above-one", CHAT, {"messages": M, "top_p": 1.5}, 400, "top_p"),
    ("top-p-text", TEXT, {"prompt": "x", "top_p": -1}, 400, "top_p"),
    ("top-k-negative", CHAT, {"messages": M, "top_k": -2}, 400, "top_k"),
    ("min-p-above-one", CHAT, {"messages": M, "min_p": 2.0}, 400, "min_p"),
    ("seed-beyond-int64", CHAT, {"messages": M, "seed": 2**63}, 400, "seed"),
    ("seed-below-int64", CHAT, {"messages": M, "seed": -(2**63) - 1}, 400, "seed"),
    ("n-zero", CHAT, {"messages": M, "n": 0}, 400, "n"),
    ("n-past-the-most", CHAT, {"messages": M, "n": 257}, 400, "n"),
    ("choices-past-the-most", TEXT, {"prompt": ["x"] * 86, "n": 3}, 400, "n"),
    ("prompts-past-the-most", TEXT, {"prompt": ["x"] * 257}, 400, "prompt"),
    ("best-of-more-than-n", TEXT, {"prompt": "x", "n": 2, "best_of": 3}, 400, "best_of"),
    ("mtp-depth-negative", CHAT, {"messages": M, "mtp_depth": -1}, 400, "mtp_depth"),
    ("mtp-depth-too-deep", CHAT, {"messages": M, "mtp_depth": 99}, 400, "mtp_depth"),
    ("too-many-stops", CHAT, {"messages": M, "stop": [str(i) for i in range(17)]}, 400, "stop"),
    ("top_logprobs without logprobs", CHAT, {"messages": M, "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs-negative", CHAT, {"messages": M, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    ("top_logprobs-21", CHAT, {"messages": M, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("empty-prompt", TEXT, {"prompt": ""}, 400, "prompt"),
    ("empty-token-prompt", TEXT, {"prompt": []}, 400, "prompt"),
    ("token-out-of-vocab", TEXT, {"prompt": [1, 10**6]}, 400, "prompt"),
    ("second-prompt-empty", TEXT, {"prompt": ["a", ""]}, 400, "prompt[1]"),
    ("second-token-prompt-empty", TEXT, {"prompt": [[5, 6], []]}, 400, "prompt[1]"),
    ("second-token-prompt-out-of-vocab", TEXT, {"prompt": [[5, 6], [1, 10**6]]}, 400, "prompt[1]"),
    ("empty-token-prompt-in-a-list", TEXT, {"prompt": [[]]}, 400, "prompt"),
    ("mixed-prompt", TEXT, {"prompt": [1, "a"]}, 400, "prompt"),
    ("max-tokens-0-without-echo", TEXT, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("prompt-logprobs-21", TEXT, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("prompt-logprobs-all", CHAT, {"messages": M, "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ("echo-prompt-logprobs-all", TEXT, {"prompt": "x", "echo": True, "logprobs": 1, "prompt_logprobs": -1}, 400,
     "prompt_logprobs"),
    ("suffix", TEXT, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("logit-bias-id-twice", CHAT, {"messages": M, "logit_bias": {"10": 5, "010": -5}}, 400, "logit_bias"),
    ("stream-options-without-stream", CHAT,
     {"messages": M, "stream": False, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("completion-logprobs-negative", TEXT, {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ("completion-logprobs-21", TEXT, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("response-format-xml", CHAT, {"messages": M, "response_format": {"type": "xml"}}, 400, "response_format"),
    ("json-schema-text", TEXT, {"prompt": "x", "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("json-schema-nested-too-deeply", CHAT, {"messages": M, "guided_json": "[" * 3000 + "]" * 3000}, 400,
     "guided_json"),
    ("structured-json-nested-too-deeply", CHAT,
     {"messages": M, "structured_outputs": {"json": "[" * 3000 + "]" * 3000}}, 400, "structured_outputs"),
    ("legacy-functions", CHAT, {"messages": M, "functions": [{"name": "f", "parameters": {}}]}, 400, "functions"),
    ("legacy-function-call", CHAT, {"messages": M, "function_call": "auto"}, 400, "function_call"),
    ("repetition-penalty-tiny", TEXT, {"prompt": "a a a", "repetition_penalty": 1e-38, "logprobs": 1}, 400,
     "repetition_penalty"),
]


@pytest.mark.parametrize("endpoint,body,status,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(
    engine: Engine, server: LiveServer, endpoint: str, body: Any, status: int, param: str | None
) -> None:
    wait_idle(engine)
    steps = [s.stats.steps for s in engine.pipeline.stages]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    for stream in (False, True):
        if stream and isinstance(body, dict) and "stream" not in body:
            content = json.dumps({**body, "stream": True}).encode()
        r = server.client.post(endpoint, content=content, headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        assert error["param"] == param, error
        assert set(error) == {"message", "type", "param", "code"}
    assert [s.stats.steps for s in engine.pipeline.stages] == steps  # no node was touched
    assert not any(active(engine))


def test_bad_input_through_client(client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="n must be at least 1"):
        client.chat.completions.create(model=MODEL, messages=M, n=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=M)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=10**6)
    assert e.value.code == "context_length_exceeded"
    # (in vLLM's words, which clients such as LiteLLM look for to shorten a conversation)
    assert "This model's maximum context length is" in e.value.body["message"]
    r = client.chat.completions.create(model=MODEL, messages=M, max_tokens=1, top_logprobs=0)  # (asks for nothing)
    assert r.choices[0].logprobs is None
    r = client.chat.completions.create(model=MODEL, messages=M, max_tokens=2.0, seed=7.0)  # (whole floats, as vLLM)
    assert r.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=M, max_completion_tokens=10**6)
    assert "for max_completion_tokens" in e.value.body["message"] and e.value.body["param"] == "max_completion_tokens"


def test_auto_depth_drafts_only_where_the_context_leaves_room(engine: BatchEngine, client: Any) -> None:
    """A request that fits the context without drafts is served under the default depth (auto): its
    depth shrinks to the room left, instead of the request being refused for drafts it did not ask for."""
    prompt = [5 + i % 50 for i in range(engine.max_context - 6)]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5 and max(map(int, r.usage.model_extra["mtp"]["depths"])) <= 1  # (6 - 5)
    with pytest.raises(openai.BadRequestError) as e:  # a fixed depth still needs its room
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, extra_body={"mtp_depth": 2})
    assert e.value.code == "context_length_exceeded"


def test_truncate_prompt_tokens_keeps_the_last_and_what_is_not_done_is_named(engine: BatchEngine, client: Any) -> None:
    """vLLM's truncate_prompt_tokens: the last N prompt tokens go in (-1: what the context holds), as if
    only they had been sent; vLLM's bad_words, allowed_token_ids and beam search are a 400, not left out."""
    tokens = engine.tokenizer.encode(PROMPTS[0])
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True,
                                    extra_body={"truncate_prompt_tokens": 6})
    alone = client.completions.create(model=MODEL, prompt=tokens[-6:], max_tokens=4, temperature=0)
    assert cut.usage.prompt_tokens == 6 and cut.choices[0].text.endswith(alone.choices[0].text)
    assert cut.choices[0].text.startswith(engine.tokenizer.decode(tokens[-6:]))  # (the prompt that went in)
    long = [5 + i % 50 for i in range(engine.max_context + 100)]
    r = client.completions.create(model=MODEL, prompt=long, max_tokens=1, extra_body={"truncate_prompt_tokens": 50})
    assert r.usage.prompt_tokens == 50
    r = client.chat.completions.create(model=MODEL, messages=M, max_tokens=1, extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3
    for extra in ({"truncate_prompt_tokens": 0}, {"bad_words": ["import"]}, {"allowed_token_ids": [1, 2]},
                  {"use_beam_search": True}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body=extra)
        assert e.value.body["param"] == next(iter(extra))


def test_unknown_route_and_method(server: LiveServer) -> None:
    r = httpx.get(server.url + "/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.delete(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


# -- cluster, metrics, key ---------------------------------------------------------------------------


def test_cluster_local(server: LiveServer) -> None:
    info = httpx.get(server.url + "/v1/cluster").json()
    stages = info["nodes"][0]["stages"]
    assert [s["layers"] for s in stages] == [[0, 2], [2, 4]]
    assert [p["layers"] for p in info["placement"]] == [[0, 2], [2, 4]]
    assert info["nodes"][0]["healthy"] is True and info["model"] == MODEL


def test_cluster_callable_and_failure(engine: Engine) -> None:
    def boom() -> dict:
        raise ConnectionError("node b unreachable")

    with LiveServer(create_app(engine, MODEL, cluster_info=lambda: {"placement": ["x"], "links": []})) as s:
        assert httpx.get(s.url + "/v1/cluster").json() == {"placement": ["x"], "links": []}
    with LiveServer(create_app(engine, MODEL, cluster_info=boom)) as s:
        r = httpx.get(s.url + "/v1/cluster")
        assert r.status_code == 503 and "unreachable" in r.json()["error"]["message"]


def test_metrics(engine: BatchEngine, server: LiveServer, client: Any) -> None:
    client.chat.completions.create(model=MODEL, messages=M, max_tokens=4, temperature=0)
    wait_idle(engine)
    m = Scrape(server.url)
    chat_endpoint = "/v1/chat/completions"
    assert m("mtpipe_requests_total", endpoint=chat_endpoint, status="200") >= 1
    assert m("mtpipe_requests_total", endpoint=chat_endpoint, status="400") >= 1
    assert m("mtpipe_prompt_tokens_total") > 0 and m("mtpipe_completion_tokens_total") >= 4
    assert m("mtpipe_mtp_drafted_tokens_total") > 0
    assert 0 <= m("mtpipe_mtp_acceptance_ratio") <= 1
    assert m("mtpipe_request_duration_seconds_count", endpoint=chat_endpoint) >= 1
    assert m("mtpipe_time_to_first_token_seconds_count", endpoint=chat_endpoint) >= 1
    assert "# TYPE mtpipe_request_duration_seconds histogram" in m.text
    # The scheduler's state, asked of the engine as the metrics are scraped (nothing runs or waits now).
    assert m("mtpipe_requests_running") == m("mtpipe_requests_waiting") == 0 and m("mtpipe_cache_usage_ratio") == 0
    assert m("mtpipe_preemptions_total") == 0 and m("mtpipe_scheduler_answered") == 1
    assert m("mtpipe_ready") == 1 and m("mtpipe_nodes_unready") == 0

    # The exposition's shape: what dashboards query, and no `_created` series.
    kinds = {
        "mtpipe_requests": "counter", "mtpipe_generations_cancelled": "counter",
        "mtpipe_generations_failed": "counter", "mtpipe_prompt_tokens": "counter",
        "mtpipe_prompt_tokens_cached": "counter", "mtpipe_preemptions": "counter",
        "mtpipe_completion_tokens": "counter", "mtpipe_mtp_drafted_tokens": "counter",
        "mtpipe_mtp_accepted_tokens": "counter", "mtpipe_generations_in_flight": "gauge",
        "mtpipe_mtp_acceptance_ratio": "gauge", "mtpipe_request_duration_seconds": "histogram",
        "mtpipe_time_to_first_token_seconds": "histogram", "mtpipe_decode_tokens_per_second": "histogram",
        "mtpipe_e2e_request_latency_seconds": "histogram", "mtpipe_time_per_output_token_seconds": "histogram",
        "mtpipe_requests_running": "gauge", "mtpipe_requests_waiting": "gauge", "mtpipe_cache_usage_ratio": "gauge",
        "mtpipe_scheduler_answered": "gauge", "mtpipe_generations_finished": "counter",
        "mtpipe_request_queue_time_seconds": "histogram", "mtpipe_request_prefill_time_seconds": "histogram",
        "mtpipe_request_decode_time_seconds": "histogram", "mtpipe_request_prompt_tokens": "histogram",
        "mtpipe_request_generation_tokens": "histogram", "mtpipe_ready": "gauge", "mtpipe_nodes_unready": "gauge",
    }
    assert {name: f.type for name, f in m.families.items()} == kinds
    assert all(f.documentation for f in m.families.values())
    assert not [s for s in m.samples if s[0].endswith("_created")]
    for counter in [name for name, kind in kinds.items() if kind == "counter"]:
        assert f"# TYPE {counter}_total counter" in m.text
    request_bounds = ["0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0", "30.0",
                      "60.0", "120.0", "300.0", "+Inf"]
    for histogram in ("mtpipe_request_duration_seconds", "mtpipe_time_to_first_token_seconds"):
        bounds = [dict(labels)["le"] for name, labels in m.samples
                  if name == histogram + "_bucket" and dict(labels)["endpoint"] == chat_endpoint]
        assert bounds == request_bounds
    bounds = [dict(labels)["le"] for name, labels in m.samples if name == "mtpipe_decode_tokens_per_second_bucket"]
    assert bounds == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0", "2000.0",
                      "+Inf"]


def test_the_schedulers_state_is_its_last_answer_when_the_engine_does_not_answer() -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from mtpipe.coordinator.api.metrics import ServerMetrics
    from mtpipe.coordinator.engine.scheduler import SchedulerState

    answers: list[Any] = [SchedulerState(3, 2, 0.5, 7), TimeoutError("no answer in 2 s")]

    def read() -> SchedulerState:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    metrics = ServerMetrics(read)  # (registered without asking the engine)
    for answered in (1, 0):
        text = generate_latest(metrics.registry).decode()
        got = {x.name: x.value for f in text_string_to_metric_families(text) for x in f.samples}
        assert got["mtpipe_scheduler_answered"] == answered
        assert (got["mtpipe_requests_running"], got["mtpipe_requests_waiting"]) == (3, 2)
        assert got["mtpipe_cache_usage_ratio"] == 0.5 and got["mtpipe_preemptions_total"] == 7
    assert not answers
    metrics.scheduled.queued = lambda: 4  # (requests waiting for a generation slot wait too, as vLLM counts them)
    text = generate_latest(metrics.registry).decode()
    assert {x.name: x.value for f in text_string_to_metric_families(text) for x in f.samples}[
        "mtpipe_requests_waiting"] == 6


def test_metrics_count_each_request(engine: Engine) -> None:
    """A fresh app (its own registry) counts exactly what its requests did and reported."""
    wait_idle(engine)
    with LiveServer(create_app(engine, MODEL)) as s:
        before = Scrape(s.url)
        assert before.get("mtpipe_requests_total", -1, endpoint="/v1/chat/completions", status="200") == -1
        assert before("mtpipe_prompt_tokens_total") == 0 and before("mtpipe_generations_in_flight") == 0
        assert before("mtpipe_mtp_acceptance_ratio") == 0  # nothing drafted yet

        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        usages = []
        # The stream first: the gate counts a request once its response has ended.
        stream = client.chat.completions.create(model=MODEL, messages=M, max_tokens=5, temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        usages.append(list(stream)[-1].usage)
        for max_tokens in (4, 6):  # a fixed depth drafts every round (auto may rightly draft nothing here)
            r = client.chat.completions.create(model=MODEL, messages=chat(PROMPTS[0]), max_tokens=max_tokens,
                                               temperature=0, extra_body={"mtp_depth": 2})
            usages.append(r.usage)
        usages.append(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0).usage)
        client.models.list()
        bad = httpx.post(s.url + "/v1/chat/completions", json={"messages": M, "max_tokens": 0})
        assert bad.status_code == 400
        wait_idle(engine)

        m = Scrape(s.url)
        chat_endpoint, text_endpoint = "/v1/chat/completions", "/v1/completions"
        assert m("mtpipe_requests_total", endpoint=chat_endpoint, status="200") == 3
        assert m("mtpipe_requests_total", endpoint=chat_endpoint, status="400") == 1
        assert m("mtpipe_requests_total", endpoint=text_endpoint, status="200") == 1
        assert m("mtpipe_requests_total", endpoint="/v1/models", status="200") == 1
        assert m.get("mtpipe_requests_total", endpoint=text_endpoint, status="400") == 0
        assert m("mtpipe_request_duration_seconds_count", endpoint=chat_endpoint) == 4
        assert m("mtpipe_request_duration_seconds_count", endpoint=text_endpoint) == 1
        assert m("mtpipe_request_duration_seconds_bucket", endpoint=chat_endpoint, le="+Inf") == 4
        assert m("mtpipe_request_duration_seconds_sum", endpoint=chat_endpoint) > 0
        assert m("mtpipe_time_to_first_token_seconds_count", endpoint=chat_endpoint) == 3  # the 400 ran nothing
        assert m("mtpipe_time_to_first_token_seconds_count", endpoint=text_endpoint) == 1

        assert m("mtpipe_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
        assert m("mtpipe_prompt_tokens_cached_total") == sum(u.prompt_tokens_details.cached_tokens for u in usages) > 0
        assert m("mtpipe_completion_tokens_total") == sum(u.completion_tokens for u in usages)
        mtp = [u.model_extra["mtp"] for u in usages]
        drafted, accepted = sum(x["drafted"] for x in mtp), sum(x["accepted"] for x in mtp)
        assert drafted > 0
        assert m("mtpipe_mtp_drafted_tokens_total") == drafted
        assert m("mtpipe_mtp_accepted_tokens_total") == accepted
        assert m("mtpipe_mtp_acceptance_ratio") == pytest.approx(accepted / drafted)
        decoded = sum(u.completion_tokens > 1 for u in usages)
        assert m("mtpipe_decode_tokens_per_second_count") == decoded == m("mtpipe_time_per_output_token_seconds_count")
        assert m("mtpipe_e2e_request_latency_seconds_count", endpoint=chat_endpoint) == 3  # (finished generations)
        assert m("mtpipe_e2e_request_latency_seconds_count", endpoint=text_endpoint) == 1
        assert m("mtpipe_generations_finished_total", finish_reason="length") == 4  # (each ran to its max_tokens)
        assert m("mtpipe_request_prompt_tokens_sum") == m("mtpipe_prompt_tokens_total")  # (every one finished)
        assert m("mtpipe_request_generation_tokens_sum") == m("mtpipe_completion_tokens_total")
        assert m("mtpipe_request_generation_tokens_bucket", le="5.0") == 3  # (5, 4 and 4 tokens; not 6)
        for phase in ("queue", "prefill", "decode"):
            assert m(f"mtpipe_request_{phase}_time_seconds_count") == 4
        # A generation's phases take no more than its whole time.
        phases = sum(m(f"mtpipe_request_{phase}_time_seconds_sum") for phase in ("queue", "prefill", "decode"))
        assert 0 < phases <= m("mtpipe_e2e_request_latency_seconds_sum", endpoint=chat_endpoint) + m(
            "mtpipe_e2e_request_latency_seconds_sum", endpoint=text_endpoint) + 1e-6
        assert m("mtpipe_generations_cancelled_total") == 0 and m("mtpipe_generations_failed_total") == 0

        deadline = time.monotonic() + 10  # a run's thread leaves the gauge just after its last token
        while (in_flight := Scrape(s.url)("mtpipe_generations_in_flight")) != 0:
            assert time.monotonic() < deadline, in_flight
            time.sleep(0.02)
        assert httpx.get(s.url + "/health").json()["in_flight"] == 0

        # A stream its client leaves after the first tokens counts them, its prompt and its first token's time.
        never_ends = {str(t): -100 for t in engine.eos}
        body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 400, "stream": True, "logit_bias": never_ends}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            next(line for line in r.iter_lines() if line.startswith("data: {"))
        wait_idle(engine)
        left = Scrape(s.url)
        assert left("mtpipe_generations_cancelled_total") == 1
        assert left("mtpipe_time_to_first_token_seconds_count", endpoint=text_endpoint) == 2
        assert left("mtpipe_prompt_tokens_total") == m("mtpipe_prompt_tokens_total") + len(engine.tokenizer.encode(
            PROMPTS[2]))
        assert m("mtpipe_completion_tokens_total") < left("mtpipe_completion_tokens_total")


def test_priority_needs_the_priority_policy_and_reaches_the_engine(engine: BatchEngine, client: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's `priority`: refused (400, naming it) by a server that schedules first come, first served; with
    `--scheduling-policy priority` each request's reaches the engine (which orders its queue by it)."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=M, max_tokens=2, extra_body={"priority": 3})
    assert refused.value.body["param"] == "priority" and "--scheduling-policy priority" in refused.value.body["message"]
    assert client.chat.completions.create(model=MODEL, messages=M, max_tokens=2,
                                          extra_body={"priority": 0}).usage.completion_tokens == 2
    seen: list[int] = []
    opened = engine.open
    monkeypatch.setattr(engine, "open", lambda req, *a, **kw: seen.append(req.priority) or opened(req, *a, **kw))
    with LiveServer(create_app(engine, MODEL, scheduling_policy="priority")) as s:
        by_priority = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = by_priority.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"priority": -5})
        assert r.usage.completion_tokens == 2 and seen == [-5]
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": M, "priority": "high"})
        assert r.status_code == 400  # (an integer, as vLLM's)


def test_api_key(engine: Engine) -> None:
    with LiveServer(create_app(engine, MODEL, api_key=KEY)) as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.post(s.url + "/v1/chat/completions", json={"messages": M}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/metrics").status_code == 200  # (open to a scraper, as vLLM's)
        assert httpx.post(s.url + "/ping").json()["status"] == "ok" and httpx.get(s.url + "/version").json()["version"]
        assert httpx.get(s.url + "/v1/cluster").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0)
        r = good.chat.completions.create(model=MODEL, messages=M, max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3


def test_browser_pages_may_call_the_api_where_allowed(engine: Engine) -> None:
    """CORS: a browser's preflight (no key) is answered, and responses (a 401 too, so a page can read
    it) name the origins allowed; the key is still required. With no origins allowed, no header."""
    page = {"Origin": "http://localhost:3000"}
    preflight = {**page, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with LiveServer(create_app(engine, MODEL, api_key=KEY)) as s:
        r = httpx.options(s.url + "/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": M}, headers=page)
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
        r = httpx.get(s.url + "/v1/models", headers={**page, "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert "retry-after" in r.headers["access-control-expose-headers"].lower()  # (a 503's, for the page)
        # a public page calling a server on a private address or localhost (Chrome's private-network preflight)
        r = httpx.options(s.url + "/v1/chat/completions", headers={**preflight,
                                                                   "Access-Control-Request-Private-Network": "true"})
        assert r.status_code == 200
    with LiveServer(create_app(engine, MODEL, cors_origins=["http://localhost:3000"])) as s:
        assert httpx.options(s.url + "/v1/models", headers=preflight).status_code == 200
        other = {**preflight, "Origin": "http://evil.example"}
        assert "access-control-allow-origin" not in httpx.options(s.url + "/v1/models", headers=other).headers
    with LiveServer(create_app(engine, MODEL, cors_origins=())) as s:
        r = httpx.get(s.url + "/v1/models", headers=page)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        assert httpx.options(s.url + "/v1/models", headers=preflight).status_code == 405


# -- `mtpipe serve` -------------------------------------------------------------------------------


def test_serve_command(dense_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mtpipe.coordinator.api import serve
    from mtpipe.coordinator.cli import main as cli

    seen: dict[str, Any] = {}

    def fake_serve(engine: Engine, host: str, port: int, **kwargs: Any) -> int:
        seen.update(engine=engine, host=host, port=port, **kwargs)
        return 0

    monkeypatch.setattr(serve, "serve", fake_serve)
    monkeypatch.setenv("MTPIPE_API_KEY", "from-env")
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # (no SIGTERM handler left in pytest)
    with socket.socket() as s:  # (a port free now: the command checks it before it loads)
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    assert cli.main(["serve", "--model", str(dense_ckpt), "--port", port, "--mtp-depth", "1"]) == 0
    assert seen["host"] == "127.0.0.1" and seen["port"] == int(port) and seen["api_key"] == "from-env"
    assert seen["model_name"] == dense_ckpt.name and seen["default_mtp_depth"] == 1
    assert seen["engine"].has_mtp
    assert seen["model_path"] == dense_ckpt and seen["api_process"]  # the API in a process of its own
    assert seen["stall_timeout"] == 120.0
    assert seen["cors_origins"] == ("*",)
    assert cli.main(["serve", "--model", str(dense_ckpt), "--port", port, "--api-in-process", "--stall-timeout", "0",
                     "--allowed-origins", "http://localhost:3000/,https://chat.example"]) == 0
    assert not seen["api_process"] and seen["stall_timeout"] is None
    assert seen["cors_origins"] == ("http://localhost:3000", "https://chat.example")
    assert cli.main(["serve", "--model", str(dense_ckpt), "--port", port, "--allowed-origins", "none"]) == 0
    assert seen["cors_origins"] == ()


# -- the same over a 2-node gRPC pipeline ------------------------------------------------------------


@pytest.fixture(scope="module")
def grpc_nodes(dense_ckpt: Path) -> Iterator[tuple[Engine, list[Any]]]:
    from mtpipe.coordinator.engine.build import remote_engine
    from mtpipe.node.server import NodeServer

    nodes = [NodeServer("127.0.0.1", 0).start() for _ in range(2)]
    engine = None
    try:
        engine = remote_engine(dense_ckpt, [n.address for n in nodes], dtype="float32")
        yield engine, nodes
    finally:
        if engine is not None:
            engine.pipeline.close()
        for n in nodes:
            n.stop()


def node_active(nodes: list[Any]) -> list[int]:
    return [len(n.service.worker.sequences) for n in nodes]


def wait_nodes_idle(nodes: list[Any], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(node_active(nodes)):
        assert time.monotonic() < deadline, f"sequences still held by the nodes: {node_active(nodes)}"
        time.sleep(0.02)


def test_grpc_pipeline_concurrency_and_disconnect(engine: Engine, grpc_nodes: tuple[Engine, list[Any]]) -> None:
    remote_engine, nodes = grpc_nodes
    n, max_tokens = 8, 10
    prompts = [chat(p) for p in PROMPTS[8 : 8 + n]]
    refs = [direct(engine, engine.encode_chat(m), max_tokens).text for m in prompts]  # the in-process pipeline
    results: list[str | None] = [None] * n
    errors: list[BaseException] = []
    with LiveServer(create_app(remote_engine, MODEL, cluster_info=nodes_cluster_info(remote_engine, MODEL))) as s:
        info = httpx.get(s.url + "/v1/cluster").json()
        assert info["healthy"] is True and [p["layers"] for p in info["placement"]] == [[0, 2], [2, 4]]
        assert [n["address"] for n in info["nodes"]] == [n.address for n in nodes]
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def one(i: int) -> None:
            try:
                results[i] = chat_one(client, prompts[i], max_tokens, stream=bool(i % 2))
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert results == refs
        wait_nodes_idle(nodes)

        body = {"model": MODEL, "messages": chat("go on"), "max_tokens": 3000, "temperature": 0, "stream": True}
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=30) as r:
            for i, line in enumerate(r.iter_lines()):
                if i >= 8:
                    assert any(node_active(nodes))
                    break
        wait_nodes_idle(nodes)
        steps = nodes[-1].service.worker.stats.steps
        time.sleep(0.3)
        assert nodes[-1].service.worker.stats.steps == steps


def test_stage_failure_is_a_503(engine: Engine) -> None:
    from mtpipe.node.protocol import StageError

    class Refusing:
        released: list[str] = []

        def step(self, req: Any) -> Any:
            raise StageError("too many active sequences (64)")

        def steps(self, reqs: list[Any]) -> list[Any]:
            return [self.step(r) for r in reqs]

        def release(self, seq_id: str) -> None:
            self.released.append(seq_id)

        def close(self) -> None:
            pass

    pipeline = Refusing()
    broken = Engine(pipeline, engine.tokenizer, engine.eos, engine.max_context, has_mtp=False)
    with LiveServer(create_app(broken, MODEL)) as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4})
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "server_error" and "too many" in r.json()["error"]["message"]
        body = {"prompt": "x", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body) as r:
            events = sse_events(r.iter_lines())
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "stage_error"
        assert Scrape(s.url)("mtpipe_generations_failed_total") == 2
    assert len(pipeline.released) == 2  # the engine's finally ran for both


def test_a_server_that_stops_drains_then_ends_open_streams_with_an_error(engine: Engine) -> None:
    """Ctrl-C or SIGTERM: a generation that would start from then on is refused (503), an open stream goes
    on for most of the grace period and then ends with a 503 error event and [DONE] (a stream that merely
    stopped would read as a finished one), and the engine lets the generation go."""
    from mtpipe.coordinator.api.front import ABORT_BEFORE_GRACE_END_S, api_server

    wait_idle(engine)
    never_ends = {str(t): -100 for t in engine.eos}
    long = {"model": MODEL, "messages": chat("go on"), "max_tokens": 3000, "temperature": 0, "logit_bias": never_ends}
    grace = 2.0
    app = create_app(engine, MODEL, max_concurrency=1)
    slots = app.state.service.slots  # (the one generation slot)
    live = LiveServer(server=api_server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None,
                                                       lifespan="off", timeout_graceful_shutdown=grace))).__enter__()
    server, thread, url = live.server, live.thread, live.url + "/v1/chat/completions"
    waiting: list[httpx.Response] = []
    with httpx.stream("POST", url, json={**long, "stream": True}, timeout=30) as r:
        lines = r.iter_lines()
        events = []
        for line in lines:
            if line.startswith("data: "):
                events.append(line[len("data: "):])
            if len(events) == 3:  # streaming; another request waits for the one slot: now stop the server
                waiter = threading.Thread(target=lambda: waiting.append(httpx.post(url, json=long, timeout=30)))
                waiter.start()
                deadline = time.monotonic() + 10
                while not slots.waiting:
                    assert time.monotonic() < deadline, "the second request never waited for the slot"
                    time.sleep(0.01)
                stopped_at = time.monotonic()
                server.handle_exit(signal.SIGTERM, None)
                break
        events += sse_events(lines)
    ended_after = time.monotonic() - stopped_at
    assert grace - ABORT_BEFORE_GRACE_END_S - 0.3 < ended_after < grace + 0.5, ended_after
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_busy" and "shutting down" in error["message"], error
    assert len(events) > 10  # (it streamed on while the server drained)
    waiter.join(10)
    assert waiting[0].status_code == 503 and "shutting down" in waiting[0].text, waiting[0].text
    thread.join(10)
    assert not thread.is_alive()
    wait_idle(engine)


def test_a_stop_leaves_a_finished_generation_alone_while_its_sequence_is_released() -> None:
    """A per-sequence engine is iterated on a thread, which releases the sequence on every node after the
    last chunk: a stop meanwhile must not turn the finished generation into an error."""
    import asyncio

    from mtpipe.coordinator.api.generation import GenerationThread, abort_all
    from mtpipe.coordinator.engine.request import GenerationChunk

    class Releasing:  # the last chunk, then a slow release
        def generate(self, req: GenerationRequest) -> Iterator[GenerationChunk]:
            try:
                yield GenerationChunk("done", [1], finish_reason="stop")
            finally:
                time.sleep(0.5)

    async def run() -> tuple[int, list[GenerationChunk]]:
        gen = GenerationThread(Releasing(), GenerationRequest([1, 2], max_tokens=4), on_exit=lambda run: None)
        gen.start()
        got = []
        async for chunk in gen.chunks():
            got.append(chunk)
            aborted = abort_all()  # (during the release)
        return aborted, got

    aborted, got = asyncio.run(run())
    assert aborted == 0 and [c.finish_reason for c in got] == ["stop"]


@pytest.mark.parametrize("given, origins", [
    ("*", ["*"]), ("none", []), (" None ", []), ("http://LOCALHOST:3000/", ["http://localhost:3000"]),
    ("https://chat.example:443,http://[::1]:80", ["https://chat.example", "http://[::1]"]),
    (["*", "http://a:8080"], ["*", "http://a:8080"]),
])
def test_allowed_origins_are_written_as_browsers_send_them(given: Any, origins: list[str]) -> None:
    from mtpipe.coordinator.api.defaults import check_origins

    assert check_origins(given) == origins


@pytest.mark.parametrize("given", ["https://*.example.com", "http://a/path", "ftp://x", "http://", "*,none",
                                   "localhost:3000", "http://a:99999", "", "http://user@a"])
def test_origins_that_could_never_match_are_refused(given: str) -> None:
    from mtpipe.coordinator.api.defaults import check_origins

    with pytest.raises(ValueError, match="expected '\\*', 'none' or origins such as http://localhost:3000"):
        check_origins(given)


def test_tokenize_and_detokenize(server: LiveServer, client: Any, engine: BatchEngine) -> None:
    """vLLM's /tokenize gives the ids a request is fed (a chat's: what its usage counts), /detokenize the text."""
    post = server.client.post
    text = "def add(a, b):\n    return a + b"
    r = post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == engine.tokenizer.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == engine.max_context and len(r["token_strs"]) == r["count"]
    messages = chat("Say hi.")
    asked = post("/tokenize", json={"messages": messages}).json()
    fed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert asked["count"] == fed.usage.prompt_tokens and asked["token_strs"] is None
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with_tools = post("/tokenize", json={"messages": messages, "tools": [tool]}).json()["count"]
    unused = post("/tokenize", json={"messages": messages, "tools": [tool], "tool_choice": "none"}).json()["count"]
    assert unused == asked["count"] < with_tools  # (tool_choice none: the tools are not rendered)
    closed = post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()["count"]
    assert closed < asked["count"]  # (vLLM's: without the assistant's turn opened)
    reply = [*messages, {"role": "assistant", "content": "Hi"}]
    going_on = post("/tokenize", json={"messages": reply, "continue_final_message": True,
                                       "add_generation_prompt": False}).json()
    fed = client.chat.completions.create(model=MODEL, messages=reply, max_tokens=1, temperature=0,
                                         extra_body={"continue_final_message": True})
    assert going_on["count"] == fed.usage.prompt_tokens
    assert post("/tokenize", json={"messages": reply, "continue_final_message": True}).json() == going_on  # (it wins)
    unopened = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                              extra_body={"add_generation_prompt": False})
    assert unopened.usage.prompt_tokens == closed
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                       extra_body={"chat_template": "{{ messages }}"})
    assert e.value.body["param"] == "chat_template"
    assert post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": engine.tokenizer.decode(r["tokens"])}
    for path, body, param in (("/tokenize", {"prompt": "x", "messages": messages}, "prompt"),
                              ("/tokenize", {"messages": reply, "chat_template": "{{ messages }}"}, "chat_template"),
                              ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
                              ("/detokenize", {"tokens": "1 2"}, "tokens")):
        bad = post(path, json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


def test_chat_echo_shows_the_reply_after_the_assistants_last_message(client: Any) -> None:
    """vLLM's chat `echo`: a reply that goes on from the assistant's last message is shown after it,
    whole or streamed, its logprobs its own tokens'; with a user's message last nothing is echoed."""
    reply = [*chat("Say hi."), {"role": "assistant", "content": "Hi "}]
    ask = dict(model=MODEL, messages=reply, max_tokens=6, temperature=0)
    going_on = {"continue_final_message": True, "add_generation_prompt": False}
    plain = client.chat.completions.create(**ask, extra_body=going_on).choices[0].message.content
    echoed = client.chat.completions.create(**ask, logprobs=True, extra_body={**going_on, "echo": True}).choices[0]
    assert echoed.message.content == "Hi " + plain and len(echoed.logprobs.content) == 6
    streamed = client.chat.completions.create(**ask, stream=True, extra_body={**going_on, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "Hi " + plain
    asked = chat("Say hi.")
    unopened = client.chat.completions.create(model=MODEL, messages=asked, max_tokens=6, temperature=0,
                                              extra_body={"echo": True, "add_generation_prompt": False})
    assert unopened.choices[0].message.content.startswith("Say hi.")  # (vLLM's: the reply in the user's turn)
    def reply(**extra: Any) -> str | None:
        return client.chat.completions.create(model=MODEL, messages=asked, max_tokens=6, temperature=0,
                                              extra_body=extra).choices[0].message.content

    assert reply(echo=True) == reply()


def test_an_unhandled_error_is_a_500_in_the_api_shape_and_keeps_the_connection(engine: Engine) -> None:
    """A route that fails with no answer of its own: a 500 with the error body (Anthropic's under
    /v1/messages), counted, and the client's connection stays open for its next request (a pooled
    client's next request would otherwise meet a reset)."""
    app = create_app(engine, MODEL)

    @app.get("/v1/fails")
    @app.get("/v1/messages/fails")
    async def fails() -> None:
        raise RuntimeError("a bug")

    with LiveServer(app) as s:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            ports = set()
            for path in ("/v1/fails", "/v1/messages/fails", "/v1/fails"):
                r = c.get(path, extensions={"trace": lambda name, info: ports.add(
                    info["return_value"].get_extra_info("socket").getsockname()[1])
                    if name == "connection.connect_tcp.complete" else None})
                assert r.status_code == 500, r.text
                assert "connection" not in r.headers or r.headers["connection"] != "close"
                if path.startswith("/v1/messages"):
                    assert r.json() == {"type": "error", "error": {"type": "api_error",
                                                                   "message": "internal error: RuntimeError"}}
                else:
                    assert r.json()["error"]["code"] == "internal_error"
            assert c.get("/health").status_code == 200
            assert len(ports) == 1  # one connection for all four
        m = Scrape(s.url)
        assert m("mtpipe_requests_total", endpoint="other", status="500") == 3


def test_call_arguments_nested_past_the_parser_go_to_the_template_as_sent(server: LiveServer) -> None:
    """An earlier call's arguments that JSON's parser cannot take (nested past its depth) are the string sent,
    as arguments that do not parse are (never a 500), in chat and in /tokenize."""
    deep = "[" * 1200 + "]" * 1200  # (past Python's recursion limit, within the tiny model's context)
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                      "function": {"name": "f", "arguments": deep}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "x"}]
    r = server.client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = server.client.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200 and r.json()["count"] > 100, r.text


def test_a_logprob_json_cannot_carry_is_openais_least() -> None:
    from mtpipe.coordinator.api.service import finite

    assert finite(float("-inf")) == finite(float("nan")) == -9999.0
    assert finite(-1.5) == -1.5 and finite(None) is None


def test_every_response_carries_a_request_id_and_health_answers_head(server: LiveServer, client: Any) -> None:
    """x-request-id (what OpenAI's clients read) and request-id (Anthropic's): the client's own X-Request-Id
    where it sent one (a proxy's), else a new one for each response."""
    r = client.chat.completions.with_raw_response.create(model=MODEL, messages=M, max_tokens=2)
    assert r.headers["x-request-id"].startswith("req_") and r.parse().choices  # (the SDK's `_request_id`)
    other = server.client.get("/v1/models")
    assert other.headers["x-request-id"] != r.headers["x-request-id"]
    assert other.headers["request-id"] == other.headers["x-request-id"]
    assert server.client.post("/v1/messages", json={}, headers={"X-Request-Id": "from-proxy-1"}).headers[
        "request-id"] == "from-proxy-1"
    head = server.client.head("/health")
    assert head.status_code == 200 and head.content == b"" and head.headers["x-request-id"]
