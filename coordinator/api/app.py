"""The coordinator's OpenAI-compatible REST API.

`POST /v1/chat/completions`, `POST /v1/completions` (streamed as server-sent events or not),
`GET /v1/models`, `GET /health`, `GET /v1/cluster` and `GET /metrics` (Prometheus text).

Each generation runs on a thread of its own, since `Engine.generate` is synchronous and
compute-bound; chunks reach the event loop through a queue, so requests interleave step by step
and the loop stays responsive. A client that goes away stops its thread, whose
`generator.close()` runs the engine's `finally` and frees the sequence on every node.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`:
400 for a bad value (or invalid JSON), 422 for a body of the wrong shape (a wrong type, a missing
field), 404 for an unknown model, 401 for a missing or wrong API key, 503 when a stage refuses
work, 500 for a bug. A request is validated completely before any node is touched.

Extensions: the `mtp_depth` request field, and `usage.mtp` = {depth, drafted, accepted,
acceptance, rounds}. Defaults: temperature 1.0 and top_p 1.0 as in OpenAI's API, max_tokens
256 (or what is left of the context), mtp_depth 2 when the model has an MTP head.

fastapi and uvicorn are imported when an app is built, not when the CLI registers `serve`.
(No `from __future__ import annotations` here: FastAPI reads the route annotations at run time.)
"""

import asyncio
import hmac
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Optional

from ...node.protocol import SamplingParams, StageError
from .errors import APIError, error_body, parse_body, validation_error
from .generation import SSE_DONE, GenerationThread, ResponseFormat, sse_event, usage_of
from .metrics import ServerMetrics

if TYPE_CHECKING:
    from fastapi import FastAPI

    from .models import ChatCompletionRequest, _GenerationBody
    from ..engine.engine import Engine, GenerationRequest, GenerationStats

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MODEL_NAME = "mtpipe"
DEFAULT_MAX_TOKENS = 256
DEFAULT_MAX_CONCURRENCY = 32  # generations at once; more wait their turn (a stage holds 64 sequences)
API_KEY_ENV = "MTPIPE_API_KEY"
MAX_STOP_STRINGS = 16
GREEDY_BELOW = 1e-5  # temperatures below this decode greedily (tiny ones overflow the softmax)
DISCONNECT_POLL_S = 0.1
OPEN_PATHS = ("/health",)  # reachable without the API key
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/cluster", "/health", "/metrics")


# -- the service: validation, runs, metrics -----------------------------------------------------


