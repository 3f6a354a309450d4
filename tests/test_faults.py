"""Faults leave nothing behind (issue 16): a frozen node's requests fail, and afterwards no node holds a
sequence of theirs (leases: a sequence stays only while its client renews it) and the next requests
succeed. Node processes on 127.0.0.1, frozen with SIGSTOP; bounded in time.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from helpers import PROMPTS, undisturbed

from mtpipe.coordinator.bench.nodes import NodeProcesses
from mtpipe.coordinator.engine.build import remote_engine, ring_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.coordinator.engine.sinks import END, open_stream
from mtpipe.node.leases import Leases

FREEZE_S = 4.0
SETTLE_S = 15.0  # failures noticed (~2.5 s), leases run out (5 s), sweeps (1 s), with room for a slow machine


def active(engine) -> list[int]:
    return [h.active_sequences for h in engine.pipeline.health(timeout=5.0)]


def test_leases_run_out_unless_renewed() -> None:
    leases = Leases(lease_s=5.0)
    leases.start("a", now=0.0)
    leases.start("b", now=0.0)
    leases.renew(["a", "b", "c"], owned={"a", "c"}, now=4.0)  # b is another client's; c never started here
    assert leases.expired(now=6.0) == ["b"]
    assert leases.expired(now=9.5) == ["a", "b"]
    assert "c" not in leases.expires


def test_a_lease_stands_still_while_the_nodes_loop_is_held() -> None:
    """A step holds the node's loop (a long prompt chunk): renewals sent meanwhile wait behind it. The
    sweep that comes late adds the time it was held to every lease and to the groups' idle clocks, so
    a sequence its client renews all along is not released for the renewals the loop could not hear."""
    import asyncio

    from mtpipe.node.leases import LATE_S, SWEEP_S, LeaseHolder

    class Node(LeaseHolder):
        name = "n"
        _subs: dict = {}

        def __init__(self) -> None:
            self._owners = {"s": "client"}
            self.released: list[str] = []
            self.paused: list[float] = []

        def _release(self, seq_id: str) -> bool:
            self.released.append(seq_id)
            return bool(self._owners.pop(seq_id, None))

        def _emit(self, client_id: str, event) -> None:
            pass

        def left_to_the_ring(self, seq_id: str) -> bool:
            return False

        def end_idle_groups(self, idle_s: float) -> None:
            pass

        def pause_groups(self, seconds: float) -> None:
            self.paused.append(seconds)

    async def held(for_s: float) -> Node:
        node = Node()
        node.lease("s")
        node._sweep_due -= for_s  # as if a step had held the loop since the lease began, `for_s` seconds
        node.leases.expires["s"] -= for_s
        node._sweep()
        return node

    node = asyncio.run(held(6.0))
    assert node.released == [] and node.paused == [pytest.approx(6.0 - SWEEP_S, abs=0.2)]  # (it was due 1 s in)
    node = asyncio.run(held(LATE_S / 2))  # a sweep on time: nothing moves
    assert node.released == [] and node.paused == []
    leases = Leases(lease_s=5.0)
    leases.start("a", now=0.0)
    leases.pause(6.0)
    assert leases.expired(now=7.0) == [] and leases.expired(now=11.5) == ["a"]

    async def chunks(n: int, step_s: float) -> Node:
        """A long prompt's chunks back to back: each step adds its time; the sweep after them adds only
        what is late beyond it (nothing counted twice), and no renewal came through meanwhile."""
        node = Node()
        node.lease("s")
        for _ in range(n):
            node.leases.expires["s"] -= step_s  # (the clock ran on while the step held the loop)
            node._sweep_due -= step_s
            node.held(step_s)
        node._sweep()
        return node

    node = asyncio.run(chunks(8, 1.4))  # 11.2 s of steps, longer than two leases
    assert node.released == [] and sum(node.paused) == pytest.approx(8 * 1.4, abs=0.2)
    node = asyncio.run(chunks(8, LATE_S / 2))  # decode rounds: nothing moves
    assert node.released == [] and node.paused == []


def test_a_sequence_a_node_ended_itself_may_resume_and_a_hop_that_does_not_carry_is_named() -> None:
    """A node's error about one sequence it ended on its own account (its group's rounds stopped coming,
    its lease ran out) is a loss the request resumes from, not a refused step; and a pipeline formed
    again over a hop that does not carry is not formed (it would lose its first round there again)."""
    from types import SimpleNamespace

    from mtpipe.coordinator.pipeline.nodes import NodeFailure, RemoteStageError, RowLost, check_hops, step_error
    from mtpipe.node.protocol import StageUnavailable
    from mtpipe.proto import mtpipe_pb2 as pb

    for code in ("UNAVAILABLE", "ABORTED"):
        e = step_error("n:1", code, "no round of its group came back")
        assert isinstance(e, RowLost) and isinstance(e, StageUnavailable) and "n:1" in str(e)
    assert type(step_error("n:1", "INVALID_ARGUMENT", "bad")) is RemoteStageError

    def node(address: str, next: str, rtt: float) -> SimpleNamespace:
        return SimpleNamespace(address=address, stub=SimpleNamespace(
            Health=lambda req, timeout: pb.HealthReply(next=next, next_rtt_ms=rtt if req.probe_next else 0.0)))

    check_hops([node("a:1", "b:1", 0.4), node("b:1", "c:1", 0.3), node("c:1", "", 0.0)])
    with pytest.raises(NodeFailure, match=r"node c:1: not reached from node b:1"):
        check_hops([node("a:1", "b:1", 0.4), node("b:1", "c:1", -1.0), node("c:1", "", 0.0)])


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("build", "victims"), [(ring_engine, (1,)), (remote_engine, (1,))],
                         ids=["ring-last", "per_sequence-last"])
def test_freeze_cycles_leave_no_sequences(dense_ckpt: Path, build, victims: tuple[int, ...]) -> None:
    """A node frozen for 4 s: the ring engine's streams pause and go on with the tokens of an
    undisturbed run (the per-sequence engine's fail, naming the node); either way every node holds
    0 sequences afterwards and new requests succeed, cycle after cycle (one node frozen per cycle)."""
    with NodeProcesses(2, model_dirs=[dense_ckpt]) as nodes:
        engine = build(dense_ckpt, nodes.addresses, dtype="float32")
        resumes = build is ring_engine
        try:
            reqs = [GenerationRequest(engine.tokenizer.encode(PROMPTS[i + 1]), max_tokens=96, mtp_depth=2)
                    for i in range(4)]
            want = undisturbed(dense_ckpt, reqs)
            for victim in victims:
                sinks = []
                for r in reqs:
                    q: queue.SimpleQueue = queue.SimpleQueue()
                    open_stream(engine, r, q.put)
                    sinks.append(q)
                got: list[list[int]] = [[] for _ in reqs]
                for i, q in enumerate(sinks):
                    got[i] += q.get(timeout=60).tokens
                nodes.freeze(victim, FREEZE_S)
                before = sum(map(len, got))
                for i, q in enumerate(sinks):  # every stream ends: whole when resumed, else with an error
                    while (item := q.get(timeout=60)) is not END and not isinstance(item, BaseException):
                        got[i] += item.tokens
                    if resumes:
                        assert item is END and got[i] == want[i]
                    else:
                        assert isinstance(item, BaseException) and nodes.addresses[victim] in str(item)
                assert not resumes or sum(map(len, got)) > before  # (the freeze came mid-stream)
                deadline = time.monotonic() + SETTLE_S
                while any(left := active(engine)) and time.monotonic() < deadline:
                    time.sleep(0.25)
                assert left == [0, 0]
                assert engine.complete(reqs[0]).tokens == want[0]
        finally:
            getattr(engine, "close", engine.pipeline.close)()


def test_a_sequence_nobody_renews_is_released(dense_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sequence whose release never arrives (lost with a stream, a crashed client) is gone from every
    node once its lease runs out; one its client still wants stays however long it idles. So is one
    started by a client that never named itself, through the Step RPC. (Leases of 3 s and sweeps
    every 0.25 s, for the suite's time: the client still renews every second.)"""
    from helpers import node_servers

    from mtpipe.node import leases
    from mtpipe.node.protocol import SamplingParams, StepKind, StepRequest
    from mtpipe.node.wire import make_channel, request_to_frame
    from mtpipe.proto import mtpipe_pb2_grpc as pb_grpc

    lease_s, sweep_s = 3.0, 0.25
    monkeypatch.setattr(leases, "SWEEP_S", sweep_s)
    with node_servers(2) as servers:
        for s in servers:
            s.service._leases = Leases(lease_s=lease_s)
        engine = remote_engine(dense_ckpt, [s.address for s in servers], dtype="float32")
        pipeline = engine.pipeline
        try:
            tokens = engine.tokenizer.encode(PROMPTS[2])
            for seq in ("kept", "lost"):
                pipeline.steps([StepRequest(seq, 0, StepKind.PREFILL, tokens, final=True)])
            with make_channel(servers[0].address) as ch:
                frame = request_to_frame(StepRequest("unnamed", 0, StepKind.PREFILL, tokens, params=SamplingParams()), "")
                pb_grpc.NodeStub(ch).Step(frame, timeout=10)
            assert active(engine) == [3, 2]
            with pipeline._lock:  # as if its release had been lost: nobody renews it any more
                pipeline.live.discard("lost")
            deadline = time.monotonic() + SETTLE_S
            while active(engine) != [1, 1] and time.monotonic() < deadline:
                time.sleep(0.25)
            assert active(engine) == [1, 1]
            assert all("kept" in s.service.worker.sequences for s in servers)
            time.sleep(lease_s + 2 * sweep_s)  # renewed all along: still there
            assert all("kept" in s.service.worker.sequences for s in servers)
        finally:
            pipeline.close()


@contextmanager
def one_request_on_short_leases(ckpt: Path, monkeypatch: pytest.MonkeyPatch, lease_s: float,
                                resume_window: float) -> Iterator[tuple[Any, list, queue.SimpleQueue]]:
    """Two in-process nodes whose leases last `lease_s` (swept every 0.25 s), a ring engine over them
    and one request that only max_tokens would end: (engine, nodes, the request's items)."""
    from helpers import node_servers

    from mtpipe.node import leases
    from mtpipe.node.protocol import SamplingParams

    monkeypatch.setattr(leases, "SWEEP_S", 0.25)
    with node_servers(2) as servers:
        for s in servers:
            s.service._leases = Leases(lease_s=lease_s)
        engine = ring_engine(ckpt, [s.address for s in servers], dtype="float32", resume_window=resume_window)
        try:
            q: queue.SimpleQueue = queue.SimpleQueue()
            never_ends = SamplingParams(logit_bias=tuple((t, -100.0) for t in sorted(engine.eos)))
            engine.open(GenerationRequest(engine.tokenizer.encode(PROMPTS[0]), max_tokens=4000, params=never_ends),
                        q.put)
            yield engine, servers, q
        finally:
            engine.close()


def stop_renewing(engine: Any, seq_id: str) -> None:
    """As if a sequence's renewals stopped reaching the nodes."""
    with engine.pipeline._lock:
        engine.pipeline.live.discard(seq_id)


def test_a_row_whose_lease_ran_out_fails_at_once(dense_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ring row whose renewals stopped reaching the nodes while its client is still there is released,
    and its client hears so at once, naming the node (not after the engine's wait for stalled rows)."""
    lease_s = 2.0
    with one_request_on_short_leases(dense_ckpt, monkeypatch, lease_s, resume_window=0) as (engine, servers, q):
        assert not isinstance(q.get(timeout=60), BaseException)
        stop_renewing(engine, next(iter(engine._decoding.values())).seq_id)
        start = time.monotonic()
        while not isinstance(item := q.get(timeout=lease_s + 10), BaseException):
            pass
        assert "lease" in str(item) and time.monotonic() - start < lease_s + 5
        assert any(s.address in str(item) for s in servers)


def test_a_request_lost_again_and_again_ends(dense_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row lost with its node resumes, but a loss that keeps coming back is not going away: the
    request lost more than MAX_RESUMES times ends with the error that names the node, and leaves
    nothing on the nodes. (Here its renewals stop reaching the nodes each time it has resumed.)"""
    from mtpipe.coordinator.engine.ring import MAX_RESUMES

    with one_request_on_short_leases(dense_ckpt, monkeypatch, 1.0, resume_window=10.0) as (engine, servers, q):
        lost: list[str] = []
        deadline = time.monotonic() + 60
        while not isinstance(item := q.get(timeout=30), BaseException) and time.monotonic() < deadline:
            live = next(iter(engine._decoding.values()), None)
            if live is not None and live.seq_id not in lost and live.seq_id in engine.pipeline.live:
                lost.append(live.seq_id)
                stop_renewing(engine, live.seq_id)
        assert isinstance(item, BaseException), "the request never ended"
        assert f"lost {MAX_RESUMES + 1} times: the request ends" in str(item) and "lease" in str(item)
        assert any(s.address in str(item) for s in servers)
        assert len(lost) == MAX_RESUMES + 1 and live.resumes == MAX_RESUMES
        assert q.get(timeout=5) is END
        deadline = time.monotonic() + SETTLE_S
        while any(left := active(engine)) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert left == [0, 0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2])  # (a middle node lost and back: the hung-loop test below)
def test_a_restarted_node_is_taken_back_and_requests_resume(dense_ckpt: Path, n: int) -> None:
    """Kill the last node mid-generation and start it again on its address: the engine forms the
    pipeline again by itself (new requests meanwhile get a retry hint, /health is 503 naming the node, then
    200 again), and the greedy requests (one with penalties) and a seeded sampled one that
    were running finish with exactly the tokens of an undisturbed run."""
    from mtpipe.coordinator.api.readiness import Readiness
    from mtpipe.coordinator.engine.sinks import ServerBusy
    from mtpipe.node.protocol import SamplingParams

    with NodeProcesses(n, model_dirs=[dense_ckpt]) as nodes:
        engine = ring_engine(dense_ckpt, nodes.addresses, dtype="float32")
        readiness = Readiness(engine, timeout=2.0)
        try:
            reqs = [GenerationRequest(engine.tokenizer.encode(PROMPTS[i]), max_tokens=48, mtp_depth=d)
                    for i, d in enumerate([0, 2, 3])]
            for i, params in enumerate([SamplingParams(temperature=0.8, top_p=0.95, seed=11),
                                        SamplingParams(presence_penalty=1.5, frequency_penalty=0.5)]):
                reqs.append(GenerationRequest(engine.tokenizer.encode(PROMPTS[3 + i]), max_tokens=96, mtp_depth=2,
                                              params=params))
            want = undisturbed(dense_ckpt, reqs)
            sinks = []
            for r in reqs:
                q: queue.SimpleQueue = queue.SimpleQueue()
                engine.open(r, q.put)
                sinks.append(q)
            got: list[list[int]] = [[] for _ in reqs]
            for i, q in enumerate(sinks):  # some tokens out before the fault (penalties then count them)
                while len(got[i]) < 12:
                    got[i] += q.get(timeout=60).tokens
            nodes.kill(-1)
            deadline = time.monotonic() + 10
            while engine.pipeline.reformer.down is None and time.monotonic() < deadline:
                time.sleep(0.05)
            with pytest.raises(ServerBusy):
                engine.open(reqs[0], lambda item: None)
            ready, details = readiness.check()  # GET /health: 503 naming the node
            assert not ready and nodes.addresses[-1] in [u["address"] for u in details["unready"]]
            assert nodes.addresses[-1] in details["reforming"]["after"]  # (and that it is being formed again)
            nodes.start(-1)
            for i, q in enumerate(sinks):
                while (item := q.get(timeout=90)) is not END:
                    assert not isinstance(item, BaseException), item
                    got[i] += item.tokens
            assert got == want
            assert engine.pipeline.reformer.down is None and readiness.check() == (True, {"nodes": n, "unready": []})
            assert engine.complete(reqs[1]).tokens == want[1]  # and it serves new requests
            deadline = time.monotonic() + SETTLE_S
            while any(left := active(engine)) and time.monotonic() < deadline:
                time.sleep(0.25)
            assert left == [0] * n
        finally:
            engine.close()


@pytest.mark.timeout(120)
def test_health_is_ready_again_once_the_pipeline_is_formed_again(dense_ckpt: Path) -> None:
    """The last node lost while idle and started again: once the pipeline is formed again, the links
    broken with it are open again (GET /health is 200), with no request needed to open them."""
    from mtpipe.coordinator.api.readiness import Readiness

    with NodeProcesses(2, model_dirs=[dense_ckpt]) as nodes:
        engine = ring_engine(dense_ckpt, nodes.addresses, dtype="float32")
        readiness = Readiness(engine, timeout=2.0)
        try:
            req = GenerationRequest(engine.tokenizer.encode(PROMPTS[0]), max_tokens=8, mtp_depth=2)
            want = engine.complete(req).tokens  # (the links are open)
            nodes.kill(-1)
            deadline = time.monotonic() + 10
            while engine.pipeline.reformer.down is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine.pipeline.reformer.down is not None
            nodes.start(-1)
            deadline = time.monotonic() + 60
            while engine.pipeline.reformer.down is not None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert engine.pipeline.reformer.down is None
            deadline = time.monotonic() + 15  # (a node busy beside other test workers may miss one Health)
            while (state := readiness.check())[0] is False and time.monotonic() < deadline:
                time.sleep(0.5)
            assert state == (True, {"nodes": 2, "unready": []})  # (before any request: none opened the links)
            assert engine.complete(req).tokens == want
        finally:
            engine.close()


HANG_S = 4.0


@pytest.mark.timeout(120)
def test_a_node_whose_loop_hangs_is_named_within_5_s(dense_ckpt: Path) -> None:
    """The middle of 3 nodes hangs: its event loop blocks while its connections stay up (gRPC's core
    still answers keepalive pings). It stops answering the lease renewals, so within 5 s the pipeline
    is down naming it (not the last node, which only sees the rounds stop). The ring engine's streams
    go on once it serves again, with the tokens of an undisturbed run, and no node holds a sequence
    afterwards. (The renewals are the pipeline's: the per-sequence engine hears the same.)"""
    from helpers import node_servers
    from mtpipe.node.protocol import SamplingParams

    with node_servers(3) as servers:
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32")
        hung = servers[1].address
        try:
            never_ends = SamplingParams(logit_bias=tuple((t, -100.0) for t in sorted(engine.eos)))
            reqs = [GenerationRequest(engine.tokenizer.encode(PROMPTS[i]), max_tokens=160, mtp_depth=2,
                                      params=never_ends) for i in range(2)]
            want = undisturbed(dense_ckpt, reqs)
            sinks = []
            for r in reqs:
                q: queue.SimpleQueue = queue.SimpleQueue()
                open_stream(engine, r, q.put)
                sinks.append(q)
            got: list[list[int]] = [q.get(timeout=60).tokens for q in sinks]
            start = time.monotonic()
            servers[1]._loop.call_soon_threadsafe(time.sleep, HANG_S)
            before = sum(map(len, got))
            reformer = engine.pipeline.reformer
            while reformer.down is None and time.monotonic() - start < 10:
                time.sleep(0.02)
            assert time.monotonic() - start < 5.0 and hung in str(reformer.down), reformer.down
            for i, q in enumerate(sinks):
                while (item := q.get(timeout=60)) is not END and not isinstance(item, BaseException):
                    got[i] += item.tokens
                assert item is END and got[i] == want[i]
            assert sum(map(len, got)) > before  # (the hang came mid-stream)
            deadline = time.monotonic() + SETTLE_S
            while any(left := active(engine)) and time.monotonic() < deadline:
                time.sleep(0.25)
            assert left == [0, 0, 0]
            assert len(engine.complete(reqs[0]).tokens) == reqs[0].max_tokens  # and it serves on
        finally:
            engine.close()


def test_a_node_is_silent_from_its_oldest_unanswered_renewal() -> None:
    from mtpipe.coordinator.pipeline.renewals import PREFILL_SILENT_S, SILENT_S, Silence

    silence = Silence(2)
    for t in (0.0, 1.0, 2.0):
        silence.sent(t)
    silence.answer(0, sent=2.0)
    silence.answer(1, sent=0.0)  # a late answer to an old renewal: the loop served then
    assert silence.silent(now=1.0 + SILENT_S, busy_until=0.0) == []
    assert silence.silent(now=4.0, busy_until=0.0) == [(1, 3.0)]
    assert silence.silent(now=4.0, busy_until=1.5) == []  # it may still compute prompt chunks sent until 1.5
    assert silence.silent(now=1.5 + PREFILL_SILENT_S, busy_until=1.5) == [(1, PREFILL_SILENT_S + 0.5)]
    silence.reset()  # nothing asked (no sequences, the pipeline down), or nothing sent (a stall here)
    assert silence.silent(now=100.0, busy_until=0.0) == []


@pytest.mark.timeout(60)
def test_a_long_prompt_step_is_not_a_hang(dense_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's loop answers nothing while it computes a step. A prompt chunk that takes longer than a
    hung node is given (a large model on a small machine) is waited for: the pipeline stays up and the
    request completes. (A hung node is given 1 s here, for the suite's time.)"""
    from helpers import node_servers

    from mtpipe.coordinator.pipeline import renewals
    from mtpipe.node.protocol import StepKind

    monkeypatch.setattr(renewals, "SILENT_S", 1.0)
    SILENT_S = renewals.SILENT_S

    with node_servers(2) as servers:
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32")
        try:
            worker = servers[1].service.worker
            step = worker.step

            def slow(req, hidden=None, joins_at=None):
                if req.kind is StepKind.PREFILL and not req.final:
                    time.sleep(SILENT_S + 1.5)
                return step(req, hidden, joins_at)

            worker.step = slow
            result = engine.complete(GenerationRequest(engine.tokenizer.encode(PROMPTS[0]), max_tokens=8))
            assert len(result.tokens) == 8 and engine.pipeline.reformer.down is None
        finally:
            engine.close()


def test_a_node_named_by_its_own_message_is_named_once() -> None:
    from mtpipe.coordinator.pipeline.nodes import NodeFailure, TakenOver
    from mtpipe.node.weights import WeightStore

    assert str(NodeFailure("10.0.0.2:52700", "10.0.0.2:52700: model f94 is not here")) == \
        "node 10.0.0.2:52700: model f94 is not here"
    assert str(TakenOver("b", "node b: was taken over")) == "node b: was taken over"
    assert str(NodeFailure("b", "load failed")) == "node b: load failed"
    assert WeightStore(["/m", "/n", "/m"]).model_dirs[:2] == [Path("/m"), Path("/n")]


def test_a_reform_attempts_reason_is_logged_once_and_told(caplog: pytest.LogCaptureFixture) -> None:
    """Why the attempts to form the pipeline again fail (a node back that cannot load its shard), logged
    when it changes, kept for /health and the refusals, and forgotten once the pipeline serves."""
    import logging

    from mtpipe.coordinator.pipeline.reform import Reformer

    outcomes = [RuntimeError("node b: no shard loaded")] * 3 + [RuntimeError("node b: transfer from c failed")]
    seen: list[object] = []

    def reform() -> None:
        seen.append(reformer.attempt_error)
        if outcomes:
            raise outcomes.pop(0)

    reformer = Reformer(reform, interval=0.01)
    with caplog.at_level(logging.WARNING, logger="mtpipe.coordinator.pipeline.reform"):
        reformer.lost(ConnectionError("node b lost"))
        assert reformer.wait(10)
    assert [str(e) if e else None for e in seen] == [None, *["node b: no shard loaded"] * 3,
                                                    "node b: transfer from c failed"]
    attempts = [r.getMessage() for r in caplog.records if "attempt" in r.getMessage() and "failed" in r.getMessage()]
    assert attempts == ["re-forming the pipeline: attempt 1 failed: node b: no shard loaded",
                        "re-forming the pipeline: attempt 4 failed: node b: transfer from c failed"]
    assert reformer.down is None and reformer.attempt_error is None
    reformer.stop()
