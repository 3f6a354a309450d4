"""The HTTP half of `mtpipe bench serve`: the real API app on 127.0.0.1 and a free port, and concurrent
streaming clients that time every chunk they receive.

Only the public surface is used: the app `mtpipe serve` runs and `POST /v1/completions` with
`stream: true` and `stream_options.include_usage`, so the bench measures whatever the API serves.
Prompts go as token ids, so the API decodes exactly the prompts the engine level does. The clients
run in a process of their own, as real clients do: in the server's process, parsing the streams
would take the interpreter lock from the API and the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

MODEL_NAME = "bench"
START_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 900.0


class LiveServer:
    """The API over `engine` on 127.0.0.1 and a free port, as `mtpipe serve` runs it: in a process of
    its own (front.py) given the model's path, whose tokenizer it loads; else uvicorn on a background
    thread of this process (`mtpipe serve --api-in-process`)."""

    def __init__(self, engine: Any, model_path: Any = None):
        import uvicorn

        from ..api.app import create_app
        from ..api.front import FrontProcess, FrontSpec

        self.front = None
        if model_path is not None:
            spec = FrontSpec(str(model_path), model_name=MODEL_NAME, access_log=False, log_level=logging.WARNING)
            self.front = FrontProcess(engine, spec)
            return
        app = create_app(engine, MODEL_NAME)
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="bench-api", daemon=True)
        self.url = ""

    def start(self) -> str:
        """Start serving; the base URL."""
        if self.front is not None:
            self.url = self.front.start()
            return self.url
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the API server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def stop(self) -> None:
        if self.front is not None:
            self.front.stop()
            return
        self.server.should_exit = True
        self.thread.join(timeout=10)


@dataclass
class StreamRecord:
    """One streamed completion as the client saw it: when each text chunk arrived, and its length."""

    times: list[float] = field(default_factory=list)
    chars: list[int] = field(default_factory=list)
    text: str = ""
    completion_tokens: int = 0
    finish_reason: str | None = None

    def token_counts(self) -> list[float]:
        """Tokens per chunk, estimated: the usage's completion tokens shared out by characters (the
        chunks carry text, not token ids; a chunk holds one round's text, possibly several tokens)."""
        total = sum(self.chars)
        if not total:
            return [0.0] * len(self.chars)
        return [self.completion_tokens * c / total for c in self.chars]


async def _stream_one(client: Any, url: str, body: dict[str, Any]) -> StreamRecord:
    rec = StreamRecord()
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"POST /v1/completions: HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            now = time.perf_counter()
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"the API failed a stream: {obj['error'].get('message')}")
            if obj.get("usage"):
                rec.completion_tokens = obj["usage"]["completion_tokens"]
            for choice in obj.get("choices") or []:
                if choice.get("text"):
                    rec.times.append(now)
                    rec.chars.append(len(choice["text"]))
                    rec.text += choice["text"]
                rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
    if not rec.completion_tokens:
        raise RuntimeError("the stream ended without usage (stream_options.include_usage)")
    return rec


async def _stream_all(url: str, bodies: list[dict[str, Any]]) -> list[StreamRecord]:
    try:
        import httpx
    except ImportError:
        raise RuntimeError("the API bench needs httpx (pip install httpx), or pass --skip-api") from None
    limits = httpx.Limits(max_connections=len(bodies) + 4, max_keepalive_connections=len(bodies) + 4)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        return list(await asyncio.gather(*(_stream_one(client, url, b) for b in bodies)))


Sampled = list[tuple[float, int | None]]  # each prompt's (temperature, seed)


def stream_completions(url: str, prompts: list[list[int]], max_tokens: int, mtp_depth: int | str,
                       sampled: Sampled | None = None) -> list[StreamRecord]:
    """One streaming request per prompt (greedy unless `sampled` gives each its temperature and
    seed), all at once; returns when every stream has ended."""
    bodies = [{"model": MODEL_NAME, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
               "stream_options": {"include_usage": True}, "mtp_depth": mtp_depth} for p in prompts]
    for body, (temperature, seed) in zip(bodies, sampled or []):
        body.update(temperature=temperature, **({"seed": seed} if seed is not None else {}))
    return asyncio.run(_stream_all(url, bodies))


class Clients:
    """Streaming clients in one spawned process, kept for the whole bench (the process's start-up is
    not timed). Chunk times are `time.perf_counter`, the system's monotonic clock on Linux and macOS,
    so they compare with the server's."""

    def __init__(self) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))

    def stream(self, url: str, prompts: list[list[int]], max_tokens: int, mtp_depth: int | str,
               sampled: Sampled | None = None) -> list[StreamRecord]:
        return self.pool.submit(_stream_in_child, url, prompts, max_tokens, mtp_depth, sampled).result()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _stream_in_child(url: str, prompts: list[list[int]], max_tokens: int, mtp_depth: int | str,
                     sampled: Sampled | None = None) -> list[StreamRecord]:
    """stream_completions in the clients' process; its errors come back as plain RuntimeErrors (an
    httpx exception need not survive the trip between processes)."""
    try:
        return stream_completions(url, prompts, max_tokens, mtp_depth, sampled)
    except Exception as e:  # noqa: BLE001 - re-raised as an error the parent can unpickle
        raise RuntimeError(f"{type(e).__name__}: {e}") from None
