"""One MLX thread per process: the recorder that checks it, a node doing all its MLX work (loading
included) on its loop thread, and models/mlx_thread.MLXThread.

MLX streams belong to threads: a lazy array built on one thread cannot be evaluated on another, and
on Apple silicon a thread without its own GPU stream fails on its first evaluation. Linux CPU MLX
forgives most of that, so these tests record which threads call into MLX instead of waiting for a
failure that only a Mac would show.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import PROMPTS, node_servers
from mlx.utils import tree_flatten
from mlx_threads import record_mlx_threads

from mtpipe.coordinator.engine.build import remote_engine
from mtpipe.coordinator.engine.engine import Engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.models.config import load_config
from mtpipe.models.loading import arrays_in, load_shard
from mtpipe.models.mlx_thread import MLXThread
from mtpipe.node.loader import LoadKey, check_load, load_stage
from mtpipe.node.server import NodeServer
from mtpipe.node.stage import StageWorker
from mtpipe.node.sysinfo import gpu_limit
from mtpipe.node.wire import make_channel
from mtpipe.proto import mtpipe_pb2 as pb
from mtpipe.proto import mtpipe_pb2_grpc as pb_grpc

MAX_TOKENS = 12


def _on_thread(fn, name: str = "foreign") -> None:
    """Run `fn` on a plain thread of that name and wait for it."""
    t = threading.Thread(target=fn, name=name)
    t.start()
    t.join()


# -- the recorder ---------------------------------------------------------------------------------


def test_recorder_sees_mlx_calls_on_a_plain_thread() -> None:
    real_eval, real_array = mx.eval, mx.array
    out: list = []

    def work() -> None:
        a = mx.array([1.0, 2.0, 3.0])  # construction, an operator, a function, a method
        out.append((a * 2).sum().item())
        mx.eval(a)

    with record_mlx_threads() as rec:
        _on_thread(work)
    assert out == [12.0]
    assert rec.threads == {"foreign"}  # this thread made no MLX call inside the block
    calls = rec.calls_by_thread["foreign"]
    assert calls["array"] == 1 and calls["array.__mul__"] == 1 and calls["array.item"] == 1 and calls["eval"] == 1
    assert mx.eval is real_eval and mx.array is real_array  # everything restored
    assert type(mx.array.__dict__["item"]).__name__ == "nb_method"


def test_recorder_sees_threads_started_before_it_and_keeps_isinstance() -> None:
    go, done = threading.Event(), threading.Event()

    def early() -> None:
        go.wait(10)
        mx.random.normal((2,)).tolist()
        done.set()

    t = threading.Thread(target=early, name="early")
    t.start()
    with record_mlx_threads() as rec:
        go.set()
        assert done.wait(10)
        assert isinstance(mx.zeros((1,)), mx.array)  # the stand-in answers for the real class
    t.join()
    assert rec.threads == {"early", threading.current_thread().name}
    assert rec.calls_by_thread["early"]["random.normal"] == 1
    with pytest.raises(RuntimeError), record_mlx_threads(), record_mlx_threads():
        pass


# -- a node: every MLX call on its loop thread ----------------------------------------------------


def _generate(engine: Engine, text: str, depth: int) -> list[int]:
    prompt = engine.tokenizer.encode(text)
    return engine.complete(GenerationRequest(prompt, max_tokens=MAX_TOKENS, mtp_depth=depth)).tokens


@pytest.mark.parametrize("data_plane", [True, False], ids=["tcp", "grpc"])
def test_a_node_does_all_its_mlx_work_on_its_loop_thread(dense_engine: Engine, dense_ckpt: Path,
                                                         data_plane: bool) -> None:
    # Two nodes in this process: hidden states cross between them (decoded on the receiving node),
    # the last one loads the MTP head and starts the decode rounds itself.
    gpu_limit.cache_clear()  # Health asks MLX for it once per process: make this test's Health ask
    with record_mlx_threads() as rec, node_servers(2, data_plane=data_plane) as nodes:
        engine = remote_engine(dense_ckpt, [s.address for s in nodes], dtype="float32")
        try:
            got = [_generate(engine, PROMPTS[0], depth) for depth in (0, 2)]
            health = engine.pipeline.health()
        finally:
            engine.pipeline.close()
        loops = {s.thread.ident for s in nodes}
    assert all(h.loaded for h in health)
    # The nodes' loop threads are the only ones that touched MLX: no load thread, no reader or
    # executor thread; and the coordinator (this thread, its load pool, its subscription and stream
    # threads) touches none for a remote pipeline, tokenization aside (no MLX in it).
    assert rec.threads == {"node-loop"}, {k: v.most_common(5) for k, v in rec.calls_by_thread.items()}
    assert rec.idents("node-loop") == loops  # both nodes, each on its own loop thread
    calls = rec.calls_by_thread["node-loop"]
    assert calls["new_thread_local_stream"] == 2 and calls["load"] >= 2  # each node's stream, its lazy load
    assert calls["array"] > 0  # hidden states decoded from the wire on the loop thread
    assert got == [_generate(dense_engine, PROMPTS[0], depth) for depth in (0, 2)]


def test_load_yields_to_the_loop_between_pieces(dense_ckpt: Path) -> None:
    n = load_config(dense_ckpt).num_layers
    key = LoadKey(str(dense_ckpt), 0, n, n, True, "float32")

    async def load_while_ticking() -> tuple[StageWorker, int]:
        ticks, loading = 0, True

        async def tick() -> None:
            nonlocal ticks
            while loading:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.get_running_loop().create_task(tick())
        worker = await load_stage(check_load(key), piece_bytes=1)  # one array a piece
        loading = False
        await ticker
        return worker, ticks

    worker, ticks = asyncio.run(load_while_ticking())
    assert ticks >= len(arrays_in(worker.model)) - 1  # the loop ran between every two pieces
    ref = dict(tree_flatten(load_shard(dense_ckpt, mtp=True, dtype=mx.float32).model.parameters()))
    got = dict(tree_flatten(worker.model.parameters()))
    assert got.keys() == ref.keys()
    assert all(mx.array_equal(got[k], ref[k]).item() for k in ref)


def test_adopt_from_another_thread_lands_on_the_loop(dense_ckpt: Path) -> None:
    n = load_config(dense_ckpt).num_layers
    stage = StageWorker(load_shard(dense_ckpt, dtype=mx.float32))  # built (and materialized) on this thread
    server = NodeServer("127.0.0.1", 0).start()
    try:
        where: list[str] = []
        adopt = server.service._adopt
        server.service._adopt = lambda w, k: (where.append(threading.current_thread().name), adopt(w, k))
        with record_mlx_threads() as rec:
            server.service.adopt(stage, LoadKey(str(dense_ckpt), 0, n, n, True, "float32"))
            stub = pb_grpc.NodeStub(make_channel(server.address))
            health = stub.Health(pb.HealthRequest(), timeout=10)
        assert where == ["node-loop"]
        assert health.loaded and (health.start, health.end) == (0, n)
        assert rec.threads <= {"node-loop"}  # adoption itself does no MLX work
    finally:
        server.stop(0)


# -- MLXThread --------------------------------------------------------------------------------------


@pytest.fixture
def mlx_thread():
    t = MLXThread(name="mlx-test")
    yield t
    t.close()


def test_mlx_thread_call_submit_run(mlx_thread: MLXThread) -> None:
    assert mlx_thread.call(lambda x, y=0: x + y, 2, y=3) == 5
    assert mlx_thread.submit(lambda: threading.current_thread().name).result(10) == "mlx-test"
    assert asyncio.run(mlx_thread.run(lambda: 7)) == 7
    assert not mlx_thread.owns() and mlx_thread.call(mlx_thread.owns)
    assert mlx_thread.call(lambda: mlx_thread.call(lambda: 1) + 1) == 2  # a call from the thread runs inline


def test_mlx_thread_exceptions_propagate(mlx_thread: MLXThread) -> None:
    def fail() -> None:
        raise KeyError("nope")

    with pytest.raises(KeyError, match="nope"):
        mlx_thread.call(fail)
    with pytest.raises(KeyError):
        mlx_thread.submit(fail).result(10)
    with pytest.raises(KeyError):
        asyncio.run(mlx_thread.run(fail))
    assert mlx_thread.call(lambda: 1) == 1  # the thread survives its callers' failures


def test_mlx_thread_says_how_long_its_unit_of_work_has_run(mlx_thread: MLXThread) -> None:
    """`busy_for`, what the API's stall watch reads: 0 between units, growing inside one, for hand-offs and
    for the worker's rounds; and a call that would wait on a stuck thread gives up after its timeout."""
    assert mlx_thread.busy_for() == 0.0
    release = threading.Event()
    held = mlx_thread.submit(release.wait, 10)
    with pytest.raises(TimeoutError):
        mlx_thread.call(lambda: 1, timeout=0.3)
    assert mlx_thread.busy_for() >= 0.25  # (the held unit began just after the call's wait did)
    release.set()
    assert held.result(10) and mlx_thread.call(lambda: 1) == 1
    assert mlx_thread.busy_for() < 0.1  # (the unit that answered may not have closed yet)
    rounds = threading.Event()
    mlx_thread.set_worker(lambda: rounds.wait(10) and False)  # one round, held until the test lets it end
    deadline = time.monotonic() + 5
    while mlx_thread.busy_for() < 0.2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    rounds.set()
    mlx_thread.set_worker(None)
    assert mlx_thread.call(lambda: 1) == 1 and mlx_thread.busy_for() < 0.1


