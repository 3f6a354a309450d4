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
from urllib.parse import urlsplit

from ..engine.request import ends_on_token

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
    stop_reason: str | int | None = None

    def token_counts(self) -> list[float]:
        """Tokens per chunk, estimated: the usage's completion tokens shared out by characters (the
        chunks carry text, not token ids; a chunk holds one round's text, possibly several tokens),
        but the token that ended it (an EOS: counted, no text), as the engine level counts them."""
        total = sum(self.chars)
        if not total:
            return [0.0] * len(self.chars)
        ended = ends_on_token(self.finish_reason, self.stop_reason)
        return [(self.completion_tokens - ended) * c / total for c in self.chars]


async def _post_stream(url: str, body: dict[str, Any]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """POST /v1/completions over a connection of its own; returns once a 200 status line and its
    headers are read (the body follows chunked, as uvicorn streams it)."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                 f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
                 .encode() + payload)
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if status != 200:
        text = (await reader.read()).decode(errors="replace")
        writer.close()
        raise RuntimeError(f"POST /v1/completions: HTTP {status}: {text[:300]}")
    if headers.get("transfer-encoding", "").lower() != "chunked":
        writer.close()
        raise RuntimeError(f"POST /v1/completions: a stream that is not chunked ({headers})")
    return reader, writer


async def _stream_one(url: str, body: dict[str, Any]) -> StreamRecord:
    """One stream, read with nothing between the socket and the events but HTTP/1.1's chunked framing
    and the server-sent events' own: the clients' process shares this machine's cores with the server
    it measures, so it spends as little of them as it can."""
    rec = StreamRecord()
    reader, writer = await asyncio.wait_for(_post_stream(url, body), START_TIMEOUT_S)
    buffer = b""
    try:
        while size := int((await reader.readline()).split(b";")[0], 16):
            buffer += (await reader.readexactly(size + 2))[:-2]
            *events, buffer = buffer.split(b"\n\n")
            now = time.perf_counter()
            for event in events:
                for line in event.split(b"\n"):
                    if not line.startswith(b"data: "):
                        continue
                    data = line[len(b"data: "):]
                    if data == b"[DONE]":
                        break
                    _record(rec, json.loads(data), now)
    finally:
        writer.close()
    if not rec.completion_tokens:
        raise RuntimeError("the stream ended without usage (stream_options.include_usage)")
    return rec


def _record(rec: StreamRecord, obj: dict[str, Any], now: float) -> None:
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
        rec.stop_reason = choice.get("stop_reason", rec.stop_reason)


async def _stream_all(url: str, bodies: list[dict[str, Any]]) -> list[StreamRecord]:
    return list(await asyncio.wait_for(asyncio.gather(*(_stream_one(url, b) for b in bodies)), REQUEST_TIMEOUT_S))


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
    """stream_completions in the clients' process; its errors come back as plain RuntimeErrors (any
    exception need not survive the trip between processes)."""
    try:
        return stream_completions(url, prompts, max_tokens, mtp_depth, sampled)
    except Exception as e:  # noqa: BLE001 - re-raised as an error the parent can unpickle
        raise RuntimeError(f"{type(e).__name__}: {e}") from None
