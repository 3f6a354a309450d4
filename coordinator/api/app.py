"""The coordinator's OpenAI-compatible REST API.

`POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/responses` (OpenAI's Responses API, read as
a chat request: responses_input.py, responses_api.py; `/v1/responses/input_tokens` counts its prompt),
Anthropic's `POST /v1/messages` and `/v1/messages/count_tokens` (messages_api.py) (streamed as server-sent
events or not), vLLM's `POST /tokenize` and `POST /detokenize` (tokens_api.py), `GET /v1/models` (Anthropic's
shape where the caller sends `anthropic-version`: messages_api.py), `GET /health`, `GET /v1/cluster` and
`GET /metrics` (Prometheus text).

Routes only: what a body means is decided in service.py, how its choices run and are answered in
responses.py (`n` per prompt; completions take a list of prompts), auth and request metrics in gate.py.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`:
400 for a bad value, invalid JSON or a body of the wrong shape (a wrong type, a missing field: as
OpenAI and vLLM, not FastAPI's 422), 404 for an unknown model, 401 for a missing or wrong API key,
503 when a stage refuses work, 500 for a bug, 413 for a body over `max_body_bytes`. A request is
validated completely before any node is touched; parsing large bodies and tokenizing run off the
event loop (service.py).

GET /health answers 200 only when every stage is ready, else 503 naming each node that is not and why
(readiness.py).

Output formats (formats.py): `response_format` json_object and json_schema, vLLM's `structured_outputs`
(json, regex, choice, grammar) and `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`,
held by the last stage (node/constraints.py) where it has the tokenizer; elsewhere a 400.

Extensions: the `mtp_depth` request field; vLLM's `skip_special_tokens` (special tokens such as
`<|im_start|>` are left out of the text unless it is false; kept by default when tools are in use,
tool_choice not "none", as vLLM's tool parsers need their tags; a stop string that is a special
token still stops), `stop_token_ids`, `ignore_eos`, `include_stop_str_in_output` and
`chat_template_kwargs` and `min_tokens`, and `priority` (with the priority policy); and `usage.mtp` = {depth, drafted,
accepted, acceptance, rounds}. A reasoning model's thinking (between the tokenizer's thinking tags)
comes apart from its answer as `reasoning_content` and `reasoning` (reasoning.py; vLLM's
`include_reasoning: false` drops it). Defaults: the sampling and max_new_tokens of the model's
generation_config.json (as vLLM takes them), else temperature 1.0 and top_p 1.0 as in OpenAI's API
and max_tokens 32768 (what Qwen advises for its thinking models; `mtpipe serve --max-tokens` sets another);
max_tokens never past what is left of the context; mtp_depth the server's
(auto when the model has an MTP head).

fastapi and uvicorn are imported when an app is built, not when the CLI registers `serve`.
(No `from __future__ import annotations` here: FastAPI reads the route annotations at run time.)
"""

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

from .chat import chat_messages, check_request_template, echoed, template_effort, template_variables, tool_spec
from .defaults import DEFAULT_CORS_ORIGINS, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONCURRENCY, DEFAULT_MODEL_NAME
from .errors import APIError, Unhandled, anthropic_caller, body_for, error_body, parse_body, validation_error
from .formats import OutputFormat, after_thought, held_call, output_format
from .gate import Gate
from .generation import ResponseFormat
from .limits import BodyLimit
from .metrics import ReadinessMetrics, ServerMetrics
from .model_defaults import model_defaults
from .readiness import Readiness
from .responses import choices_of, complete, stream
from . import messages_api, responses_api, responses_input
from .reasoning import ReasoningSplit, reasoning_split
from .response_store import ResponseStore, page
from .service import Service
from .tokens_api import add_token_routes

if TYPE_CHECKING:
    from fastapi import FastAPI

    from ..engine.engine import Engine
    from ..engine.request import GenerationRequest
    from .chat import ToolSpec
    from .templates import ChatTemplate

log = logging.getLogger(__name__)


# -- the app ----------------------------------------------------------------------------------