def test_mlx_thread_does_the_mlx_work(mlx_thread: MLXThread) -> None:
    with record_mlx_threads() as rec:
        # Built lazily and evaluated within one call; and built in one call, evaluated in a later one.
        assert mlx_thread.call(lambda: (mx.arange(10) * 2).sum().item()) == 90
        lazy = mlx_thread.call(lambda: mx.arange(4) + 1)
        assert mlx_thread.call(lazy.tolist) == [1, 2, 3, 4]
    assert rec.threads == {"mlx-test"}


def test_mlx_thread_worker_runs_between_hand_offs(mlx_thread: MLXThread) -> None:
    units: list[int] = []
    finished = threading.Event()

    def worker() -> bool:
        units.append(len(units))
        if len(units) == 5:
            finished.set()
        return len(units) < 5

    mlx_thread.set_worker(worker)
    assert finished.wait(10)
    assert mlx_thread.call(lambda: len(units)) == 5  # idle again: no more units run
    mlx_thread.set_worker(None)


def test_mlx_thread_close_fails_late_submissions() -> None:
    t = MLXThread(name="mlx-closing")
    assert t.call(lambda: 1) == 1
    t.close()
    with pytest.raises(RuntimeError, match="closed"):
        t.submit(lambda: 1).result(10)
    with pytest.raises(RuntimeError, match="closed"):
        t.call(lambda: 1)
    t.close()  # twice is fine


