"""The node-to-node data plane: frames over plain TCP between nodes, gRPC Forward streams as the fallback.

Nodes run in-process here (NodeServer on its own loop thread), so a test can start them with or
without a data plane and with a secret, and talk to the data port with a raw socket.
"""

from __future__ import annotations

import socket
import ssl
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import PROMPTS, node_servers

from mtpipe.coordinator.engine.build import remote_engine
from mtpipe.coordinator.engine.engine import Engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.node import dataplane
from mtpipe.node.dataplane import HELLO, LENGTH
from mtpipe.node.tls import NAME, ssl_context

MAX_TOKENS = 16


def generate(engine: Engine, text: str, depth: int) -> list[int]:
    prompt = engine.tokenizer.encode(text)
    return engine.complete(GenerationRequest(prompt, max_tokens=MAX_TOKENS, mtp_depth=depth)).tokens


@pytest.mark.parametrize("data_plane", [True, False], ids=["tcp", "grpc"])
def test_both_transports_give_single_node_output(dense_engine: Engine, dense_ckpt: Path, data_plane: bool) -> None:
    with node_servers(3, data_plane=data_plane) as nodes:
        engine = remote_engine(dense_ckpt, [s.address for s in nodes], dtype="float32")
        try:
            for depth in (0, 2):
                assert generate(engine, PROMPTS[1], depth) == generate(dense_engine, PROMPTS[1], depth)
            health = engine.pipeline.health(probe_next=True)
        finally:
            engine.pipeline.close()
    transport = "tcp" if data_plane else "grpc"
    # Node to node on the chosen transport; the last node starts rounds on its ring link.
    assert [h.next_transport for h in health] == [transport, transport, ""]
    # each link's round trip: over the data plane a TCP handshake the kernels answer, not a busy loop
    assert all(0 < h.next_rtt_ms < 1000 for h in health[:2]) and health[-1].next_rtt_ms < 0
    assert all((h.data_port > 0) == data_plane for h in health)
    assert health[-1].ring == nodes[0].address and health[-1].ring_frames > 0


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(16) == b""
    except ConnectionResetError:
        return True


def _tls(port: int, secret: str) -> ssl.SSLSocket:
    """The hello in the clear, OK back, then TLS keyed by `secret` (dataplane.py)."""
    s = _connect(port)
    s.sendall(HELLO)
    assert s.recv(2) == b"OK"
    return ssl_context(secret, server=False).wrap_socket(s, server_hostname=NAME)


def test_data_port_checks_the_secret_and_survives_garbage(dense_engine: Engine, dense_ckpt: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataplane, "FRAME_BODY_TIMEOUT_S", 1.0)
    with node_servers(2, secret="s3cret") as nodes:
        port = nodes[1].service.data_port
        with pytest.raises(ssl.SSLError):  # TLS keyed by another secret: no handshake
            _tls(port, "wrong")
        with _connect(port) as s:  # frames in the clear after the hello: the TLS handshake fails, closed
            s.sendall(HELLO)
            assert s.recv(2) == b"OK"
            s.sendall(LENGTH.pack(6) + b"s3cret")
            assert _closed(s)
        with _connect(port) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _closed(s)
        with _tls(port, "s3cret") as s:  # the right secret, then a frame larger than any message may be
            s.sendall(LENGTH.pack(2**31))
            assert _closed(s)
        with _tls(port, "s3cret") as s:  # bytes that do not decode as a Frame
            s.sendall(LENGTH.pack(4) + b"\xff\xff\xff\xff")
            assert _closed(s)
        with _tls(port, "s3cret") as s:  # a frame that stops halfway: its buffer is let go, not held
            s.sendall(LENGTH.pack(1 << 20) + bytes(1000))
            start = time.monotonic()
            assert _closed(s) and time.monotonic() - start < 10
        engine = remote_engine(dense_ckpt, [s.address for s in nodes], secret="s3cret", dtype="float32")
        try:
            assert generate(engine, PROMPTS[2], 2) == generate(dense_engine, PROMPTS[2], 2)
            assert [h.next_transport for h in engine.pipeline.health()] == ["tcp", ""]
        finally:
            engine.pipeline.close()