def create_app(
    engine: "Engine",
    model_name: str = DEFAULT_MODEL_NAME,
    *,
    api_key: Optional[str] = None,
    cluster_info: Optional[Callable[[], dict]] = None,
    default_mtp_depth: Optional[int] = None,
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
    max_body_bytes: Optional[int] = DEFAULT_MAX_BODY_BYTES,
    generation_config: Optional[Union[Path, str]] = None,
    cors_origins: Sequence[str] = DEFAULT_CORS_ORIGINS,
    default_max_tokens: Optional[int] = None,
    scheduling_policy: str = "fcfs",
    chat_template: Optional["ChatTemplate"] = None,
) -> "FastAPI":
    """The API over `engine`. `cluster_info` answers GET /v1/cluster (default: the local stages);
    bodies over `max_body_bytes` are refused with 413 (None: no cap). A request that leaves out its
    sampling gets what the generation config in the directory `generation_config` recommends (the
    model's, usually: model_defaults.py); None: OpenAI's defaults; `default_max_tokens` is the max_tokens of
    one that leaves it out, before the generation config's and ours. Web pages of `cors_origins` ("*":
    any, as mlx-lm's and vLLM's servers allow; none: only pages of the API's own origin) may call it
    from a browser, with the key still required where one is set. `scheduling_policy` "priority" lets
    requests set their `priority` (vLLM's: lower first); "fcfs" refuses any but 0. `chat_template`: the
    server's template and its variables' defaults (templates.py)."""
    from fastapi import FastAPI, Query, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.exceptions import HTTPException

    from .models import (ChatCompletionRequest, CompletionRequest, MessagesRequest, ResponsesCountRequest,
                         ResponsesRequest)

    metrics = ServerMetrics(engine.scheduler_state)
    defaults = model_defaults(generation_config)
    if default_max_tokens is not None:
        defaults["max_tokens"] = default_max_tokens
    service = Service(engine, model_name, default_mtp_depth=default_mtp_depth, max_concurrency=max_concurrency,
                       cluster_info=cluster_info, metrics=metrics, defaults=defaults,
                      scheduling_policy=scheduling_policy, chat_template=chat_template)
    app = FastAPI(title="mtpipe", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.state.metrics = metrics
    readiness = Readiness(engine)
    metrics.registry.register(ReadinessMetrics(readiness.check))
    app.add_middleware(Unhandled)  # (innermost: the Gate counts its 500s)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(Gate, api_key=api_key or None, metrics=metrics)  # auth before any body is read
    if cors_origins:  # outermost: a browser's preflight carries no key, and an error needs the headers to be read
        import inspect

        from starlette.middleware.cors import CORSMiddleware

        # A page on a public site calling this server on a private address or localhost sends a
        # private-network preflight (Chrome): refused unless allowed, where starlette knows of it.
        private = {"allow_private_network": True} if "allow_private_network" in inspect.signature(
            CORSMiddleware).parameters else {}
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["Retry-After", "x-request-id", "request-id"], **private)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError) -> JSONResponse:  # (Anthropic's shape on its paths)
        body = body_for(request.scope, e.status, e.message, type=e.type, param=e.param, code=e.code)
        return JSONResponse(body, status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        # (FastAPI's locations start with where the value was: the query, the path)
        errors = [{**err, "loc": tuple(err.get("loc", ()))[1:]} for err in e.errors()]
        return await on_api_error(request, validation_error(errors))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, e: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(body_for(request.scope, e.status_code, str(e.detail), code=code),
                            status_code=e.status_code, headers=e.headers)

    @app.get("/version")
    async def version() -> dict:
        from ... import __version__

        return {"version": __version__}

    @app.api_route("/ping", methods=["GET", "POST", "HEAD"])  # (vLLM's, for load balancers that probe it: /health's)
    @app.api_route("/health", methods=["GET", "HEAD"])  # (HEAD: a probe that reads the status only)
    async def health() -> JSONResponse:
        ready, details = await asyncio.to_thread(readiness.check)  # asks the nodes: blocking, bounded
        body = {"status": "ok" if ready else "unavailable", "model": model_name, "mtp": engine.has_mtp,
                "in_flight": metrics.in_flight_now(), **details}
        if not ready:
            body["error"] = error_body("; ".join(f"node {u['address']}: {u['reason']}" for u in details["unready"]),
                                       type="server_error", code="not_ready")["error"]
        return JSONResponse(body, status_code=200 if ready else 503)

    def model_card() -> dict:
        # (max_model_len and root as vLLM's cards say them: clients read the context length there)
        return {"id": model_name, "object": "model", "created": service.created, "owned_by": "mtpipe",
                "root": model_name, "parent": None, "max_model_len": engine.max_context,
                "max_context": engine.max_context, "mtp": engine.has_mtp}

    @app.get("/v1/models")  # (in Anthropic's shape for its clients: they send anthropic-version)
    async def models(request: Request) -> dict:
        if anthropic_caller(request.scope):
            asked = request.query_params
            return messages_api.model_page(model_name, service.created, asked.get("after_id"), asked.get("before_id"))
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> dict:
        service.check_model(model)
        return messages_api.model_info(model_name, service.created) if anthropic_caller(request.scope) else \
            model_card()

    @app.get("/v1/cluster")
    async def cluster() -> JSONResponse:
        if cluster_info is None:  # (it asks the engine's thread, or its process: off the event loop)
            return JSONResponse(await asyncio.to_thread(service.local_cluster))
        try:
            return JSONResponse(await asyncio.to_thread(cluster_info))
        except Exception as e:
            log.warning("cluster info failed: %s", e)
            raise APIError(503, f"cluster information unavailable: {e}", type="server_error",
                           code="cluster_unavailable") from None

    @app.get("/metrics")
    async def prometheus() -> Response:  # (the scheduler's state is asked of the engine: off the event loop)
        return Response(await asyncio.to_thread(generate_latest, metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def respond(endpoint: str, body: Any, reqs: "list[GenerationRequest]", n: int, request: Request,
                      started: float, tools: "ToolSpec | None" = None, thinking: "ReasoningSplit | None" = None,
                      echo: "list[str] | None" = None) -> Any:
        """A streamed (SSE) or whole response in the endpoint's object shape, `n` choices for each prompt's
        request; `tools`: parse the output for calls; `thinking`: split the reasoning off; `echo`: each
        prompt's text, shown before its choices' own."""
        if body.stream_options is not None and not body.stream:  # (as OpenAI's and vLLM's servers answer)
            raise APIError(400, "stream_options can only be given with stream: true", param="stream_options")
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        fmt = ResponseFormat(endpoint == "/v1/chat/completions", model_name, include_usage,
                             continuous=include_usage and bool(body.stream_options.continuous_usage_stats))
        choices = choices_of(reqs, n, thinking, echo, body.prompt_logprobs, body.return_tokens_as_token_ids)
        for i, choice in enumerate(choices) if fmt.chat else ():
            choice.prompt_top = choice.prompt_top if i == 0 else -1  # (a chat shows its prompt's logprobs once)
            choice.echo_scored = False  # (a chat's echo, the last message's text, has no logprobs of its own)
        if body.stream:
            return await stream(service, endpoint, choices, fmt, request, started, tools)
        return await complete(service, endpoint, choices, fmt, request, started, tools)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        started = time.perf_counter()
        body: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
        service.check_model(body.model)
        req, n, tools, thinking = await chat_request(body)
        echo = echoed(body)
        return await respond("/v1/chat/completions", body, [req], n, request, started, tools, thinking,
                             None if echo is None else [echo])

    kept = ResponseStore()  # (responses, for previous_response_id)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Any:
        started = time.perf_counter()
        body: ResponsesRequest = await parse_body(request, ResponsesRequest)
        service.check_model(body.model)
        items = responses_input.input_items(body, kept)
        req, tools, thinking = await responses_request(body, items)
        return await responses_api.respond_to(service, body, req, tools, thinking, request, started, model_name,
                                              kept, items)

    async def responses_request(body: ResponsesRequest, items: "list[dict[str, Any]]"
                                ) -> "tuple[GenerationRequest, ToolSpec | None, ReasoningSplit | None]":
        """The generation request of a Responses body whose conversation is `items`. With truncation "auto"
        a conversation that overflows the context loses its first turns, as few as let it fit (OpenAI's)."""
        async def from_turn(start: int) -> "tuple[GenerationRequest, ToolSpec | None, ReasoningSplit | None]":
            req, _, tools, thinking = await as_chat(body, responses_input.from_turn(items, start), chat_request)
            return req, tools, thinking

        try:
            return await from_turn(0)
        except APIError as e:
            if body.truncation != "auto" or e.code != "context_length_exceeded":
                raise
            return await responses_input.fewest_dropped(items, from_turn, e)

    @app.post("/v1/responses/input_tokens")
    async def responses_input_tokens(request: Request) -> Any:
        """OpenAI's input token count: the prompt a Responses body would be fed, counted, nothing generated;
        also past the context (clients ask it to decide whether to compact); with truncation "auto", what it
        would be fed once its first turns are dropped, where dropping some lets it fit."""
        body: ResponsesCountRequest = await parse_body(request, ResponsesCountRequest)
        service.check_model(body.model)
        items = responses_input.input_items(body, kept)
        if body.truncation == "auto":
            try:
                req, _, _ = await responses_request(body, items)
                return {"object": "response.input_tokens", "input_tokens": len(req.prompt_tokens)}
            except APIError as e:
                if e.code != "context_length_exceeded":
                    raise
        tokens, _, _ = await as_chat(body, items, chat_prompt)
        return {"object": "response.input_tokens", "input_tokens": len(tokens)}

    async def as_chat(body: ResponsesRequest, items: "list[dict[str, Any]]", read: Callable[..., Any]) -> Any:
        """`read` (chat_request, chat_prompt) of the chat request a Responses body with `items` is, its
        errors named as this endpoint names its fields."""
        chat, origins = responses_input.chat_body(body, items)
        try:
            return await read(chat, answered=True)
        except APIError as e:
            raise responses_input.renamed(e, origins) from None

    @app.get("/v1/responses/{response_id}")
    async def kept_response(response_id: str) -> Any:
        if (response := kept.get(response_id)) is None:
            raise APIError(404, f"no response {response_id!r} is kept here", param="response_id", code="not_found")
        return response

    @app.get("/v1/responses/{response_id}/input_items")
    async def kept_input_items(response_id: str, limit: int = Query(20, ge=1, le=100),
                               order: Literal["asc", "desc"] = "desc", after: Optional[str] = None) -> Any:
        if (items := kept.input_items(response_id)) is None:
            raise APIError(404, f"no response {response_id!r} is kept here", param="response_id", code="not_found")
        try:
            return page(items, limit=limit, order=order, after=after)
        except KeyError:
            raise APIError(400, f"response {response_id!r} has no input item {after!r}", param="after") from None

    @app.delete("/v1/responses/{response_id}")
    async def forget_response(response_id: str) -> Any:
        if not kept.delete(response_id):
            raise APIError(404, f"no response {response_id!r} is kept here", param="response_id", code="not_found")
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/messages")
    async def messages(request: Request) -> Any:
        started = time.perf_counter()
        body: MessagesRequest = await parse_body(request, MessagesRequest)
        service.check_model(body.model)
        chat, origins = messages_api.chat_body(body, defaults=service.template.variables)
        try:
            req, _, tools, thinking = await chat_request(chat, answered=True)
        except APIError as e:  # (named as this endpoint names its fields)
            raise messages_api.renamed(e, origins) from None
        return await messages_api.respond_to(service, body, req, tools, thinking, request, started, model_name)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Any:
        body: MessagesRequest = await parse_body(request, MessagesRequest)
        service.check_model(body.model)
        chat, origins = messages_api.chat_body(body, counting=True, defaults=service.template.variables)
        try:  # (the prompt only: however long, and whatever max_tokens, it is counted; no generation is asked)
            tokens, _, _ = await chat_prompt(chat, answered=True)
        except APIError as e:
            raise messages_api.renamed(e, origins) from None
        return {"input_tokens": len(tokens)}

    async def chat_prompt(body: ChatCompletionRequest, answered: bool = False
                          ) -> "tuple[list[int], ToolSpec | None, OutputFormat | None]":
        """A chat body's prompt as the model is fed it (tools rendered, told whether the reply is held to a
        call), with its tools and output format: what count_tokens counts, with no context or max_tokens check."""
        fmt = output_format(body)
        tools = tool_spec(body)
        if fmt is not None and tools is not None and tools.active:  # (a format leaves no room for a call's tags)
            raise APIError(400, f"{fmt.field} cannot be given with tools (or use tool_choice none)", param=fmt.field)
        if tools is not None and tools.must_call and service.engine.constrains:  # (held to the call, as vLLM holds it)
            tools.held, fmt = True, held_call(tools)
        if not body.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        check_request_template(body.chat_template)
        effort = template_effort(engine.tokenizer, body.reasoning_effort)  # (reads its template's text only)
        variables = template_variables(body.chat_template_kwargs, effort)
        tokens = service.truncated(body, await service.encode_chat(chat_messages(body, answered), tools, variables,
                                                                  body.continue_final_message,
                                                                  body.add_generation_prompt))
        return tokens, tools, fmt

    async def chat_request(body: ChatCompletionRequest, answered: bool = False
                           ) -> "tuple[GenerationRequest, int, ToolSpec | None, ReasoningSplit | None]":
        """A chat body's generation request, checked: with its choices (`n`), tools and reasoning split
        (`answered`: tool results must answer earlier calls, as `chat_messages` says)."""
        if body.top_logprobs and not body.logprobs:  # (0, as typed clients send by default, asks for nothing)
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs must be in [0, 20], got {body.top_logprobs}", param="top_logprobs")
        n = service.choices(body)  # (before the prompt is read: a bad n costs no tokenizing)
        tokens, tools, fmt = await chat_prompt(body, answered)
        params = service.sampling(body, (body.top_logprobs or 0) if body.logprobs else -1, fmt,
                                  -1 if body.prompt_logprobs is None else body.prompt_logprobs)
        if body.max_completion_tokens is not None:
            max_tokens, max_param = body.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_param = body.max_tokens, "max_tokens"
        shown, thinking = body.include_reasoning is not False, None
        if getattr(service.engine.tokenizer, "has_thinking", False):  # (the prompt is read on the tokenizer's lane)
            thinking = await service.tokenize(0, lambda tokenizer: reasoning_split(tokenizer, tokens, shown,
                                                                                   body.continue_final_message))
            if fmt is not None and thinking is not None and thinking.thinking:  # (only the answer is held)
                engine = service.engine
                grammar = after_thought(fmt, engine.tokenizer, engine.eos, engine.vocab_size)
                params = dataclasses.replace(params, grammar=grammar)
        req = service.generation_request(body, params, tokens, max_tokens, "messages", max_param,
                                         tools=tools is not None and tools.active,
                                         format_param=fmt.field if fmt is not None else "response_format")
        return req, n, tools, thinking

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        started = time.perf_counter()
        body: CompletionRequest = await parse_body(request, CompletionRequest)
        service.check_model(body.model)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.logprobs is not None and not 0 <= body.logprobs <= 20:
            raise APIError(400, f"logprobs must be in [0, 20], got {body.logprobs}", param="logprobs")
        # The prompt is scored for vLLM's prompt_logprobs and for OpenAI's echo with logprobs (or with
        # max_tokens 0, which only scores it); the echoed prompt's logprobs have `logprobs` alternatives.
        scored = -1 if body.prompt_logprobs is None else body.prompt_logprobs
        if body.echo and (body.logprobs is not None or body.max_tokens == 0):
            scored = max(scored, body.logprobs or 0)
        fmt = output_format(body)
        params = service.sampling(body, -1 if body.logprobs is None else body.logprobs, fmt, scored)
        prompts = body.prompt
        if not (isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))):
            prompts = [prompts]  # (one prompt: a string or token ids)
        n = service.choices(body, len(prompts))
        if body.best_of not in (None, n):  # (the best n of more: not done here)
            raise APIError(400, f"best_of must equal n ({n}): every choice generated is returned", param="best_of")
        reqs, echo = [], []
        for i, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            whole = await (service.encode_text(prompt) if isinstance(prompt, str) else service.token_ids(prompt, param))
            tokens = service.truncated(body, whole)
            reqs.append(service.generation_request(body, params, tokens, body.max_tokens, param,
                                                   format_param=fmt.field if fmt is not None else "response_format"))
            if body.echo:  # (token ids, or a prompt cut short, echo as their text)
                echo.append(prompt if isinstance(prompt, str) and tokens is whole else
                            await service.tokenize(len(tokens), lambda tok, ids=tokens: tok.decode(ids)))
        return await respond("/v1/completions", body, reqs, n, request, started,
                             echo=echo if body.echo else None)

    add_token_routes(app, service)
    return app
