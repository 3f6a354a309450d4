"""Faults leave nothing behind (issue 16): a frozen node's requests fail, and afterwards no node holds a
sequence of theirs (leases: a sequence stays only while its client renews it) and the next requests
succeed. Node processes on 127.0.0.1, frozen with SIGSTOP; bounded in time.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import PROMPTS

from mtpipe.coordinator.engine.batch import END
from mtpipe.coordinator.engine.build import remote_engine, ring_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.coordinator.pipeline.nodes import wait_for_nodes
from mtpipe.node.leases import LEASE_S, SWEEP_S, Leases
from mtpipe.node.spawn import node_command

FREEZE_S = 4.0
SETTLE_S = 15.0  # failures noticed (~2.5 s), leases run out (5 s), sweeps (1 s), with room for a slow machine


@contextmanager
def node_processes(n: int) -> Iterator[list[tuple[subprocess.Popen, str]]]:
    procs = []
    try:
        for _ in range(n):
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            cmd = node_command("--host", "127.0.0.1", "--port", str(port))
            procs.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
                          f"127.0.0.1:{port}"))
        wait_for_nodes([a for _, a in procs], timeout=120)
        yield procs
    finally:
        for p, _ in procs:
            p.kill()
            p.wait()


def open_stream(engine, req: GenerationRequest, sink) -> None:
    """A streaming request on a thread of its own, chunks (then an exception or END) to `sink`."""
    if hasattr(engine, "open"):
        engine.open(req, sink)
        return

    def run() -> None:
        try:
            for chunk in engine.generate(req):
                sink(chunk)
        except Exception as e:  # noqa: BLE001 - handed to the test
            sink(e)
        sink(END)

    threading.Thread(target=run, daemon=True).start()


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


@pytest.mark.timeout(180)
@pytest.mark.parametrize("victim", [0, 1])
@pytest.mark.parametrize("build", [ring_engine, remote_engine], ids=["ring", "per_sequence"])
def test_freeze_cycles_leave_no_sequences(dense_ckpt: Path, build, victim: int) -> None:
    """Streams through a node frozen for 4 s fail; then every node holds 0 sequences and new requests
    succeed, cycle after cycle."""
    with node_processes(2) as procs:
        engine = build(dense_ckpt, [a for _, a in procs], dtype="float32")
        try:
            tokens = engine.tokenizer.encode(PROMPTS[0])
            for _ in range(2):
                sinks = []
                for i in range(4):
                    q: queue.SimpleQueue = queue.SimpleQueue()
                    prompt = engine.tokenizer.encode(PROMPTS[i + 1])
                    open_stream(engine, GenerationRequest(prompt, max_tokens=3000, mtp_depth=2), q.put)
                    sinks.append(q)
                for q in sinks:
                    assert not isinstance(q.get(timeout=60), BaseException)
                pid = procs[victim][0].pid
                os.kill(pid, signal.SIGSTOP)
                time.sleep(FREEZE_S)
                os.kill(pid, signal.SIGCONT)
                for q in sinks:  # every stream ends, with an error
                    item = q.get(timeout=30)
                    while item is not END and not isinstance(item, BaseException):
                        item = q.get(timeout=30)
                    assert isinstance(item, BaseException)
                deadline = time.monotonic() + SETTLE_S
                while any(left := active(engine)) and time.monotonic() < deadline:
                    time.sleep(0.25)
                assert left == [0, 0]
                result = engine.complete(GenerationRequest(tokens, max_tokens=8))
                assert result.finish_reason in ("length", "stop") and result.tokens
            assert active(engine) == [0, 0] or not any(active(engine))
        finally:
            getattr(engine, "close", engine.pipeline.close)()


def test_a_sequence_nobody_renews_is_released(dense_ckpt: Path) -> None:
    """A sequence whose release never arrives (lost with a stream, a crashed client) is gone from every
    node once its lease runs out; one its client still wants stays however long it idles."""
    from helpers import node_servers

    from mtpipe.node.protocol import StepKind, StepRequest

    with node_servers(2) as servers:
        engine = remote_engine(dense_ckpt, [s.address for s in servers], dtype="float32")
        pipeline = engine.pipeline
        try:
            tokens = engine.tokenizer.encode(PROMPTS[2])
            for seq in ("kept", "lost"):
                pipeline.steps([StepRequest(seq, 0, StepKind.PREFILL, tokens, final=True)])
            assert active(engine) == [2, 2]
            with pipeline._lock:  # as if its release had been lost: nobody renews it any more
                pipeline.live.discard("lost")
            deadline = time.monotonic() + SETTLE_S
            while active(engine) != [1, 1] and time.monotonic() < deadline:
                time.sleep(0.25)
            assert active(engine) == [1, 1]
            assert all("kept" in s.service.worker.sequences for s in servers)
            time.sleep(LEASE_S + 2 * SWEEP_S)  # renewed all along: still there
            assert all("kept" in s.service.worker.sequences for s in servers)
        finally:
            pipeline.close()