class _Service:
    def __init__(self, engine: "Engine", model_name: str, *, default_mtp_depth: Optional[int],
                 max_concurrency: int, cluster_info: Optional[Callable[[], dict]], metrics: ServerMetrics):
        self.engine = engine
        self.model_name = model_name
        self.default_mtp_depth = (2 if engine.has_mtp else 0) if default_mtp_depth is None else default_mtp_depth
        self.cluster_info = cluster_info
        self.metrics = metrics
        self.slots = asyncio.Semaphore(max_concurrency)
        self.tokenizer_lock = threading.Lock()  # fast tokenizers may refuse concurrent use
        self.created = int(time.time())

    # validation ---------------------------------------------------------------------------

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def sampling(self, body: "_GenerationBody") -> SamplingParams:
        if body.n not in (None, 1):
            raise APIError(400, f"n must be 1: this server returns one choice per request (got {body.n})", param="n")
        temperature = 1.0 if body.temperature is None else body.temperature
        if 0.0 < temperature < GREEDY_BELOW:
            temperature = 0.0
        if body.seed is not None and not 0 <= body.seed < 2**63:
            raise APIError(400, f"seed must be in [0, 2^63), got {body.seed}", param="seed")
        if body.top_k is not None and body.top_k >= 2**31:
            raise APIError(400, f"top_k must be below 2^31, got {body.top_k}", param="top_k")
        params = SamplingParams(
            temperature=temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            min_p=body.min_p or 0.0,
            seed=body.seed,
        )
        try:
            params.validate()
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split()[0]) from None
        return params

    def generation_request(self, body: "_GenerationBody", params: SamplingParams, prompt: list[int],
                           max_tokens: Optional[int], prompt_param: str,
                           max_param: str = "max_tokens") -> "GenerationRequest":
        from ...node.stage import MAX_MTP_DEPTH
        from ..engine.engine import GenerationRequest

        engine = self.engine
        depth = self.default_mtp_depth if body.mtp_depth is None else body.mtp_depth
        if not 0 <= depth <= MAX_MTP_DEPTH:
            raise APIError(400, f"mtp_depth must be in [0, {MAX_MTP_DEPTH}], got {depth}", param="mtp_depth")
        if depth > 0 and not engine.has_mtp:
            raise APIError(400, "this model runs without an MTP head; use mtp_depth 0", param="mtp_depth")
        if not prompt:
            raise APIError(400, "the prompt is empty", param=prompt_param)
        room = engine.max_context - len(prompt) - depth
        if room <= 0:
            raise APIError(400, f"the prompt ({len(prompt)} tokens) does not fit the context of "
                           f"{engine.max_context} tokens", param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(DEFAULT_MAX_TOKENS, room)
        elif max_tokens <= 0:
            raise APIError(400, f"{max_param} must be positive, got {max_tokens}", param=max_param)
        elif max_tokens > room:
            raise APIError(400, f"{max_param} ({max_tokens}) plus the prompt ({len(prompt)} tokens) exceeds the "
                           f"context of {engine.max_context} tokens; at most {room} tokens can be generated",
                           param=max_param, code="context_length_exceeded")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
        req = GenerationRequest(prompt_tokens=prompt, max_tokens=max_tokens, params=params, mtp_depth=depth, stop=stop)
        try:
            engine.validate(req)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return req

    async def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        def encode() -> list[int]:
            with self.tokenizer_lock:
                return self.engine.encode_chat(messages)

        try:
            return await asyncio.to_thread(encode)
        except Exception as e:  # a template that refuses these messages
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None

    async def encode_text(self, text: str) -> list[int]:
        def encode() -> list[int]:
            with self.tokenizer_lock:
                return list(self.engine.tokenizer.encode(text))

        return await asyncio.to_thread(encode)

    def check_token_ids(self, ids: list[int]) -> None:
        vocab = len(self.engine.tokenizer)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")

    # runs ---------------------------------------------------------------------------------

    async def start(self, req: "GenerationRequest") -> GenerationThread:
        await self.slots.acquire()
        try:
            run = GenerationThread(self.engine, req, self._on_exit)
            self.metrics.in_flight.inc()
            run.start()
        except BaseException:
            self.slots.release()
            raise
        return run

    def _on_exit(self, run: GenerationThread) -> None:  # on the run's thread
        self.metrics.in_flight.dec()
        if run.cancelled:
            self.metrics.cancelled.inc()
            log.info("client went away: generation stopped and its caches released")

        try:
            run.loop.call_soon_threadsafe(self.slots.release)
        except RuntimeError:
            pass

    def record(self, endpoint: str, stats: "GenerationStats", started: float, first_token: Optional[float]) -> None:
        m = self.metrics
        m.prompt_tokens.inc(stats.prompt_tokens)
        m.completion_tokens.inc(stats.generation_tokens)
        m.drafted.inc(stats.drafted)
        m.accepted.inc(stats.accepted)
        if first_token is not None:
            m.ttft_seconds.observe(first_token - started, endpoint=endpoint)
        if stats.decode_tps:
            m.decode_tps.observe(stats.decode_tps)

    def server_error(self, e: Exception) -> APIError:
        self.metrics.failed.inc()
        if isinstance(e, StageError):
            log.warning("a stage refused a generation: %s", e)
            return APIError(503, f"a pipeline stage refused the request: {e}", type="server_error", code="stage_error")
        remote = sys.modules.get(f"{__package__}.remote")  # loaded only when serving over nodes
        if remote is not None and isinstance(e, getattr(remote, "NodeFailure", ())):
            log.warning("a node failed during a generation: %s", e)
            return APIError(503, f"a node failed: {e}", type="server_error", code="node_failure")
        log.error("generation failed", exc_info=e)
        return APIError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error", code="internal_error")

    async def complete(self, endpoint: str, req: "GenerationRequest", fmt: ResponseFormat, request: Any,
                       started: float) -> Any:
        from fastapi.responses import JSONResponse, Response

        run = await self.start(req)
        watcher = asyncio.create_task(self._watch(request, run))
        parts: list[str] = []
        final = None
        first_token = None
        try:
            async for chunk in run.chunks():
                first_token = first_token or time.perf_counter()
                parts.append(chunk.text)
                if chunk.finish_reason:
                    final = chunk
        except Exception as e:
            raise self.server_error(e) from None
        finally:
            watcher.cancel()
            run.cancel()
        if final is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        self.record(endpoint, final.stats, started, first_token)
        return JSONResponse(fmt.response("".join(parts), final.finish_reason, usage_of(final.stats, req.mtp_depth)))

    async def _watch(self, request: Any, run: GenerationThread) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        run.cancel()

    def stream(self, endpoint: str, req: "GenerationRequest", fmt: ResponseFormat, started: float) -> Any:
        from fastapi.responses import StreamingResponse

        return StreamingResponse(
            self._events(endpoint, req, fmt, started),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _events(self, endpoint: str, req: "GenerationRequest", fmt: ResponseFormat,
                      started: float) -> AsyncIterator[str]:
        # Started lazily: a response that is never iterated (the client left at once) never runs.
        # When the client leaves, Starlette cancels this generator and `finally` stops the run.
        run = None
        first_token = None
        try:
            if fmt.chat:
                yield sse_event(fmt.chunk(role=True))
            run = await self.start(req)
            async for chunk in run.chunks():
                first_token = first_token or time.perf_counter()
                if chunk.text:
                    yield sse_event(fmt.chunk(chunk.text))
                if chunk.finish_reason:
                    self.record(endpoint, chunk.stats, started, first_token)
                    yield sse_event(fmt.chunk(finish=chunk.finish_reason))
                    if fmt.include_usage:
                        yield sse_event(fmt.usage_chunk(usage_of(chunk.stats, req.mtp_depth)))
            yield SSE_DONE
        except Exception as e:
            yield sse_event(self.server_error(e).body())
            yield SSE_DONE
        finally:
            if run is not None:
                run.cancel()

    # cluster --------------------------------------------------------------------------------

    def local_cluster(self) -> dict[str, Any]:
        """One local node: the engine's stages and their layer ranges."""
        engine = self.engine
        stages = []
        for i, stage in enumerate(getattr(engine.pipeline, "stages", None) or []):
            spec, stats = getattr(stage, "spec", None), getattr(stage, "stats", None)
            if spec is None:
                continue
            stages.append({
                "index": i,
                "layers": [spec.start, spec.end],
                "num_layers": spec.num_layers,
                "active_sequences": len(getattr(stage, "sequences", {})),
                "steps": getattr(stats, "steps", None),
                "tokens_processed": getattr(stats, "tokens_processed", None),
                "mean_step_ms": round(stats.mean_step_ms, 3) if stats is not None else None,
                "last_error": getattr(stats, "last_error", None),
            })
        return {
            "mode": "local",
            "model": self.model_name,
            "mtp": engine.has_mtp,
            "max_context": engine.max_context,
            "pipeline": type(engine.pipeline).__name__,
            "placement": [{"node": "local", "layers": s["layers"]} for s in stages],
            "links": [],
            "nodes": [{"name": "local", "address": None, "healthy": True, "stages": stages}],
        }


# -- auth and metrics, as plain ASGI middleware (it must not buffer streamed responses) -------


class _Gate:
    def __init__(self, app: Any, api_key: Optional[str], metrics: ServerMetrics):
        self.app = app
        self.api_key = api_key
        self.metrics = metrics

    @staticmethod
    def _endpoint(path: str) -> str:
        if path in ENDPOINTS:
            return path
        return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"

    def _authorized(self, scope: dict) -> bool:
        if self.api_key is None or scope["path"] in OPEN_PATHS:
            return True
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from fastapi.responses import JSONResponse

        endpoint = self._endpoint(scope["path"])
        status = 500
        start = time.perf_counter()

        async def send_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self._authorized(scope):
                await self.app(scope, receive, send_status)
            else:
                body = error_body("invalid or missing API key: send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key")
                await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(
                    scope, receive, send_status)
        finally:
            self.metrics.requests.inc(endpoint=endpoint, status=str(status))
            self.metrics.request_seconds.observe(time.perf_counter() - start, endpoint=endpoint)


# -- the app ----------------------------------------------------------------------------------


def create_app(
    engine: "Engine",
    model_name: str = DEFAULT_MODEL_NAME,
    *,
    api_key: Optional[str] = None,
    cluster_info: Optional[Callable[[], dict]] = None,
    default_mtp_depth: Optional[int] = None,
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
) -> "FastAPI":
    """The API over `engine`. `cluster_info` answers GET /v1/cluster (default: the local stages)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse
    from starlette.exceptions import HTTPException

    from .models import ChatCompletionRequest, CompletionRequest

    metrics = ServerMetrics()
    service = _Service(engine, model_name, default_mtp_depth=default_mtp_depth, max_concurrency=max_concurrency,
                       cluster_info=cluster_info, metrics=metrics)
    app = FastAPI(title="mtpipe", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.state.metrics = metrics
    app.add_middleware(_Gate, api_key=api_key or None, metrics=metrics)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        err = validation_error(list(e.errors()))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, e: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(error_body(str(e.detail), code=code), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def on_error(request: Request, e: Exception) -> JSONResponse:
        log.error("unhandled error on %s", request.url.path, exc_info=e)
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", type="server_error",
                                       code="internal_error"), status_code=500)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model_name, "mtp": engine.has_mtp,
                "in_flight": int(metrics.in_flight.value())}

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": service.created, "owned_by": "mtpipe",
                "max_context": engine.max_context, "mtp": engine.has_mtp}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        service.check_model(model)
        return model_card()

    @app.get("/v1/cluster")
    async def cluster() -> JSONResponse:
        if cluster_info is None:
            return JSONResponse(service.local_cluster())
        try:
            return JSONResponse(await asyncio.to_thread(cluster_info))
        except Exception as e:
            log.warning("cluster info failed: %s", e)
            raise APIError(503, f"cluster information unavailable: {e}", type="server_error",
                           code="cluster_unavailable") from None

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def respond(endpoint: str, body: Any, req: "GenerationRequest", request: Request, started: float) -> Any:
        """A streamed (SSE) or whole response in the endpoint's object shape."""
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        fmt = ResponseFormat(endpoint == "/v1/chat/completions", model_name, include_usage)
        if body.stream:
            return service.stream(endpoint, req, fmt, started)
        return await service.complete(endpoint, req, fmt, request, started)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        started = time.perf_counter()
        body: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
        service.check_model(body.model)
        if body.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        params = service.sampling(body)
        if not body.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        tokens = await service.encode_chat(_chat_messages(body))
        if body.max_completion_tokens is not None:
            max_tokens, max_param = body.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_param = body.max_tokens, "max_tokens"
        req = service.generation_request(body, params, tokens, max_tokens, "messages", max_param)
        return await respond("/v1/chat/completions", body, req, request, started)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        started = time.perf_counter()
        body: CompletionRequest = await parse_body(request, CompletionRequest)
        service.check_model(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if body.logprobs is not None:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if body.best_of not in (None, 1):
            raise APIError(400, "best_of must be 1", param="best_of")
        params = service.sampling(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, f"one prompt per request, got {len(prompt)}", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            tokens = await service.encode_text(prompt)
        else:
            service.check_token_ids(prompt)
            tokens = list(prompt)
        req = service.generation_request(body, params, tokens, body.max_tokens, "prompt")
        return await respond("/v1/completions", body, req, request, started)

    return app


def _chat_messages(body: "ChatCompletionRequest") -> list[dict[str, str]]:
    out = []
    for i, m in enumerate(body.messages):
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages[{i}]: only text content parts are supported, got {part.type!r}",
                                   param="messages")
                texts.append(part.text)
            content = "\n".join(texts)
        else:
            content = m.content or ""
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out
