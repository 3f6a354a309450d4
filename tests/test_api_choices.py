"""Several choices in one response: `n`, and completions' lists of prompts.

Each choice must be what the same request alone gives (greedy: the same tokens; seeded: choice i is the
request with seed + i), in OpenAI's order, whole and streamed; usage counts each prompt once; the other
choices of a prompt take it from the kept prefixes; a client that leaves stops every choice.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from helpers import LiveServer  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from mtpipe.coordinator.api.app import create_app  # noqa: E402
from mtpipe.coordinator.engine.batch import BatchEngine  # noqa: E402
from mtpipe.coordinator.engine.build import batch_engine  # noqa: E402

MODEL = "tiny-dense"


@pytest.fixture(scope="module")
def engine(dense_ckpt: Path) -> BatchEngine:
    return batch_engine(dense_ckpt, stages=2, dtype=mx.float32)


@pytest.fixture(scope="module")
def server(engine: BatchEngine) -> Iterator[LiveServer]:
    with LiveServer(create_app(engine, MODEL, max_concurrency=8)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def held(engine: BatchEngine) -> list[int]:
    return engine.thread.call(lambda: [stage.sequences for stage in engine.stages])


def wait_idle(engine: BatchEngine) -> None:
    deadline = time.monotonic() + 10
    while any(held(engine)):
        assert time.monotonic() < deadline, f"sequences still held: {held(engine)}"
        time.sleep(0.02)


def metric(server: LiveServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def test_greedy_choices_are_the_request_alone(client: Any, engine: BatchEngine) -> None:
    one = client.chat.completions.create(model=MODEL, messages=chat("count with me"), max_tokens=12, temperature=0)
    three = client.chat.completions.create(model=MODEL, messages=chat("count with me"), max_tokens=12, temperature=0,
                                           n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert [c.finish_reason for c in three.choices] == [one.choices[0].finish_reason] * 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.total_tokens == three.usage.prompt_tokens + three.usage.completion_tokens
    wait_idle(engine)


def test_seeded_choice_i_is_the_request_with_seed_plus_i(client: Any) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 1.0}
    many = client.completions.create(**body, seed=41, n=3)
    alone = [client.completions.create(**body, seed=41 + i).choices[0].text for i in range(3)]
    assert [c.text for c in many.choices] == alone
    assert len(set(alone)) > 1  # (the choices differ)
    again = client.completions.create(**body, seed=41, n=3)
    assert [c.text for c in again.choices] == alone
    # seed + i wraps around as a 64-bit integer: choice 1 of the largest seed is the smallest one's choice 0
    top = client.completions.create(**body, seed=2**63 - 1, n=2)
    assert top.choices[1].text == client.completions.create(**body, seed=-(2**63)).choices[0].text


def test_a_list_of_prompts_gives_n_choices_each_in_openais_order(client: Any) -> None:
    prompts = ["The sky is", "def add(a, b):", "1, 2, 3,"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0) for p in prompts]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.text for c in out.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert out.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert out.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    ids = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=4, temperature=0)
    assert [c.index for c in ids.choices] == [0, 1]
    assert ids.usage.prompt_tokens == 5


def test_choices_past_the_slots_wait_for_them(client: Any, server: LiveServer, engine: BatchEngine) -> None:
    """More choices than generation slots (8 here): the first take them all, each further one waits for a
    slot (as vLLM queues them), streamed or not; every choice is what it is alone, and every slot comes back."""
    prompts = [f"{i} times {i} is" for i in range(11)]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in prompts]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.text for c in out.choices] == [a for a in alone for _ in range(2)]
    texts = [""] * 22
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [a for a in alone for _ in range(2)]
    service = server.server.config.app.state.service
    deadline = time.monotonic() + 10
    while (service.slots.free, service.slots.waiting) != (8, 0):
        assert time.monotonic() < deadline, (service.slots.free, service.slots.waiting)
        time.sleep(0.02)
    wait_idle(engine)


def test_a_choice_waiting_on_its_own_requests_slot_never_times_out(engine: BatchEngine) -> None:
    """One slot, n=2, and a first choice that runs longer than the slot timeout: the second waits for the
    slot the first frees (the request's own runs free it), not for the timeout's 503."""
    never_ends = {str(t): -100 for t in engine.eos}
    app = create_app(engine, MODEL, max_concurrency=1)
    app.state.service.slot_timeout = 0.3
    with LiveServer(app) as s:
        body = {"model": MODEL, "prompt": "go on", "max_tokens": 200, "temperature": 0, "logit_bias": never_ends}
        started = time.monotonic()
        alone = httpx.post(s.url + "/v1/completions", json=body, timeout=120).json()
        assert time.monotonic() - started > 0.3  # (longer than the slot timeout)
        r = httpx.post(s.url + "/v1/completions", json={**body, "n": 2}, timeout=120)
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == [alone["choices"][0]["text"]] * 2
    wait_idle(engine)


def test_a_streamed_requests_choices_past_the_slots_stream_as_they_start(engine: BatchEngine) -> None:
    """One slot, n=3: the first choice streams while the others wait for the slot it frees (nothing held
    back until the last starts); each is what the request alone gives. A client that leaves while a choice
    waits stops the one running, starts none, and leaves every slot free."""
    never_ends = {str(t): -100 for t in engine.eos}
    app = create_app(engine, MODEL, max_concurrency=1)
    service = app.state.service
    with LiveServer(app) as s:
        body = {"model": MODEL, "prompt": "go on", "max_tokens": 120, "temperature": 0, "logit_bias": never_ends}
        alone = httpx.post(s.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        order, texts, waiting = [], [""] * 3, []
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "n": 3, "stream": True}, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    waiting.append(service.slots.waiting)
                    (c,) = json.loads(line[6:])["choices"]
                    texts[c["index"]] += c["text"]
                    order.append((c["index"], c["finish_reason"]))
        assert texts == [alone] * 3
        assert waiting[0] == 2  # the first chunk came while the others waited for the slot (both counted: the
        # third, not yet asking for it, was left out of /metrics' mtpipe_requests_waiting)
        ends = [order.index((i, "length")) for i in range(3)]
        starts = [next(k for k, (j, _) in enumerate(order) if j == i) for i in range(3)]
        assert starts[0] < ends[0] < starts[1] < ends[1] < starts[2]  # each streamed before the next began

        wait_idle(engine)
        before = [st.stats.steps for st in engine.pipeline.stages]
        with httpx.stream("POST", s.url + "/v1/completions", timeout=120,
                          json={**body, "max_tokens": 3000, "n": 3, "stream": True}) as r:
            next(line for line in r.iter_lines() if line.startswith("data: {"))
        wait_idle(engine)
        deadline = time.monotonic() + 10
        while (service.slots.free, service.slots.waiting) != (1, 0):
            assert time.monotonic() < deadline, (service.slots.free, service.slots.waiting)
            time.sleep(0.02)
        assert [st.stats.steps for st in engine.pipeline.stages] != before
        assert metric(s, "mtpipe_generations_cancelled_total") == 1  # (the second and third never began)
        assert metric(s, "mtpipe_generations_in_flight") == 0


def test_each_choices_logprobs_count_offsets_in_its_own_text(client: Any) -> None:
    prompts = ["Hello", "Goodbye"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, logprobs=2)
    for prompt, choice in zip(prompts, out.choices):
        alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
        mine, its = choice.logprobs, alone.choices[0].logprobs
        assert mine.text_offset[0] == 0
        assert (mine.tokens, mine.text_offset) == (its.tokens, its.text_offset)
        assert mine.token_logprobs == pytest.approx(its.token_logprobs, abs=1e-4)  # (batched: low-order bits)


def test_streamed_choices_are_the_whole_ones(server: LiveServer, engine: BatchEngine) -> None:
    body = {"model": MODEL, "messages": chat("tell me more"), "max_tokens": 10, "temperature": 0, "n": 3,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as http:
        whole = http.post(server.url + "/v1/chat/completions", json={**body, "stream": False,
                                                                      "stream_options": None}).json()
        with http.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    usage = [c for c in chunks if not c["choices"]]
    assert len(usage) == 1 and chunks[-1] is usage[0]  # once, after every choice finished
    text: dict[int, str] = {}
    roles: dict[int, int] = {}
    finishes: dict[int, str] = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        i = choice["index"]
        assert i not in finishes  # nothing of a choice after its finish
        roles[i] = roles.get(i, 0) + (choice["delta"].get("role") == "assistant")
        text[i] = text.get(i, "") + (choice["delta"].get("content") or "")
        if choice["finish_reason"]:
            finishes[i] = choice["finish_reason"]
    assert roles == {0: 1, 1: 1, 2: 1}
    assert text == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert finishes == {c["index"]: c["finish_reason"] for c in whole["choices"]}
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage[0]["usage"][key] == whole["usage"][key]
    wait_idle(engine)


def test_streamed_completions_of_several_prompts_are_the_whole_ones(client: Any) -> None:
    ask = {"model": MODEL, "prompt": ["Hello", "It was"], "max_tokens": 8, "temperature": 0, "n": 2, "logprobs": 1}
    whole = client.completions.create(**ask)
    text: dict[int, str] = {}
    offsets: dict[int, list[int]] = {}
    for chunk in client.completions.create(stream=True, **ask):
        for choice in chunk.choices:
            text[choice.index] = text.get(choice.index, "") + choice.text
            offsets.setdefault(choice.index, []).extend(choice.logprobs.text_offset if choice.logprobs else [])
    assert text == {c.index: c.text for c in whole.choices}
    assert offsets == {c.index: c.logprobs.text_offset for c in whole.choices}


def test_a_prompts_other_choices_take_it_from_the_kept_prefixes(server: LiveServer, client: Any) -> None:
    prompt = "A prompt that no other test sends, long enough to be worth keeping: " + "alpha beta gamma " * 12
    before = metric(server, "mtpipe_prompt_tokens_cached_total")
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, n=3)
    cached = metric(server, "mtpipe_prompt_tokens_cached_total") - before
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # (the prompt is new: its first choice prefilled it)
    assert cached == 2 * (out.usage.prompt_tokens - 1)  # the other two prefilled only its last token


def test_a_client_that_leaves_stops_every_choice(server: LiveServer, engine: BatchEngine) -> None:
    wait_idle(engine)
    never_ends = {str(t): -100 for t in engine.eos}
    body = {"model": MODEL, "messages": chat("go on"), "max_tokens": 3000, "temperature": 0, "n": 3,
            "logit_bias": never_ends}
    cancelled = metric(server, "mtpipe_generations_cancelled_total")
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            seen = set()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen.add(json.loads(line[6:])["choices"][0]["index"])
                if len(seen) == 3:
                    assert sum(held(engine)) == 3 * len(engine.stages)  # every choice mid-generation
                    break
    wait_idle(engine)
    assert metric(server, "mtpipe_generations_cancelled_total") == cancelled + 3
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.8))
    wait_idle(engine)
    assert metric(server, "mtpipe_generations_cancelled_total") == cancelled + 6


def test_a_refused_choice_refuses_the_request_and_leaves_nothing(server: LiveServer, engine: BatchEngine) -> None:
    """A choice that cannot run (its prompt too long for the context with this max_tokens) refuses the
    whole request before any choice starts."""
    wait_idle(engine)
    steps = [s.stats.steps for s in engine.pipeline.stages]
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": ["fine", "x " * (engine.max_context + 8)], "max_tokens": 4, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]", r.text
    assert [s.stats.steps for s in engine.pipeline.stages] == steps
    assert not any(held(engine))


def test_a_request_reserves_all_its_slots_or_none() -> None:
    """Two requests that each need most of the slots take them in turn: neither holds part of them while
    it waits for the rest (each would then wait on the other until both got a 503), and a request that
    waits past the slot timeout gives back what it took."""
    import asyncio

    from mtpipe.coordinator.api.metrics import ServerMetrics
    from mtpipe.coordinator.api.service import Service
    from mtpipe.coordinator.engine.sinks import ServerBusy

    async def main() -> None:
        service = Service(None, MODEL, default_mtp_depth=None, max_concurrency=4, cluster_info=None,  # type: ignore[arg-type]
                          metrics=ServerMetrics())
        await service.reserve(3, None)
        second = asyncio.ensure_future(service.reserve(3, None))
        single = asyncio.ensure_future(service.reserve(1, None))
        for _ in range(100):  # (until both wait)
            await asyncio.sleep(0)
            if service.slots.waiting == 4:
                break
        assert service.slots.free == 1 and service.slots.waiting == 4  # (the second holds none while it waits:
        # its three generations wait, with the single one behind it)
        assert not second.done() and not single.done()  # (the single one waits its turn behind it)
        service.release(3)
        await asyncio.wait_for(second, 5)
        await asyncio.wait_for(single, 5)
        assert service.slots.free == 0
        service.release(4)
        service.slot_timeout = 0.3
        await service.reserve(2, None)
        with pytest.raises(ServerBusy):
            await service.reserve(4, None)
        await asyncio.sleep(0)  # (its wait, cancelled, ends)
        assert service.slots.free == 2 and not service.slots.waiting  # (the refused one waits no more)

    asyncio.run(main())


def test_without_kept_prefixes_a_prompts_choices_start_at_once(dense_ckpt: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that keeps no prompt prefixes: nothing to wait for, the choices start together (none
    waits for the first one's first token)."""
    from mtpipe.coordinator.api.generation import GenerationThread

    waited: list[Any] = []
    first = GenerationThread.first

    async def spy(self: GenerationThread) -> None:
        waited.append(self)
        await first(self)

    monkeypatch.setattr(GenerationThread, "first", spy)
    engine = batch_engine(dense_ckpt, dtype=mx.float32, prefix_cache=0)
    try:
        assert not engine.keeps_prefixes
        with LiveServer(create_app(engine, MODEL, max_concurrency=8)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            out = client.completions.create(model=MODEL, prompt="Once", max_tokens=6, temperature=0, n=3)
        assert len({c.text for c in out.choices}) == 1 and not waited
    finally:
        engine.close()


def test_slots_go_by_priority_then_arrival_and_a_request_given_up_holds_none_back() -> None:
    import asyncio

    from mtpipe.coordinator.api.slots import Slots

    async def main() -> None:
        slots, order = Slots(2), []

        async def take(name: str, count: int, priority: int) -> None:
            await slots.acquire(count, priority)
            order.append(name)

        await slots.acquire(2)
        tasks = {name: asyncio.ensure_future(take(name, count, priority))
                 for name, count, priority in [("late", 1, 0), ("pair", 2, -1), ("low", 1, 5), ("first", 1, -1)]}
        await asyncio.sleep(0)
        assert slots.waiting == 5 and not order  # (generations: the pair is two)
        slots.release(1)  # (pair, first in priority and arrival, needs two: nothing overtakes it)
        await asyncio.sleep(0)
        assert not order and slots.free == 1
        slots.release(1)
        await asyncio.wait_for(tasks["pair"], 5)
        slots.release(2)
        await asyncio.wait_for(asyncio.gather(tasks["first"], tasks["late"]), 5)
        assert order == ["pair", "first", "late"] and slots.free == 0
        tasks["low"].cancel()  # (given up: it holds nothing, and nothing waits behind it)
        await asyncio.gather(tasks["low"], return_exceptions=True)
        assert slots.waiting == 0
        slots.release(1)
        tall = asyncio.ensure_future(take("tall", 2, 5))  # (waits for two, with one free)
        await asyncio.sleep(0)
        await asyncio.wait_for(take("urgent", 1, -3), 5)  # (it overtakes it, and fits what is free at once)
        assert order[-1] == "urgent" and not tall.done()
        slots.release(2)
        await asyncio.wait_for(tall, 5)
        slots.release(2)
        assert slots.free == 2
        with pytest.raises(ValueError):
            await slots.acquire(3)
        # A request's further choices wait in its own place: ahead of a request that came after it.
        one = Slots(1)
        mine = one.arrival()
        await one.acquire(1, 0, mine)
        later = asyncio.ensure_future(one.acquire(1))
        await asyncio.sleep(0)
        further = [asyncio.ensure_future(one.acquire(1, 0, mine)) for _ in range(2)]  # (one arrival, two waits)
        await asyncio.sleep(0)
        one.release(1)
        await asyncio.wait_for(further[0], 5)
        one.release(1)
        await asyncio.wait_for(further[1], 5)
        assert not later.done()
        one.release(1)
        await asyncio.wait_for(later, 5)

    asyncio.run(main())


def test_a_waiting_stream_sends_keepalive_comments_and_ends_its_events_when_left() -> None:
    import asyncio

    from mtpipe.coordinator.api.generation import SSE_KEEPALIVE, with_keepalive

    ended = []

    async def events() -> Any:
        try:
            yield "data: 1\n\n"
            await asyncio.sleep(0.35)
            yield "data: 2\n\n"
            await asyncio.sleep(10)
            yield "data: 3\n\n"
        finally:
            ended.append(True)

    async def read(n: int) -> list[str]:
        out = []
        stream = with_keepalive(events(), 0.1)
        async for e in stream:
            out.append(e)
            if len([x for x in out if x != SSE_KEEPALIVE]) == n:
                break
        await stream.aclose()  # (what a client that leaves does to the response's iterator)
        return out

    out = asyncio.run(read(2))
    assert out[0] == "data: 1\n\n" and out[-1] == "data: 2\n\n"
    assert 2 <= out.count(SSE_KEEPALIVE) <= 4 and len(out) == 2 + out.count(SSE_KEEPALIVE)
    assert ended == [True]  # the events' own cleanup ran


def test_keepalive_comments_leave_a_streamed_reply_as_it_is(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from mtpipe.coordinator.api import generation

    monkeypatch.setattr(generation, "KEEPALIVE_S", 0.0005)  # (a comment in nearly every gap)
    body = {"model": MODEL, "messages": chat("count to ten"), "max_tokens": 24, "temperature": 0}
    whole = client.chat.completions.create(**body).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**body, stream=True)
                       if c.choices)
    assert streamed == whole
    for _ in range(3):  # (a loaded machine may hand the reply's events over with no gap in between)
        with httpx.stream("POST", str(client.base_url) + "chat/completions", json={**body, "stream": True},
                          timeout=60) as r:
            lines = list(r.iter_lines())
        assert lines[-2:] == ["data: [DONE]", ""]
        if ": keep-alive" in lines:
            break
    assert ": keep-alive" in lines


def test_a_streamed_choice_refused_as_it_starts_is_told_as_it_is(engine: BatchEngine,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """One slot, n=3: the second choice is refused as it starts, after the stream began. The stream ends
    with that refusal (503's body, server_busy), not an internal error, and it counts as no failed
    generation; every slot comes back."""
    from mtpipe.coordinator.engine.sinks import ServerBusy

    app = create_app(engine, MODEL, max_concurrency=1)
    service = app.state.service
    real_run, calls = service.run, []

    def run(req: Any) -> Any:
        calls.append(req)
        if len(calls) == 2:
            service.slots.release()  # (as a run that cannot start gives its slot back)
            raise ServerBusy("refused at once", retry_after=1)
        return real_run(req)

    monkeypatch.setattr(service, "run", run)
    with LiveServer(app) as s:
        body = {"model": MODEL, "prompt": "go on", "max_tokens": 20, "temperature": 0, "n": 3, "stream": True,
                "logit_bias": {str(t): -100 for t in engine.eos}}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            errors = [json.loads(line[6:])["error"] for line in r.iter_lines() if line.startswith('data: {"error"')]
        assert [e["code"] for e in errors] == ["server_busy"] and "refused at once" in errors[0]["message"]
        wait_idle(engine)
        deadline = time.monotonic() + 10
        while (service.slots.free, service.slots.waiting) != (1, 0):
            assert time.monotonic() < deadline, (service.slots.free, service.slots.waiting)
            time.sleep(0.02)
        assert metric(s, "mtpipe_generations_failed_total") == 0 and len(calls) == 2


def test_the_keepalive_reads_no_further_ahead_of_a_slow_client() -> None:
    import asyncio

    from mtpipe.coordinator.api import generation

    read = [0]

    async def events() -> Any:
        for i in range(1000):
            read[0] += 1
            yield f"data: {i}\n\n"

    async def slow() -> None:
        stream = generation.with_keepalive(events(), 60)
        assert await stream.__anext__() == "data: 0\n\n"
        await asyncio.sleep(0.2)  # (a client that does not read, or left)
        assert read[0] <= generation.KEEPALIVE_AHEAD + 2
        await stream.aclose()

    asyncio.run(slow())
