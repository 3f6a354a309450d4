"""Sequences outlive neither their shard nor their client: a coordinator that vanishes (crash, lost
host) without releasing has its sequences released by every node once its subscription has been
gone for the grace period, while other clients' sequences on the same nodes go on untouched."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from helpers import PROMPTS, node_servers

from mtpipe.coordinator.engine.build import remote_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.node.protocol import SamplingParams, StepKind, StepRequest


def _active(engine) -> list[int]:
    return [h.active_sequences for h in engine.pipeline.health()]


def test_sequences_of_a_vanished_client_are_released(dense_engine, dense_ckpt: Path) -> None:
    prompt = dense_engine.tokenizer.encode(PROMPTS[5])
    with node_servers(2) as nodes:
        for n in nodes:
            n.service.orphan_grace = 1.0
        addresses = [n.address for n in nodes]
        gone = remote_engine(dense_ckpt, addresses, dtype="float32")
        stays = remote_engine(dense_ckpt, addresses, dtype="float32")
        try:
            first = {}
            for engine, seq in ((gone, "gone"), (stays, "stays")):
                first[seq] = engine.pipeline.step(
                    StepRequest(seq, 0, StepKind.PREFILL, prompt, final=True, params=SamplingParams()))
            assert _active(stays) == [2, 2]
            gone.pipeline.close()  # its subscriptions end; it never sent a release
            assert _active(stays) == [2, 2]  # within the grace period nothing is dropped
            deadline = time.monotonic() + 5
            while _active(stays) != [1, 1] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _active(stays) == [1, 1]
            # The other client's sequence is intact: it decodes on as single-node mode does.
            out = stays.pipeline.step(StepRequest("stays", 1, StepKind.DECODE, first["stays"].tokens))
            expected = dense_engine.complete(GenerationRequest(prompt, max_tokens=2)).tokens
            assert first["stays"].tokens + out.tokens == expected
        finally:
            stays.pipeline.close()


def test_no_method_of_the_node_service_is_a_mixin_stub() -> None:
    """The servicer's mixins name what the others provide; a stub (`...`) that came first in the MRO
    would replace the real method with one that does nothing (a shard kept alive after a new Load,
    prefixes never forgotten), and every call would still succeed."""
    import inspect

    from mtpipe.node.service import NodeService

    def stub(self: object) -> None: ...

    empty = stub.__code__.co_code
    stubs = [name for name, fn in inspect.getmembers(NodeService, inspect.isfunction)
             if fn.__code__.co_code == empty and fn.__qualname__.split(".")[0] != "NodeServicer"]
    assert stubs == []


def test_a_node_that_cannot_listen_says_why_and_exits_cleanly() -> None:
    """A port in use, or an address this machine does not have: one line naming the cause, exit 2 as
    `serve` says it, before any server starts (never gRPC's abort as the interpreter tore its threads down)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for host, why in (("127.0.0.1", "Address already in use"), ("10.255.255.1", "Cannot assign requested address")):
            r = subprocess.run([sys.executable, "-m", "mtpipe", "node", "--host", host, "--port", str(port),
                                "--insecure"], capture_output=True, text=True, timeout=60)
            assert r.returncode == 2 and f"--host/--port {host}:{port} cannot be used: {why}" in r.stderr, r.stderr
            assert "Traceback" not in r.stderr and "add_port" not in r.stderr


def test_a_node_stops_on_sigterm_that_another_thread_took() -> None:
    """The kernel may hand SIGTERM to any of the node's threads; Python runs the handler on the main
    thread, which must then wake from its wait to run it (a wait without end never did)."""
    import json
    import subprocess
    import sys

    from helpers import signal_a_thread

    proc = subprocess.Popen([sys.executable, "-m", "mtpipe", "node", "--host", "127.0.0.1", "--port", "0",
                             "--insecure", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["pid"] == proc.pid  # (listening)
        signal_a_thread(proc.pid, signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