def test_a_link_probe_that_connects_and_leaves_is_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    """A node times its link by a TCP handshake with the next node's data port and leaves at once: the
    listener takes that quietly (a connection that sends a wrong hello is still refused loudly)."""
    import asyncio
    import logging

    def logged(text: str) -> int:
        return sum(text in r.getMessage() for r in caplog.records)

    async def until(done: Any) -> None:  # (the listener takes each connection on its own task)
        for _ in range(500):
            if done():
                return
            await asyncio.sleep(0.01)

    async def run() -> None:
        listener = dataplane.FrameListener(lambda frame: asyncio.sleep(0), None, 1 << 20)
        port = await listener.start("127.0.0.1")
        try:
            rtt = await asyncio.to_thread(dataplane._handshake_ms, ("127.0.0.1", port), 5.0)
            assert 0 < rtt < 1000
            await until(lambda: logged("connected and left") >= 3)
            assert logged("connected and left") == 3  # (the quickest of 3 handshakes)
            assert not [r for r in caplog.records if r.levelno >= logging.INFO]
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\n")
            writer.close()
            await until(lambda: logged("closed the stream"))
            assert [r.levelno for r in caplog.records if "closed the stream" in r.getMessage()] == [logging.WARNING]
        finally:
            await listener.close()

    with caplog.at_level(logging.DEBUG, logger="mtpipe.node.dataplane"):
        asyncio.run(run())


def test_closing_the_listener_ends_open_streams_without_an_error(caplog: pytest.LogCaptureFixture) -> None:
    """A node stopping (Ctrl-C) closes the streams peers hold open: an ending, not a traceback."""
    import asyncio
    import logging

    async def run() -> None:
        async def on_frame(frame: object) -> None:
            pass

        listener = dataplane.FrameListener(on_frame, None, max_bytes=1 << 20)
        port = await listener.start("127.0.0.1")
        link = await dataplane.TcpFrameLink.connect("127.0.0.1", port, None)  # (answered: its stream is served)
        streams = list(listener._tasks)
        assert streams
        await listener.close()
        await asyncio.wait(streams)  # (each stream's task ends, cancelled)
        link.writer.close()

    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        asyncio.run(run())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_a_tls_link_to_a_peer_that_hangs_closes_at_once() -> None:
    """A node that hangs (SIGSTOP) never answers TLS's closing: its link is dropped after CLOSE_TIMEOUT_S,
    not after asyncio's 30 s wait for that answer, which held the pipeline from forming again."""
    import asyncio

    secret = "ab" * 32
    hung = asyncio.Event()

    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert await reader.readexactly(len(HELLO)) == HELLO
        writer.write(b"OK")
        await writer.start_tls(ssl_context(secret, server=True))
        writer.transport.pause_reading()  # (it stops: nothing it is sent is read or answered)
        hung.set()
        await asyncio.sleep(3600)

    async def run() -> float:
        server = await asyncio.start_server(peer, "127.0.0.1", 0)
        try:
            link = await dataplane.TcpFrameLink.connect("127.0.0.1", server.sockets[0].getsockname()[1], secret)
            await hung.wait()
            start = time.monotonic()
            await link.close()
            return time.monotonic() - start
        finally:
            server.close()

    assert asyncio.run(run()) < dataplane.CLOSE_TIMEOUT_S + 2.0


def test_frames_read_back_to_back_leave_the_loop_its_turns() -> None:
    """A long prompt's chunks arrive together and each step holds the loop (it is the node's MLX thread):
    between two frames the loop runs what else is due (lease renewals, Health), not after all of them."""
    import asyncio
    import time

    from mtpipe.proto import mtpipe_pb2 as pb

    async def run() -> None:
        done: list[str] = []

        async def on_frame(frame: pb.Frame) -> None:
            time.sleep(0.02)  # (a step: the loop waits for it)
            done.append(frame.seq_id)

        listener = dataplane.FrameListener(on_frame, None, max_bytes=1 << 20)
        port = await listener.start("127.0.0.1")
        link = await dataplane.TcpFrameLink.connect("127.0.0.1", port, None)
        for i in range(20):
            await link.write(pb.Frame(seq_id=f"s{i}"))
        while not done:  # (the first frame is in: the others are read back to back)
            await asyncio.sleep(0.001)
        renewed = asyncio.get_running_loop().create_future()
        asked = len(done)
        asyncio.get_running_loop().call_soon(lambda: renewed.set_result(len(done)))
        assert await renewed - asked <= 2 and asked < 15  # (its turn within a step or two, not after the rest)
        while len(done) < 20:
            await asyncio.sleep(0.01)
        await listener.close()
        link.writer.close()

    asyncio.run(run())
