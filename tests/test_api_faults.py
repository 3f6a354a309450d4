"""Faults the API must survive: huge bodies, long prompts beside short ones, and nodes that go down.

Each test bounds its waits: a request that stalls the others fails an upper bound here instead
of hanging the suite.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from helpers import LiveServer, node_servers

from mtpipe.coordinator.api.app import create_app
from mtpipe.coordinator.api.readiness import NodeWatch, Readiness
from mtpipe.coordinator.api.serve import nodes_cluster_info
from mtpipe.coordinator.engine.batch import BatchEngine
from mtpipe.coordinator.engine.build import batch_engine, remote_engine
from mtpipe.proto import mtpipe_pb2 as pb

MODEL = "tiny-dense"
SMALL = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def engine(dense_ckpt: Path) -> BatchEngine:
    return batch_engine(dense_ckpt, stages=2, dtype=mx.float32)


@pytest.fixture(scope="module")
def server(engine: BatchEngine) -> Iterator[LiveServer]:
    with LiveServer(create_app(engine, MODEL)) as s:  # the default cap, 4 MiB
        yield s


def scraped(c: Any, url: str, *names: str) -> tuple[float, ...]:
    from prometheus_client.parser import text_string_to_metric_families

    samples = {s.name: s.value for f in text_string_to_metric_families(c.get(url + "/metrics").text)
               for s in f.samples if not s.labels}
    return tuple(samples[n] for n in names)


def timed(fn: Any) -> tuple[Any, float, float]:
    """fn()'s result, and when it ended and how long it took (perf_counter)."""
    t0 = time.perf_counter()
    out = fn()
    t1 = time.perf_counter()
    return out, t1, t1 - t0


def beside(big: Any, small: Any, head_start: float = 0.1) -> tuple[tuple, tuple]:
    """`big()` on a thread and, a moment later, `small()` here: both timed."""
    got: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: got.update(big=timed(big)))
    thread.start()
    time.sleep(head_start)
    small_out = timed(small)
    thread.join(timeout=60)
    assert "big" in got, "the big request did not finish within 60 s"
    return got["big"], small_out


