"""The API in a process of its own (coordinator/api/front.py and link.py) over a batch engine in the
test's process: what it answers equals the engine's own output, bad input never reaches the engine,
a client or a front that goes away frees its sequences, and the link carries errors as they were.
The link's two ends are also tested on a pipe in this process, with a scripted other end."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
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

from front_probe import front_imports  # noqa: E402
from helpers import PROMPTS, signal_a_thread  # noqa: E402
from mlx_threads import record_mlx_threads  # noqa: E402

from mtpipe.coordinator.api.front import FrontProcess, FrontSpec  # noqa: E402
from mtpipe.coordinator.api.link import EngineClient, EngineHost  # noqa: E402
from mtpipe.coordinator.api.pipe import Outbox, WireError  # noqa: E402
from mtpipe.coordinator.bench.nodes import free_port  # noqa: E402
from mtpipe.coordinator.engine.batch import BatchEngine  # noqa: E402
from mtpipe.coordinator.engine.build import batch_engine  # noqa: E402
from mtpipe.coordinator.engine.request import GenerationChunk, GenerationRequest, RequestError  # noqa: E402
from mtpipe.coordinator.engine.sinks import END, ServerBusy  # noqa: E402
from mtpipe.node.protocol import SamplingParams, StageError, StageUnavailable  # noqa: E402

MODEL = "tiny-front"
KEY = "front-key-456"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def engine(dense_ckpt: Path) -> Iterator[BatchEngine]:
    e = batch_engine(dense_ckpt, stages=2, dtype=mx.float32)
    yield e
    e.close()


def _front(engine: BatchEngine, ckpt: Path, generation_config: Path | None = None) -> FrontProcess:
    front = FrontProcess(engine, FrontSpec(str(ckpt), model_name=MODEL, api_key=KEY, access_log=False,
                                           generation_config=generation_config and str(generation_config)))
    front.start()
    return front


DEFAULT_LENGTH = 3  # the max_new_tokens of the front's generation config (`mtpipe serve --generation-config`)


@pytest.fixture(scope="module")
def front(engine: BatchEngine, dense_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontProcess]:
    defaults = tmp_path_factory.mktemp("generation_config")
    (defaults / "generation_config.json").write_text(json.dumps({"max_new_tokens": DEFAULT_LENGTH}))
    f = _front(engine, dense_ckpt, defaults)
    yield f
    f.stop()


def held(engine: BatchEngine) -> list[int]:
    return engine.thread.call(lambda: [stage.sequences for stage in engine.stages])


def wait_idle(engine: BatchEngine, front: FrontProcess, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while any(held(engine)) or front.host.open_requests:
        assert time.monotonic() < deadline, f"still held: {held(engine)}, open {front.host.open_requests}"
        time.sleep(0.02)


def direct(engine: BatchEngine, tokens: list[int], max_tokens: int, depth: int = 2) -> Any:
    return engine.complete(GenerationRequest(tokens, max_tokens, SamplingParams(temperature=0.0), mtp_depth=depth))


def events(r: Any) -> list[dict[str, Any]]:
    out = []
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: "):]))
    return out


# -- the front process ------------------------------------------------------------------------------


def test_answers_equal_the_engine_and_only_the_engine_thread_does_mlx(engine: BatchEngine,
                                                                     front: FrontProcess) -> None:
    tokens = list(engine.tokenizer.encode(PROMPTS[0]))
    want = direct(engine, tokens, 24)
    with record_mlx_threads() as rec, httpx.Client(base_url=front.url, timeout=60, headers=AUTH) as c:
        body = {"model": MODEL, "prompt": tokens, "max_tokens": 24, "temperature": 0, "mtp_depth": 2, "stream": True,
                "stream_options": {"include_usage": True}}
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            got = events(r)
        whole = c.post("/v1/completions", json={**body, "stream": False, "stream_options": None}).json()
        health = c.get("/health")
        cluster = c.get("/v1/cluster").json()
        scrape = c.get("/metrics").text  # (the scheduler's state: asked of the engine's process)
    assert "".join(e["choices"][0]["text"] for e in got if e["choices"]) == want.text
    assert got[-1]["usage"]["completion_tokens"] == len(want.tokens)
    assert whole["choices"][0]["text"] == want.text and whole["usage"]["mtp"]["depth"] == 2
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert cluster["mode"] == "local" and [p["layers"] for p in cluster["placement"]] == [[0, 2], [2, 4]]
    assert cluster["batch"]["budget_bytes"] == engine.budget and cluster["batch"]["preemptions"] == engine.preemptions
    assert "\nmtpipe_requests_waiting 0.0\n" in scrape and "\nmtpipe_preemptions_total 0.0\n" in scrape
    # Engine-side, the link's threads hand work over: MLX runs on the engine's thread alone.
    assert rec.threads == {"mlx-engine"}, {k: v.most_common(5) for k, v in rec.calls_by_thread.items()}
    wait_idle(engine, front)


def test_cluster_answers_while_the_mlx_thread_is_busy(engine: BatchEngine, front: FrontProcess) -> None:
    """GET /v1/cluster does not wait for a long unit of the MLX thread (a long prompt's step): it shows the
    stages as the thread last described them."""
    release = threading.Event()
    engine.thread.submit(release.wait, 30)  # (the MLX thread held)
    try:
        with httpx.Client(base_url=front.url, timeout=30, headers=AUTH) as c:
            start = time.monotonic()
            r = c.get("/v1/cluster")
            took = time.monotonic() - start
    finally:
        release.set()
    assert r.status_code == 200 and [p["layers"] for p in r.json()["placement"]] == [[0, 2], [2, 4]]
    assert took < 5.0


def test_chat_with_the_key_from_the_pipe_and_refusals_in_the_front(engine: BatchEngine, front: FrontProcess) -> None:
    messages = [{"role": "user", "content": PROMPTS[1]}]
    want = direct(engine, engine.encode_chat(messages), 16, depth=0)
    with httpx.Client(base_url=front.url, timeout=60) as c:
        assert c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}).status_code == 401
        ok = c.post("/v1/chat/completions", headers=AUTH, json={"model": MODEL, "messages": messages,
                                                                "max_tokens": 16, "temperature": 0, "mtp_depth": 0})
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["message"]["content"] == want.text
        short = c.post("/v1/completions", headers=AUTH, json={"prompt": [1, 2], "temperature": 0, "mtp_depth": 0})
        assert short.json()["usage"]["completion_tokens"] == DEFAULT_LENGTH, short.text  # (the front's defaults)
        vocab = engine.vocab_size
        for bad, param in (({"prompt": [1, vocab]}, "prompt"), ({"prompt": [1, 2], "mtp_depth": 9}, "mtp_depth"),
                           ({"prompt": [1, 2], "max_tokens": engine.max_context}, "max_tokens")):
            r = c.post("/v1/completions", headers=AUTH, json={"model": MODEL, **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert held(engine) == [0, 0] and front.host.open_requests == 0


def test_a_client_that_leaves_frees_its_sequence(engine: BatchEngine, front: FrontProcess) -> None:
    tokens = list(engine.tokenizer.encode(PROMPTS[2]))
    body = {"model": MODEL, "prompt": tokens, "max_tokens": 2000, "temperature": 0, "stream": True}
    with httpx.Client(base_url=front.url, timeout=60, headers=AUTH) as c, \
            c.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()  # (held: a generator closed by the collector would close the response)
        assert next(line for line in lines if line.startswith("data: "))
        assert any(held(engine)) and front.host.open_requests == 1
    wait_idle(engine, front)


def serving(front: FrontProcess) -> tuple[list[int], threading.Thread]:
    """`front.serve()` (what `mtpipe serve` runs) on a thread, once the front serves; its exit code goes
    into the list when it returns."""
    code: list[int] = []
    server = threading.Thread(target=lambda: code.append(front.serve()), daemon=True)
    server.start()
    deadline = time.monotonic() + 60
    while not front.url:
        assert time.monotonic() < deadline and server.is_alive()
        time.sleep(0.05)
    return code, server


def test_a_front_that_dies_leaves_nothing_in_the_engine(engine: BatchEngine, dense_ckpt: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The front killed mid-stream: the engine frees the sequence, and `serve()` (what `mtpipe serve`
    returns) ends in 1, saying why."""
    front = FrontProcess(engine, FrontSpec(str(dense_ckpt), model_name=MODEL, api_key=KEY, access_log=False))
    try:
        code, server = serving(front)
        deadline = time.monotonic() + 60
        tokens = list(engine.tokenizer.encode(PROMPTS[3]))
        done = threading.Event()

        def stream() -> None:
            body = {"model": MODEL, "prompt": tokens, "max_tokens": 2000, "temperature": 0, "stream": True}
            try:
                with httpx.stream("POST", front.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
                    for _ in r.iter_lines():
                        pass
            except httpx.HTTPError:
                pass  # the server died under it
            done.set()

        threading.Thread(target=stream, daemon=True).start()
        while not front.host.open_requests:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(front.process.pid, signal.SIGKILL)
        assert front.host.closed.wait(10)
        wait_idle(engine, front)
        assert done.wait(10)
        server.join(15)
        assert code == [1] and "the API process ended by itself (signal 9)" in caplog.text
    finally:
        front.stop()
    assert not front.alive


def test_a_stuck_engine_fails_its_requests_and_stops_the_front(engine: BatchEngine, dense_ckpt: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """The engine's MLX thread held in one unit of work past the stall timeout: the open stream ends
    with an error saying so, the front stops, and `serve()` ends in 1; once the thread is free again,
    the engine holds nothing of the request."""
    spec = FrontSpec(str(dense_ckpt), model_name=MODEL, api_key=KEY, access_log=False, stall_timeout=1.0)
    front = FrontProcess(engine, spec)
    try:
        code, server = serving(front)
        body = {"model": MODEL, "prompt": list(engine.tokenizer.encode(PROMPTS[3])), "max_tokens": 2000,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", front.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            stuck = engine.thread.submit(time.sleep, 3.0)  # a round that does not end
            rest = [line for line in lines if line.startswith("data: ")]
        errors = [json.loads(line[6:])["error"] for line in rest if '"error"' in line]
        assert errors and "the engine is stuck" in errors[0]["message"], rest[-3:]
        assert not stuck.done()  # the stream ended while the thread was still held
        server.join(15)
        assert code == [1] and "the API process ended by itself (exit code 1)" in caplog.text
        stuck.result(10)
        wait_idle(engine, front)
    finally:
        front.stop()
    assert not front.alive


def test_over_ring_nodes_with_their_health(dense_ckpt: Path) -> None:
    from helpers import node_servers

    from mtpipe.coordinator.api.serve import nodes_cluster_info
    from mtpipe.coordinator.engine.build import ring_engine

    with node_servers(2) as nodes:
        engine = ring_engine(dense_ckpt, [n.address for n in nodes], dtype="float32")
        front = FrontProcess(engine, FrontSpec(str(dense_ckpt), model_name=MODEL, access_log=False),
                             nodes_cluster_info(engine, MODEL))
        try:
            front.start()
            tokens = list(engine.tokenizer.encode(PROMPTS[5]))
            want = direct(engine, tokens, 12)
            with httpx.Client(base_url=front.url, timeout=60) as c:
                body = {"prompt": tokens, "max_tokens": 12, "temperature": 0, "mtp_depth": 2}
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text
                # the nodes kept the prompt's prefix as it went in first: it went in from there
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(tokens) - 1
                health = c.get("/health")
                assert health.status_code == 200 and health.json()["nodes"] == 2
                nodes[1].stop(0)
                health = c.get("/health")
                assert health.status_code == 503  # as the engine's process sees its nodes
                assert nodes[1].address in [u["address"] for u in health.json()["unready"]]
                info = c.get("/v1/cluster").json()
                assert info["mode"] == "nodes" and info["healthy"] is False and nodes[1].address in info["error"]
                deadline = time.monotonic() + 10
                while engine.pipeline.reformer.down is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                # refused at once by the engine's process: the stream gets its status, not an error inside a 200
                with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    assert r.status_code == 503 and "Retry-After" in r.headers
                    assert nodes[1].address in r.read().decode()
        finally:
            front.stop()
            engine.pipeline.close()


# (Ctrl-C with SIGINT as usual at start takes the same path once the API serves: the command's own
# handler, installed as it starts serving, replaces whichever it had.)
@pytest.mark.parametrize("how", ["ctrl-c, SIGINT ignored at start", "sigterm", "sigterm taken by another thread"])
def test_mtpipe_serve_runs_its_api_in_a_child_and_stops_it(dense_ckpt: Path, how: str) -> None:
    """Ctrl-C and SIGTERM stop both processes and end in 0, also where the command started with SIGINT
    ignored (as a parent's ignored signals are inherited): the front's uvicorn handles it, and may end first."""
    psutil = pytest.importorskip("psutil")
    port = free_port()
    env = {**os.environ, "MTPIPE_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "mtpipe", "serve", "--model", str(dense_ckpt), "--port", str(port),
                             "--dtype", "float32"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if "ignored" in how
                            else None)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        with httpx.Client(timeout=2) as poll:  # (one client: each of httpx.get's makes a TLS context)
            while True:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                try:
                    if poll.get(url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "mtpipe serve did not come up"
                time.sleep(0.2)
        children = psutil.Process(proc.pid).children()
        # the API's process (the engine is the command's own), and multiprocessing's resource tracker
        fronts = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
        assert len(fronts) == 1, [c.cmdline() for c in children]
        # The front loads a tokenizer, never torch (installed with the `train` extra); nor does the command.
        for process in (fronts[0], psutil.Process(proc.pid)):
            assert not [m.path for m in process.memory_maps() if "libtorch" in m.path]
        r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=60,
                       json={"prompt": PROMPTS[4], "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        if how.startswith("ctrl-c"):
            os.killpg(proc.pid, signal.SIGINT)  # a terminal signals the whole foreground group
        elif "thread" in how:
            signal_a_thread(proc.pid, signal.SIGTERM)  # (the kernel may give it any thread)
        else:
            proc.send_signal(signal.SIGTERM)  # a service manager signals the command
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:  # where it hangs: the command dumps every thread's stack on SIGUSR1
            proc.send_signal(signal.SIGUSR1)
            time.sleep(2)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"mtpipe serve did not end within 30 s of {how}:\n{proc.stderr.read()[-20000:]}")
        assert code == 0, proc.stderr.read() if proc.stderr else ""
        assert proc.stderr is not None and f"at {url}/v1" in proc.stderr.read()  # the URL it listens at, once it does
        _, alive = psutil.wait_procs(children, timeout=10)  # the tracker ends when it sees its pipe close
        assert not alive, [c.cmdline() for c in alive]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_front_loads_neither_torch_nor_generation_code(dense_ckpt: Path) -> None:
    """mlx-lm's package init imports its generation code, which evaluates arrays as it loads: the front,
    which only tokenizes, skips it (and never touches MLX memory)."""
    ctx = multiprocessing.get_context("spawn")
    a, b = ctx.Pipe()
    child = ctx.Process(target=front_imports, args=(b,))
    child.start()
    a.send(str(dense_ckpt))
    assert a.poll(60)
    assert a.recv() == ([], 0)
    child.join(10)


# -- the link's two ends, on a pipe in this process --------------------------------------------------


class ScriptedEngine:
    """An engine whose requests emit what the test tells them to, recording cancellations."""

    has_mtp, max_context, vocab_size, eos = True, 64, 100, {0}

    def __init__(self) -> None:
        self.sinks: dict[int, Any] = {}
        self.cancelled: list[int] = []
        self.opened = threading.Event()

    def open(self, req: GenerationRequest, sink: Any) -> Any:
        if req.max_tokens == 13:
            raise RequestError("thirteen is refused here", "max_tokens", "unlucky")
        index = len(self.sinks)
        self.sinks[index] = sink
        self.opened.set()
        test = self

        class Handle:
            def cancel(self) -> None:
                test.cancelled.append(index)

        return Handle()


class Collect:
    def __init__(self) -> None:
        self.items: list[Any] = []
        self.ended = threading.Event()

    def __call__(self, item: Any) -> None:
        self.items.append(item)
        if item is END:
            self.ended.set()


def _linked(engine: Any) -> tuple[EngineHost, EngineClient]:
    a, b = multiprocessing.Pipe()
    host = EngineHost(engine, a)
    host.start()
    (op, info), = b.recv()
    assert op == "hello" and info == {"has_mtp": True, "max_context": 64, "vocab_size": 100, "eos": [0],
                                      "cluster": False, "constrains": False,
                                      "keeps_prefixes": False}
    return host, EngineClient(b, info, tokenizer=None)


def test_the_link_carries_chunks_errors_and_cancels() -> None:
    engine = ScriptedEngine()
    host, client = _linked(engine)
    try:
        got = Collect()
        handle = client.open(GenerationRequest([1, 2, 3], 8), got)
        assert engine.opened.wait(5)
        sink = engine.sinks[0]
        sink(GenerationChunk("a", [5]))
        sink(GenerationChunk("b", [6], finish_reason="stop"))
        sink(END)
        assert got.ended.wait(5)
        assert [(c.text, c.tokens, c.finish_reason) for c in got.items[:-1]] == [("a", [5], None), ("b", [6], "stop")]
        refused = Collect()
        client.open(GenerationRequest([1], 13), refused)
        assert refused.ended.wait(5)
        assert isinstance(refused.items[0], RequestError) and refused.items[0].code == "unlucky"
        with pytest.raises(RequestError):  # validated in the front: the engine never sees it
            client.open(GenerationRequest([1, 100], 4), Collect())
        busy = Collect()
        handle = client.open(GenerationRequest([1], 8), busy)
        deadline = time.monotonic() + 5
        while 1 not in engine.sinks:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        handle.cancel()
        deadline = time.monotonic() + 5
        while engine.cancelled != [1]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        engine.sinks[1](ServerBusy("full", retry_after=7))
        engine.sinks[1](END)
        assert busy.ended.wait(5)
        assert isinstance(busy.items[0], ServerBusy) and busy.items[0].retry_after == 7
        assert host.open_requests == 0
        odd = Collect()
        client.open(GenerationRequest([1], 8), odd)
        while 2 not in engine.sinks:
            time.sleep(0.01)
        engine.sinks[2](GenerationChunk("x", [5], logprobs=[(0.0, threading.Lock())]))  # does not pickle
        engine.sinks[2](GenerationChunk("y", [6], finish_reason="stop"))
        engine.sinks[2](END)
        assert odd.ended.wait(5)  # the request hears of it, and the link carries on
        assert isinstance(odd.items[0], RuntimeError) and "could not send" in str(odd.items[0])
        assert odd.items[1].text == "y"
    finally:
        client.close()
        host.close()


def test_either_end_going_away() -> None:
    engine = ScriptedEngine()
    EngineHost(engine, multiprocessing.Pipe()[0]).close()  # a host that never started closes quietly
    host, client = _linked(engine)
    got = Collect()
    client.open(GenerationRequest([1], 8), got)
    assert engine.opened.wait(5)
    client.close()  # the front is gone: the engine cancels what it opened
    assert host.closed.wait(5) and engine.cancelled == [0]
    host.close()

    a, b = multiprocessing.Pipe()
    lost = threading.Event()
    client = EngineClient(b, {"has_mtp": True, "max_context": 64, "vocab_size": 100, "eos": [0],
                                       "constrains": False, "keeps_prefixes": False}, tokenizer=None)
    client.on_lost = lost.set
    got = Collect()
    client.open(GenerationRequest([1], 8), got)
    assert a.recv()[0][0] == "open"
    a.close()  # the engine's process is gone: open requests fail, and the front is told to stop
    assert got.ended.wait(5) and lost.wait(5)
    assert isinstance(got.items[0], StageUnavailable)
    with pytest.raises(StageUnavailable):
        client.open(GenerationRequest([1], 8), Collect())
    ready, details = client.check_ready(1.0)
    assert not ready and details["unready"][0]["reason"] == "the engine's process is gone"


class Stuck:
    """An MLX thread that reports being in one unit of work for as long as the test says."""

    def __init__(self) -> None:
        self.busy = 0.0

    def busy_for(self) -> float:
        return self.busy


def test_a_stuck_engine_is_given_up_on() -> None:
    """`EngineClient.watch`: open requests fail, naming why, and the front is told to stop, once the
    engine's MLX thread has been in one round for the stall timeout, or its process has not answered."""
    engine = ScriptedEngine()
    engine.thread = Stuck()  # type: ignore[attr-defined]
    host, client = _linked(engine)
    lost = threading.Event()
    client.on_lost = lost.set
    try:
        got = Collect()
        client.open(GenerationRequest([1], 8), got)
        client.watch(0.4)
        assert engine.opened.wait(5) and not lost.wait(1.0)  # a thread between rounds is not stuck
        engine.thread.busy = 0.3  # type: ignore[attr-defined]
        assert not lost.wait(0.5)  # nor one in a round shorter than the timeout
        engine.thread.busy = 5.0  # type: ignore[attr-defined]
        assert got.ended.wait(5) and lost.is_set()
        assert isinstance(got.items[0], StageUnavailable)
        assert "its MLX thread has been in one round for 5 s" in str(got.items[0])
    finally:
        client.close()
        host.close()
    assert host.closed.wait(5) and set(engine.cancelled) == {0}  # and the engine cancels what it opened

    a, b = multiprocessing.Pipe()  # an engine's process that never answers
    client = EngineClient(b, {"has_mtp": True, "max_context": 64, "vocab_size": 100, "eos": [0],
                                       "constrains": False, "keeps_prefixes": False}, tokenizer=None)
    lost.clear()
    client.on_lost = lost.set
    try:
        got = Collect()
        client.open(GenerationRequest([1], 8), got)
        client.watch(0.4)
        assert got.ended.wait(5) and lost.is_set()
        assert "its process has not answered for" in str(got.items[0])
    finally:
        client.close()
        a.close()


class Unpicklable(str):
    """A stop string that passes validation but does not cross a pipe."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("not this one")


def test_the_front_sends_apart_from_its_callers() -> None:
    """Requests go through the front's sender thread: one that does not pickle fails alone, at once;
    a request that has ended is not cancelled over the link; the sender failing ends the link."""
    a, b = multiprocessing.Pipe()
    client = EngineClient(b, {"has_mtp": True, "max_context": 64, "vocab_size": 100, "eos": [0],
                                       "constrains": False, "keeps_prefixes": False}, tokenizer=None)
    try:
        odd = Collect()
        client.open(GenerationRequest([1], 8, stop=[Unpicklable("x")]), odd)
        assert odd.ended.wait(5) and "could not send this to the engine" in str(odd.items[0])
        done = Collect()
        handle = client.open(GenerationRequest([2], 8), done)
        (op, rid, req), = a.recv()
        assert op == "open" and req.prompt_tokens == [2]  # the odd one never reached the engine
        a.send([("end", rid)])
        assert done.ended.wait(5)
        handle.cancel()  # ended: nothing to send
        client.announce("127.0.0.1", 1)
        assert a.recv() == [("listening", "127.0.0.1", 1)]
    finally:
        client.close()

    a, b = multiprocessing.Pipe()

    def refuse(msg: Any, e: Exception) -> list:
        raise RuntimeError("cannot say")

    outbox = Outbox(b, "test-out", refuse)
    outbox.put(("chunk", 1, threading.Lock()))
    assert a.poll(5) and pytest.raises(EOFError, a.recv)  # the other end hears that the link is over
    outbox.close()
    b.close()


def test_an_api_over_a_lost_engine_answers_503(engine: BatchEngine) -> None:
    from helpers import LiveServer

    from mtpipe.coordinator.api.app import create_app

    a, b = multiprocessing.Pipe()
    client = EngineClient(b, {"has_mtp": True, "max_context": engine.max_context, "vocab_size": engine.vocab_size,
                              "eos": sorted(engine.eos), "constrains": False,
                              "keeps_prefixes": False}, engine.tokenizer)
    a.close()
    deadline = time.monotonic() + 5
    while client.lost is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with LiveServer(create_app(client, MODEL)) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failure", r.text  # (no node's)
        assert c.get("/health").status_code == 503


def test_errors_cross_as_they_were() -> None:
    for error, kind in ((ServerBusy("busy", 3), ServerBusy), (StageUnavailable("gone"), StageUnavailable),
                        (StageError("refused"), StageError), (RequestError("bad", "stop", "c"), RequestError)):
        back = WireError.of(error).exception()
        assert type(back) is kind and str(back) == str(error)
    assert WireError.of(ServerBusy("x", 9)).exception().retry_after == 9
    request = WireError.of(RequestError("bad", "stop", "c")).exception()
    assert isinstance(request, RequestError) and (request.param, request.code) == ("stop", "c")
    other = WireError.of(KeyError("k")).exception()
    assert type(other) is RuntimeError and str(other) == "KeyError: 'k'"


SPAWN_MASK_PROBE = """
import signal, sys
from multiprocessing import util
from mtpipe.coordinator.api.front import FrontProcess, FrontSpec

masks = []
launch = util.spawnv_passfds
def spy(*args):
    masks.append(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set()))
    return launch(*args)
util.spawnv_passfds = spy
front = FrontProcess(None, FrontSpec(sys.argv[1], model_name="m", access_log=False)).spawn()
front.stop()
print(masks[-1], signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set()))
"""


def test_the_api_process_starts_with_ctrl_c_blocked(dense_ckpt: Path) -> None:
    """The API's process is started with SIGINT blocked (a terminal's Ctrl-C while its interpreter starts
    would end it with a fatal error), also where multiprocessing's resource tracker starts first, which
    unblocks SIGINT as it starts; this process's own mask is left as it was. A fresh process: no tracker yet."""
    out = subprocess.run([sys.executable, "-c", SPAWN_MASK_PROBE, str(dense_ckpt)], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["True", "False"]


def _self_signed(directory: Path, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """A certificate for `host` (an IP address) and its key, PEM files in `directory`."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_the_api_over_https(engine: BatchEngine, dense_ckpt: Path, tmp_path: Path) -> None:
    """--ssl-certfile / --ssl-keyfile: the API's process serves HTTPS with them (a client that trusts the
    certificate is answered; plain HTTP is not); files that are not a pair are refused as the command starts."""
    import ssl

    from mtpipe.coordinator.api.tls import api_tls

    cert, key = _self_signed(tmp_path)
    tls = api_tls(str(cert), str(key))
    front = FrontProcess(engine, FrontSpec(str(dense_ckpt), model_name=MODEL, api_key=KEY, access_log=False, tls=tls))
    try:
        url = front.start()
        assert url.startswith("https://127.0.0.1:")
        trusted = ssl.create_default_context(cafile=str(cert))
        r = httpx.post(url + "/v1/completions", headers=AUTH, verify=trusted, timeout=60,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        with pytest.raises(httpx.HTTPError):
            httpx.get(url.replace("https://", "http://") + "/health", timeout=10)
    finally:
        front.stop()
    (tmp_path / "other").mkdir()
    other, _ = _self_signed(tmp_path / "other")
    for certfile, keyfile, says in ((str(cert), None, "give both"), (str(tmp_path / "none.pem"), str(key), "no such file"),
                                    (str(other), str(key), "do not load as a pair")):
        with pytest.raises(ValueError, match=says):
            api_tls(certfile, keyfile)
    from mtpipe.coordinator.cli.main import main

    assert main(["serve", "--model", "/nowhere", "--port", "0", "--ssl-keyfile", str(key)]) == 2
