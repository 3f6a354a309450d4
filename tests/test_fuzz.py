"""Property-based fuzzing (hypothesis) of what reaches a node or the API from outside: the frame
decoder, the data-plane framing and the API's request bodies. Every input gets a clear error or is
served; none crashes, hangs or leaves state behind. Bounded in examples and time."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from google.protobuf.message import DecodeError
from helpers import LiveServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtpipe.node.dataplane import HELLO, LENGTH, FrameListener
from mtpipe.node.protocol import StageError
from mtpipe.node.wire import frame_to_request
from mtpipe.proto import mtpipe_pb2 as pb

httpx = pytest.importorskip("httpx")
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(st.binary(max_size=512))
def test_frame_decoder_takes_any_bytes(data: bytes) -> None:
    try:
        frame = pb.Frame.FromString(data)
    except DecodeError:
        return
    try:
        req = frame_to_request(frame)
    except StageError as e:
        assert str(e)
        return
    assert req.seq_id and req.budget >= 0 and req.group >= 0


@pytest.fixture(scope="module")
def listener() -> Iterator[tuple[int, list[pb.Frame]]]:
    """A data-plane listener on its own event loop; the frames it accepted."""
    loop = asyncio.new_event_loop()
    got: list[pb.Frame] = []

    async def on_frame(frame: pb.Frame) -> None:
        got.append(frame)

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    lst = FrameListener(on_frame, None, max_bytes=1 << 20)
    port = asyncio.run_coroutine_threadsafe(lst.start("127.0.0.1"), loop).result(10)
    yield port, got
    asyncio.run_coroutine_threadsafe(lst.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _send(port: int, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        s.settimeout(5)
        while s.recv(4096):  # the listener closes it (or answers OK and then waits for our end)
            pass


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=256), st.booleans())
def test_data_plane_framing_survives_any_bytes(listener: tuple[int, list[pb.Frame]], junk: bytes,
                                               hello: bool) -> None:
    port, got = listener
    before = len(got)
    _send(port, (HELLO if hello else b"") + junk)
    frame = pb.Frame(client_id="c", seq_id="s", step=1, kind=pb.DECODE, tokens=[1])
    data = frame.SerializeToString()
    _send(port, HELLO + LENGTH.pack(len(data)) + data)  # and it still takes a good frame
    deadline = 50
    while len(got) == before and deadline:
        threading.Event().wait(0.02)
        deadline -= 1
    assert got[-1] == frame


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=20), lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)
FIELDS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "stream", "seed",
          "n", "logprobs", "top_logprobs", "logit_bias", "tools", "tool_choice", "presence_penalty", "mtp_depth"]


@pytest.fixture(scope="module")
def api(dense_ckpt: Path) -> Iterator[tuple[Any, Any]]:
    from mtpipe.coordinator.api.app import create_app
    from mtpipe.coordinator.engine.build import batch_engine

    engine = batch_engine(dense_ckpt, dtype=mx.float32)
    try:
        with LiveServer(create_app(engine, "tiny")) as s:
            yield engine, s.client
    finally:
        engine.close()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6), st.integers(1, 3))
def test_api_bodies_get_an_answer_never_a_crash(api: tuple[Any, Any], path: str, body: dict, max_tokens: int) -> None:
    engine, client = api
    body = {**body, "max_tokens": body.get("max_tokens", max_tokens)}
    if isinstance(body["max_tokens"], int) and body["max_tokens"] > 3:
        body["max_tokens"] = 3  # valid bodies generate a few tokens, not thousands
    body.pop("stream", None)
    r = client.post(path, json=body)
    assert r.status_code in (200, 400, 404, 413), (r.status_code, r.text[:300])
    if r.status_code != 200:
        assert r.json()["error"]["message"]
    held = engine.thread.call(lambda: [stage.sequences for stage in engine.stages])  # nothing left behind
    assert held == [0] * len(held)


NEW_FIELDS = ["model", "input", "instructions", "max_output_tokens", "messages", "system", "max_tokens",
              "stop_sequences", "tools", "tool_choice", "text", "output_config", "thinking", "previous_response_id",
              "min_tokens", "prompt_logprobs", "echo", "prompt", "logprobs", "top_logprobs", "include", "store"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/v1/completions",
                        "/tokenize"]),
       st.dictionaries(st.sampled_from(NEW_FIELDS), JSON, max_size=6), st.integers(0, 3))
def test_the_newer_endpoints_answer_any_body(api: tuple[Any, Any], path: str, body: dict, budget: int) -> None:
    """The Responses and Messages APIs, scoring and /tokenize: a clear error (in the path's shape) or an
    answer, never a crash, nothing left behind."""
    engine, client = api
    for name in ("max_tokens", "max_output_tokens"):  # (valid bodies generate a few tokens, not thousands)
        if not isinstance(body.get(name), int) or body[name] > 3:
            body[name] = budget
    r = client.post(path, json=body)
    assert r.status_code in (200, 400, 404, 413), (r.status_code, r.text[:300])
    if r.status_code != 200:
        error = r.json()
        assert error["error"]["message"] and (error.get("type") == "error") == path.startswith("/v1/messages")
    held = engine.thread.call(lambda: [stage.sequences for stage in engine.stages])
    assert held == [0] * len(held)