def test_huge_body_refused_fast_beside_a_small_request(server: LiveServer) -> None:
    prompt = "hello world, " * (5_000_000 // 13)  # about 5 MB of JSON
    with httpx.Client(timeout=30) as a, httpx.Client(timeout=30) as b:
        a.post(server.url + "/v1/completions", json=SMALL)  # warm: the first generation compiles
        (big, _, big_s), (small, _, small_s) = beside(
            lambda: a.post(server.url + "/v1/completions", json={**SMALL, "prompt": prompt}),
            lambda: b.post(server.url + "/v1/completions", json=SMALL), head_start=0.0)
    assert big.status_code == 413, big.text
    assert big.json()["error"]["code"] == "request_too_large" and big.json()["error"]["type"]
    assert big_s < 3.0, f"a 5 MB body took {big_s:.1f} s to be refused"
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 2
    assert small_s < 3.0, f"a small request beside it took {small_s:.1f} s"


def test_long_prompt_does_not_hold_up_short_ones(server: LiveServer) -> None:
    """A prompt under the cap but seconds to tokenize: a short request sent after it finishes first."""
    prompt = "hello world, " * (3_000_000 // 13)
    with httpx.Client(timeout=60) as a, httpx.Client(timeout=30) as b:
        (big, big_end, big_s), (small, small_end, small_s) = beside(
            lambda: a.post(server.url + "/v1/completions", json={**SMALL, "prompt": prompt}),
            lambda: b.post(server.url + "/v1/completions", json=SMALL))
    assert big.status_code == 400 and big.json()["error"]["param"] == "prompt"  # longer than the context
    assert small.status_code == 200
    assert small_s < 1.5, f"a small request waited {small_s:.1f} s beside a long prompt ({big_s:.1f} s)"
    assert small_end < big_end


def test_chunked_body_counted_without_content_length(engine: BatchEngine) -> None:
    limit = 64 * 1024
    body = json.dumps({**SMALL, "prompt": "x" * (4 * limit)}).encode()

    def chunks(data: bytes) -> Iterator[bytes]:  # no Content-Length: httpx sends it chunked
        for i in range(0, len(data), 8192):
            yield data[i:i + 8192]

    with LiveServer(create_app(engine, MODEL, max_body_bytes=limit)) as s, httpx.Client(timeout=30) as c:
        r, _, took = timed(lambda: c.post(s.url + "/v1/completions", content=chunks(body),
                                          headers={"Content-Type": "application/json"}))
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert took < 3.0
        r = c.post(s.url + "/v1/completions", content=b"x" * (limit + 1))  # with Content-Length
        assert r.status_code == 413 and str(limit) in r.json()["error"]["message"]
        small = json.dumps(SMALL).encode()
        r = c.post(s.url + "/v1/completions", content=chunks(small), headers={"Content-Type": "application/json"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_health_local(server: LiveServer, engine: BatchEngine) -> None:
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"

    class Dead:
        pipeline = object()
        thread = type("T", (), {"alive": False})()

    ready, details = Readiness(Dead()).check()  # type: ignore[arg-type]
    assert not ready and "stopped" in details["unready"][0]["reason"]


def test_health_names_each_reason() -> None:
    """Not answering, no shard and a reported error are each named, beside a node that is fine."""
    import grpc

    class Unreachable(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "connection refused"

    def link(address: str, reply: Any) -> Any:
        def health(req: Any, timeout: float) -> Any:
            if isinstance(reply, Exception):
                raise reply
            return reply
        return type("Link", (), {"address": address, "stub": type("S", (), {"Health": staticmethod(health)})()})()

    links = [link("a:1", pb.HealthReply(loaded=True)), link("b:2", Unreachable()),
             link("c:3", pb.HealthReply(loaded=False)), link("d:4", pb.HealthReply(loaded=True, last_error="boom"))]
    engine = type("E", (), {"pipeline": type("P", (), {"nodes": links})()})()
    ready, details = Readiness(engine).check()  # type: ignore[arg-type]
    assert not ready
    reasons = {u["address"]: u["reason"] for u in details["unready"]}
    assert set(reasons) == {"b:2", "c:3", "d:4"}
    assert "UNAVAILABLE" in reasons["b:2"] and "no shard" in reasons["c:3"] and "boom" in reasons["d:4"]
    watch = NodeWatch(engine.pipeline)
    first = watch.check(1.0)[3].error_at
    time.sleep(0.01)
    assert watch.check(1.0)[3].error_at == first  # since when, not when last asked

    class Late(Unreachable):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.DEADLINE_EXCEEDED

    for prefilling in (False, True):  # late while prompt chunks are in flight: busy in a step, not unready
        pipeline = type("P", (), {"nodes": [link("a:1", pb.HealthReply(loaded=True)), link("b:2", Late())],
                                  "prefilling": prefilling})()
        ready, details = Readiness(type("E", (), {"pipeline": pipeline})()).check()  # type: ignore[arg-type]
        assert ready is prefilling and [u["address"] for u in details["unready"]] == ([] if prefilling else ["b:2"])
    pipeline.nodes[1] = link("b:2", Unreachable())  # (gone, not late: unready whatever is in flight)
    assert Readiness(type("E", (), {"pipeline": pipeline})()).check()[0] is False  # type: ignore[arg-type]


def test_health_and_cluster_over_nodes(dense_ckpt: Path) -> None:
    with node_servers(2) as nodes:
        engine = remote_engine(dense_ckpt, [n.address for n in nodes], dtype="float32")
        try:
            app = create_app(engine, MODEL, cluster_info=nodes_cluster_info(engine, MODEL))
            with LiveServer(app) as s, httpx.Client(timeout=30) as c:
                r = c.get(s.url + "/health")
                assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["nodes"] == 2
                info = c.get(s.url + "/v1/cluster").json()
                assert info["healthy"] is True and [n["healthy"] for n in info["nodes"]] == [True, True]
                assert scraped(c, s.url, "mtpipe_ready", "mtpipe_nodes_unready") == (1, 0)

                nodes[1].stop(0)
                r, _, took = timed(lambda: c.get(s.url + "/health"))
                assert r.status_code == 503 and took < 5.0
                body = r.json()
                assert body["status"] == "unavailable"
                assert [u["address"] for u in body["unready"]] == [nodes[1].address]
                assert "does not answer" in body["unready"][0]["reason"]
                assert nodes[1].address in body["error"]["message"]

                info = c.get(s.url + "/v1/cluster").json()
                first, second = info["nodes"]
                assert info["healthy"] is False and nodes[1].address in info["error"]
                assert first["healthy"] is True and first["loaded"] is True and first["error"] is None
                assert first["node_id"] and first["end"] == 2  # the live node's own state, not hidden
                assert second["healthy"] is False and second["reachable"] is False
                assert "does not answer" in second["error"] and second["error_at"]
                assert info["errors"] == [{"node": nodes[1].address, "error": second["error"],
                                           "at": second["error_at"]}]
                assert info["placement"][0]["layers"] == [0, 2] and info["placement"][1]["layers"] is None
                ready, unready = scraped(c, s.url, "mtpipe_ready", "mtpipe_nodes_unready")  # down, not busy
                assert ready == 0 and unready == 1
        finally:
            engine.pipeline.close()


def test_chunks_from_another_thread_arrive_in_order_with_few_wake_ups() -> None:
    """The engine's thread hands every stream's chunks to the event loop; a burst of them (one round of
    a batch) wakes the loop once, not once per chunk, and each stream gets its own in order."""
    import asyncio

    from mtpipe.coordinator.api.generation import inbox

    async def main() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        wake_ups = 0
        plain = loop.call_soon_threadsafe

        def counted(*args: Any) -> Any:
            nonlocal wake_ups
            wake_ups += 1
            return plain(*args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        box, queues = inbox(loop), [asyncio.Queue() for _ in range(8)]

        def engine_rounds() -> None:
            for rnd in range(20):
                for q in queues:
                    box.put(q, rnd)

        worker = threading.Thread(target=engine_rounds)
        worker.start()
        got = [[await q.get() for _ in range(20)] for q in queues]
        worker.join()
        return got, wake_ups

    got, wake_ups = asyncio.run(main())
    assert got == [list(range(20))] * 8
    assert wake_ups <= 8 * 20 // 2


def test_chunks_for_a_closed_loop_are_dropped() -> None:
    """A chunk handed over after the server's loop closed is dropped (nobody listens), not an error on
    the engine's thread, and the inbox keeps nothing."""
    import asyncio

    from mtpipe.coordinator.api.generation import inbox

    async def make() -> tuple[Any, asyncio.Queue]:
        return inbox(asyncio.get_running_loop()), asyncio.Queue()

    box, queue = asyncio.run(make())
    box.put(queue, "late")
    box.put(queue, "later")
    assert box.items == [] and queue.empty()


def test_a_stream_refused_while_it_waits_in_the_queue_gets_its_status(dense_ckpt: Path) -> None:
    """A stream answers 200 only once the engine admitted its request: one that times out in the queue
    gets the 503 with Retry-After a plain request gets, not an error event inside a 200."""
    engine = batch_engine(dense_ckpt, dtype=mx.float32, max_rows=1, queue_timeout=1.0)
    never = {str(t): -100 for t in engine.eos}  # the holding stream never ends by itself
    long = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 3000, "temperature": 0,
            "logit_bias": never, "stream": True}
    short = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    try:
        with LiveServer(create_app(engine, "m")) as s:
            holding, done = threading.Event(), threading.Event()

            def hold() -> None:
                with httpx.stream("POST", s.url + "/v1/chat/completions", json=long, timeout=60) as r:
                    lines = r.iter_lines()
                    next(lines)
                    holding.set()
                    done.wait(60)

            t = threading.Thread(target=hold)
            t.start()
            try:
                assert holding.wait(60)
                for body in (short, {**short, "stream": True}):
                    r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=30)
                    assert r.status_code == 503 and r.headers.get("Retry-After"), (body, r.status_code, r.text[:200])
                    assert r.json()["error"]["code"] == "server_busy"
                # refused before they began: not generations that failed (requests_total counts the 503s)
                assert scraped(httpx, s.url, "mtpipe_generations_failed_total") == (0,)
            finally:
                done.set()
                t.join()
            r = httpx.post(s.url + "/v1/chat/completions", json={**short, "stream": True}, timeout=30)
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")  # with room, it streams
    finally:
        engine.close()


def test_readiness_metrics_count_the_nodes_not_the_ring_itself() -> None:
    """mtpipe_nodes_unready counts nodes /health names; a pipeline down while every node answers (being
    formed again) is not ready, with no node to count; a check that fails is not ready either."""
    from mtpipe.coordinator.api.metrics import ReadinessMetrics

    def read(answer: Any) -> dict[str, float]:
        def check() -> Any:
            if isinstance(answer, Exception):
                raise answer
            return answer
        return {f.name: f.samples[0].value for f in ReadinessMetrics(check).collect()}

    assert read((True, {"unready": []})) == {"mtpipe_ready": 1, "mtpipe_nodes_unready": 0}
    assert read((False, {"unready": [{"address": "pipeline"}, {"address": "a:1"}]})) == {
        "mtpipe_ready": 0, "mtpipe_nodes_unready": 1}
    assert read(TimeoutError("no answer")) == {"mtpipe_ready": 0, "mtpipe_nodes_unready": 0}
    lost = {"address": "a:1", "reason": "reports an error: lost the stream to the next stage b:2: unavailable"}
    assert read((False, {"unready": [lost, {"address": "b:2", "reason": "does not answer: unavailable"}]})) == {
        "mtpipe_ready": 0, "mtpipe_nodes_unready": 1}  # (the node down, not the one whose link to it broke)
    assert read((False, {"unready": [lost]})) == {"mtpipe_ready": 0, "mtpipe_nodes_unready": 1}  # (the link alone)
