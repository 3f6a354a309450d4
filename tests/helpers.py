"""Shared test data and helpers."""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from mtpipe.coordinator.engine.sinks import END
from mtpipe.models.tiny import build_tiny_checkpoint
from mtpipe.node.server import NodeServer


@contextmanager
def node_servers(n: int, **kw) -> Iterator[list[NodeServer]]:
    """n node servers in this process (each on its own event-loop thread), on 127.0.0.1, any free port."""
    started: list[NodeServer] = []
    try:
        for _ in range(n):
            started.append(NodeServer("127.0.0.1", 0, **kw).start())
        yield started
    finally:
        for s in started:
            s.stop(0)


@contextmanager
def thinking_tags(tokenizer: Any, end: str, opening: str = "<|im_start|>assistant") -> Iterator[None]:
    """Made-up thinking tags on a tokenizer, for a model that has none: the chat prompt's last tag opens
    the thought, `end` (a piece of its reply) closes it."""
    tok = tokenizer
    saved = (tok._think_start, tok._think_end, tok._think_start_tokens, tok._think_end_tokens)
    tok._think_start, tok._think_end = opening, end
    tok._think_start_tokens = tuple(tok.encode(opening, add_special_tokens=False))
    tok._think_end_tokens = tuple(tok.encode(end, add_special_tokens=False))
    try:
        yield
    finally:
        tok._think_start, tok._think_end, tok._think_start_tokens, tok._think_end_tokens = saved


def batch_chunks(engine: Any, reqs: list[Any], timeout: float) -> list[list[Any]]:
    """Requests opened in a batch engine all at once, so they decode as rows of one batch: each
    one's chunks, up to its end (an error fails the test)."""
    sinks: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in reqs]
    for req, sink in zip(reqs, sinks):
        engine.open(req, sink.put)
    out = []
    for sink in sinks:
        chunks = []
        while (item := sink.get(timeout=timeout)) is not END:
            assert not isinstance(item, BaseException), item
            chunks.append(item)
        out.append(chunks)
    return out


def undisturbed(ckpt: Path, reqs: list[Any]) -> list[list[int]]:
    """The requests' tokens on one machine, as rows of one batch (greedy and seeded rows give what
    they give alone)."""
    import mlx.core as mx

    from mtpipe.coordinator.engine.build import batch_engine

    engine = batch_engine(ckpt, dtype=mx.float32)
    try:
        return [[t for chunk in chunks for t in chunk.tokens] for chunks in batch_chunks(engine, reqs, timeout=120)]
    finally:
        engine.close()


class LiveServer:
    """uvicorn on 127.0.0.1 and a free port, on a background thread (or `server`, made by the caller)."""

    def __init__(self, app: Any = None, server: Any = None):
        import uvicorn

        self.server = server or uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None,
                                                              lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    @functools.cached_property
    def client(self) -> Any:
        """An httpx client for many requests: `httpx.post` and the like make a client, and with it a TLS
        context, on every call."""
        import httpx

        return httpx.Client(base_url=self.url, timeout=60)

    def __exit__(self, *exc: object) -> None:
        if "client" in self.__dict__:
            self.client.close()
        self.server.should_exit = True
        self.thread.join(timeout=30)


# The tests' tiny checkpoints: 4 layers, GatedDeltaNet and attention in turn, so both halves of a 2-stage split
# hold both kinds (a commit trims attention KV and rolls GatedDeltaNet state back on every node) and the suite's
# time, which goes with the depth, stays short.
# Their random weights come from a seed whose greedy runs of every prompt below (dense and MoE) go on for 72
# tokens or more before an end token, so the tests' generations are not cut short.
TINY_LAYERS = 4
TINY_ATTENTION_EVERY = 2
TINY_SEED = 4


def tiny_checkpoint(root: Path, **kw: Any) -> Path:
    """A tiny checkpoint (built once, then cached under `root`) of the tests' shape."""
    kw.setdefault("seed", TINY_SEED)
    return build_tiny_checkpoint(root=root, num_layers=TINY_LAYERS, attention_every=TINY_ATTENTION_EVERY, **kw)


PROMPTS = [
    "def add(a, b):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n    print(",
    "# Copyright 2026\n",
    "hello world",
    "if __name__ == '__main__':\n",
    "return [x * 2 for x in",
    "try:\n    import json\nexcept ImportError:\n",
    "with open(path) as f:\n",
    "The quick brown fox",
    "while True:\n    line = ",
    "x = {'a': 1, 'b': 2}\n",
    "async def fetch(url):\n",
    "raise ValueError(",
    "\"\"\"Module docstring.\"\"\"\n",
    "lambda x: x",
    "@property\ndef name(self):\n",
    "from collections import",
    "assert result ==",
    "def __repr__(self):\n        return",
    "numbers = [1, 2, 3",
]



def signal_a_thread(pid: int, sig: int) -> None:
    """`sig` to one of process `pid`'s threads other than its main one, as the kernel may hand a process's
    signal to any thread that does not block it: Python runs the handler on the main thread, which must
    then wake from whatever it waits on. Linux only (tgkill); skips elsewhere."""
    import ctypes
    import platform
    import sys

    number = {"x86_64": 234, "aarch64": 131}.get(platform.machine()) if sys.platform == "linux" else None
    if number is None:
        pytest.skip("tgkill is a Linux call (x86-64, arm64 here)")
    tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert tids, "the process has no thread but its main one"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, pid, tids[0], sig) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {tids[0]}, {sig})")