def test_a_task_handed_over_as_the_thread_closes_is_run_or_refused() -> None:
    """A hand-off that passed the closed check just before close() (a thread switch between the check
    and queuing, forced here) still gets an answer: its caller never waits forever."""
    import queue
    import time

    thread = MLXThread("closing")
    tasks = thread._tasks

    queuing = threading.Event()

    class Preempted:  # queuing a task pauses, as a thread switch would
        def __getattr__(self, name: str) -> object:
            return getattr(tasks, name)

        def put(self, item: object) -> None:
            if isinstance(item, tuple):
                queuing.set()
                time.sleep(0.3)  # (the close below runs meanwhile, or waits for the hand-off)
            tasks.put(item)

    thread._tasks = Preempted()  # type: ignore[assignment]
    out: queue.SimpleQueue = queue.SimpleQueue()

    def call() -> None:
        try:
            out.put(thread.call(lambda: 42))
        except RuntimeError as e:
            out.put(e)

    threading.Thread(target=call, daemon=True).start()
    assert queuing.wait(5)  # past the closed check
    thread.close()
    answer = out.get(timeout=5)  # (queue.Empty: the caller would wait forever)
    assert answer == 42 or isinstance(answer, RuntimeError)


def test_arrays_kept_per_thread_are_never_another_threads() -> None:
    """The ragged caches' index arrays are kept per thread (an array belongs to the thread that made it
    until evaluated); a thread that ends hands its id on to the next, never its arrays."""
    from mtpipe.models import ragged

    seen: list[tuple[int, int]] = []
    for _ in range(3):
        t = threading.Thread(target=lambda: seen.append((threading.get_ident(), ragged._thread())))
        t.start()
        t.join()
    assert len({serial for _, serial in seen}) == 3
    assert ragged._thread() == ragged._thread() not in {serial for _, serial in seen}
