"""The API's work behind the routes: turning bodies into engine requests, running them, recording them.

A local engine batches every generation on its MLX thread; a pipeline of nodes runs each on a thread
of its own (generation.py). Chunks reach the event loop through a queue, so the loop stays responsive.
A client that goes away cancels its generation, which frees the sequence on every stage.

Tokenizing runs on worker threads. A long prompt (seconds of tokenizing) takes a lane of its own with
a copy of the tokenizer, so short requests never queue behind it for the shared one.

(No `from __future__ import annotations` here: FastAPI reads the route annotations at run time.)
"""

import asyncio
import copy
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Optional, TypeVar

from ...node.protocol import GREEDY_BELOW, SamplingParams, Scored, StageError, StageUnavailable
from ..engine.detokenizer import token_bytes
from ..engine.sinks import EngineLost, ServerBusy
from ..engine.request import GenerationRequest, RequestError, fit_to_context, resolve_depth
from .chat import check_template_variables, has_tool_turns, renders_tools, template_input, text_size
from .defaults import DEFAULT_MAX_TOKENS, SLOT_TIMEOUT_S
from .errors import APIError
from .generation import GenerationThread
from .metrics import ServerMetrics
from .model_defaults import with_defaults
from .slots import Slots
from .stopping import stops
from .templates import ChatTemplate

if TYPE_CHECKING:
    from ..engine.engine import Engine
    from ..engine.request import GenerationStats
    from .chat import ToolSpec
    from .formats import OutputFormat
    from .models import _GenerationBody

log = logging.getLogger(__name__)
T = TypeVar("T")

DISCONNECT_POLL_S = 0.1
NEVER_LOGPROB = -9999.0  # the logprob of a token that could not come (OpenAI's and vLLM's)
LONG_PROMPT_CHARS = 32 * 1024  # longer prompts are tokenized on the long lane
LONG_TOKEN_IDS = 64 * 1024  # longer token-id prompts are checked on a worker thread
MAX_CHOICES = 256  # choices (prompts times n) one request may ask for


class Service:
    def __init__(self, engine: "Engine", model_name: str, *, default_mtp_depth: "int | str | None",
                 max_concurrency: int, cluster_info: Optional[Callable[[], dict]], metrics: ServerMetrics,
                 defaults: Optional[dict[str, Any]] = None, scheduling_policy: str = "fcfs",
                 chat_template: Optional[ChatTemplate] = None):
        self.engine, self.defaults = engine, defaults or {}  # (the model's request defaults: model_defaults.py)
        self.template = chat_template or ChatTemplate()  # (the server's: --chat-template, --chat-template-args)
        if self.template.text is not None:
            self.template.apply(engine.tokenizer)
        self.model_name = model_name
        self.default_mtp_depth = default_mtp_depth  # None: auto where the model has an MTP head
        self.cluster_info = cluster_info
        self.metrics = metrics
        self.max_concurrency = max_concurrency
        self.slots = Slots(max_concurrency)
        metrics.scheduled.queued = lambda: self.slots.waiting  # (those waiting for a slot wait too: /metrics)
        self.scheduling_policy = scheduling_policy  # "fcfs", or "priority": requests may set their priority
        self.slot_timeout = SLOT_TIMEOUT_S
        self.tokenizer_lock = threading.Lock()  # fast tokenizers may refuse concurrent use
        self.long_lane = ThreadPoolExecutor(1, thread_name_prefix="tokenize-long")  # one long prompt at a time
        self._long_tokenizer: Any = None  # the long lane's own copy, made on first use
        self.native_tools: bool | None = None  # whether the chat template renders tools (probed once)
        self.created = int(time.time())

    # validation ---------------------------------------------------------------------------

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def sampling(self, body: "_GenerationBody", top_logprobs: int = -1, fmt: "OutputFormat | None" = None,
                 prompt_logprobs: int = -1) -> SamplingParams:
        """The body's sampling, processors and logprobs (-1: none asked; else how many alternatives; the
        same for the prompt's tokens), and the grammar of its output format (formats.py)."""
        if body.prompt_logprobs is not None and not 0 <= body.prompt_logprobs <= 20:  # (vLLM's -1, all: not here)
            raise APIError(400, f"prompt_logprobs must be in [0, 20], got {body.prompt_logprobs}",
                           param="prompt_logprobs")
        for name in ("bad_words", "allowed_token_ids", "use_beam_search"):  # (vLLM's, not done here: named)
            if getattr(body, name):
                raise APIError(400, f"{name} is not supported by this server", param=name)
        body = with_defaults(body, self.defaults)
        temperature = 1.0 if body.temperature is None else body.temperature
        if 0.0 < temperature < GREEDY_BELOW:
            temperature = 0.0
        params = SamplingParams(
            temperature=temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k == -1 else body.top_k or 0,  # -1: off, as vLLM clients send it
            min_p=body.min_p or 0.0,
            seed=body.seed,  # (any int64, as OpenAI and vLLM take it, -1 included)
            logit_bias=self._logit_bias(body.logit_bias),
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            top_logprobs=top_logprobs,
            grammar=None if fmt is None else fmt.plain,
            prompt_logprobs=prompt_logprobs,
            min_tokens=body.min_tokens or 0,
        )
        try:
            params.validate()
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split()[0]) from None
        return params

    def choices(self, body: "_GenerationBody", prompts: int = 1) -> int:
        """How many choices each prompt gets (`n`). Those past the generation slots wait for them
        (responses.begin); MAX_CHOICES in all bounds what one request may hold in memory."""
        n = 1 if body.n is None else body.n
        if n < 1:
            raise APIError(400, f"n must be at least 1, got {n}", param="n")
        if n * prompts > MAX_CHOICES:
            many = f"{prompts} prompts with n={n}" if prompts > 1 else f"n={n}"
            raise APIError(400, f"{many} asks for {n * prompts} choices; a request may ask for at most "
                                f"{MAX_CHOICES}", param="n" if n > 1 else "prompt")
        return n

    @staticmethod
    def _logit_bias(bias: Optional[dict[str, float]]) -> tuple[tuple[int, float], ...]:
        out = []
        for key, value in (bias or {}).items():
            try:
                out.append((int(key), float(value)))
            except ValueError:
                raise APIError(400, f"logit_bias keys are token ids, got {key!r}", param="logit_bias") from None
        out.sort()
        if twice := [a for (a, _), (b, _) in zip(out, out[1:]) if a == b]:  # ("10" and "010": which was meant?)
            raise APIError(400, f"logit_bias names token id {twice[0]} twice", param="logit_bias")
        return tuple(out)

    def token_logprobs(self, tokens: list[int], logprobs: Any, as_ids: bool = False) -> list[dict[str, Any]]:
        """Chat-style entries (token text, logprob, bytes, top_logprobs) for emitted tokens (`as_ids`: vLLM's
        return_tokens_as_token_ids, each token named "token_id:N")."""
        with self.tokenizer_lock:
            return _entries(self.engine.tokenizer, tokens, logprobs or [], as_ids)

    async def prompt_entries(self, tokens: list[int], scored: "Optional[list[Scored]]", top: int,
                             ranked: bool = False, as_ids: bool = False) -> list[dict[str, Any]]:
        """A scored prompt's entries, as `token_logprobs` gives them (`top` alternatives), the first one's
        logprob and alternatives None: nothing before it predicts it. `ranked`: vLLM's prompt_logprobs
        instead, per position {token id: {logprob, rank, decoded_token}}, the prompt's token first."""
        if scored is None or len(scored) != len(tokens) - 1:
            raise RuntimeError(f"{0 if scored is None else len(scored)} prompt log-probabilities for a prompt of "
                               f"{len(tokens)} tokens")

        def entries(tok: Any) -> list[Any]:
            if ranked:
                def ranked_entry(i: int, v: float, r: int) -> dict[str, Any]:
                    return {"logprob": finite(v), "rank": r, "decoded_token": tok.decode([i])}

                return [None] + [{str(t): ranked_entry(t, s.logprob, s.rank),
                                  **{str(i): ranked_entry(i, v, r)
                                     for r, (i, v) in enumerate(s.top[:top], 1) if i != t}}
                                 for t, s in zip(tokens[1:], scored)]
            return [{**_entry(tok, tokens[0], None, as_ids), "top_logprobs": None}] + \
                _entries(tok, tokens[1:], [(s.logprob, s.top[:top]) for s in scored], as_ids)

        return await self.tokenize(len(tokens), entries)

    def truncated(self, body: "_GenerationBody", prompt: list[int]) -> list[int]:
        """`prompt` as vLLM's truncate_prompt_tokens leaves it: its last tokens only."""
        keep = body.truncate_prompt_tokens
        if keep is None:
            return prompt
        if keep == 0 or keep < -1:
            raise APIError(400, f"truncate_prompt_tokens must be -1 or at least 1, got {keep}",
                           param="truncate_prompt_tokens")
        keep = self.engine.max_context if keep == -1 else keep
        return prompt if len(prompt) <= keep else prompt[-keep:]

    def generation_request(self, body: "_GenerationBody", params: SamplingParams, prompt: list[int],
                           max_tokens: Optional[int], prompt_param: str,
                           max_param: str = "max_tokens", tools: bool = False,
                           format_param: str = "response_format") -> "GenerationRequest":
        """The engine's request for this body; the engine decides whether it can serve it. `tools`: its
        output is parsed for tool calls, whose tags stay in the text unless the body says otherwise;
        `format_param`: the field that asked for its output format, if any."""
        try:
            depth, auto = resolve_depth(self.default_mtp_depth if body.mtp_depth is None else body.mtp_depth,
                                        self.engine.has_mtp)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        default = max(self.defaults.get("max_tokens", DEFAULT_MAX_TOKENS), params.min_tokens)  # (the model's too)
        depth, auto, max_tokens = fit_to_context(len(prompt), depth, auto, max_tokens, default, self.engine.max_context)
        if body.priority and self.scheduling_policy != "priority":
            raise APIError(400, f"priority {body.priority} asked, but this server schedules first come, first "
                           "served (start it with --scheduling-policy priority)", param="priority")
        stop, stop_ids = stops(body)
        skip = not tools if body.skip_special_tokens is None else body.skip_special_tokens
        req = GenerationRequest(prompt_tokens=prompt, max_tokens=max_tokens, params=params, mtp_depth=depth, stop=stop,
                                mtp_auto=auto, skip_special_tokens=skip, stop_token_ids=stop_ids,
                                ignore_eos=body.ignore_eos, include_stop_str_in_output=body.include_stop_str_in_output,
                                priority=body.priority)
        try:
            self.engine.validate(req)
        except RequestError as e:
            # The engine names its own fields; this endpoint may call them otherwise.
            named = {"prompt": prompt_param, "max_tokens": max_param, "response_format": format_param}
            param = named.get(e.param, e.param)
            message = str(e).replace("max_tokens", max_param, 1) if e.param == "max_tokens" else str(e)
            raise APIError(400, message, param=param, code=e.code) from None
        return req

    async def tokenize(self, size: int, fn: Callable[[Any], T]) -> T:
        """`fn(tokenizer)` off the event loop: the shared tokenizer for short texts, the long lane's
        copy when `size` (characters) is long, so a long prompt holds up no short one."""
        if size <= LONG_PROMPT_CHARS:
            def short() -> T:
                with self.tokenizer_lock:
                    return fn(self.engine.tokenizer)

            return await asyncio.to_thread(short)

        def long() -> T:  # on the long lane's one thread
            if self._long_tokenizer is None:
                with self.tokenizer_lock:
                    self._long_tokenizer = copy.deepcopy(self.engine.tokenizer)
            return fn(self._long_tokenizer)

        return await asyncio.get_running_loop().run_in_executor(self.long_lane, long)

    async def encode_chat(self, messages: list[dict[str, Any]], tools: "ToolSpec | None" = None,
                          variables: dict[str, Any] | None = None, continue_final: bool = False,
                          opened: bool = True) -> list[int]:
        """The prompt: plain messages as the engine encodes them; tools and tool turns as chat.py renders them;
        `variables` (`chat_template_kwargs`, such as Qwen's enable_thinking) for the template; `continue_final`:
        the reply goes on from the last message, an assistant's (vLLM's continue_final_message; it wins over
        `opened`); not `opened`: without the assistant's turn opened after them (vLLM's add_generation_prompt)."""
        check_template_variables(variables)
        variables = self.template.prompt_variables(variables)
        if continue_final and (not messages or messages[-1]["role"] != "assistant"):
            raise APIError(400, "continue_final_message needs the last message to be the assistant's",
                           param="continue_final_message")
        plain = (tools is None or not tools.active) and not has_tool_turns(messages)
        if self.native_tools is None and not plain:
            self.native_tools = await self.tokenize(0, lambda tok: renders_tools(tok, self.template.variables))

        def encode(tokenizer: Any) -> list[int]:
            if plain:
                turns, rendered = messages, None
            else:
                turns, rendered = template_input(messages, tools, self.native_tools)
            kwargs = {**(variables or {}), **({"tools": rendered} if rendered is not None else {})}
            return list(tokenizer.apply_chat_template(turns, add_generation_prompt=opened and not continue_final,
                                                      tokenize=True,
                                                      continue_final_message=continue_final, **kwargs))

        try:
            return await self.tokenize(text_size(messages), encode)
        except Exception as e:  # a template that refuses these messages
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None

    async def encode_text(self, text: str) -> list[int]:
        return await self.tokenize(len(text), lambda tok: list(tok.encode(text)))

    async def token_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        """A prompt given as token ids, checked against the vocabulary (a long one off the event loop)."""
        if len(ids) > LONG_TOKEN_IDS:
            await asyncio.to_thread(self.check_token_ids, ids, param)
        else:
            self.check_token_ids(ids, param)
        return list(ids)

    def check_token_ids(self, ids: list[int], param: str = "prompt") -> None:
        vocab = len(self.engine.tokenizer)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param=param)

    # runs ---------------------------------------------------------------------------------

    async def reserve(self, count: int, request: Any, priority: int = 0, timed: bool = True,
                      arrival: int | None = None) -> None:
        """`count` of the `max_concurrency` generation slots, all or none (slots.py), waited for only while
        the client waits too and (`timed`) at most SLOT_TIMEOUT_S (then ServerBusy: 503 with Retry-After);
        `arrival`: its place in the queue, taken before (the request's own, for a choice past the slots)."""
        await self.waited(self.slots.acquire(count, priority, arrival), request,
                          time.monotonic() + self.slot_timeout if timed else None, undo=lambda: self.slots.release(count))

    def release(self, count: int) -> None:
        """Reserved slots given back unused."""
        if count:
            self.slots.release(count)

    async def waited(self, waited: Any, request: Any, deadline: Optional[float] = None,
                     undo: Optional[Callable[[], None]] = None) -> Any:
        """`waited`'s result, waited for while the client waits too (else a 499) and, with `deadline`, until
        then (a slot's wait: ServerBusy, 503 with Retry-After). Given up, it is cancelled, or what it took
        given back with `undo` where it finished meanwhile; its own error is raised as it is."""
        task = asyncio.ensure_future(waited)
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if task.done():
                    break
                if request is not None and await request.is_disconnected():
                    raise APIError(499, "the client went away while its request waited", code="client_gone")
                if deadline is not None and time.monotonic() > deadline:
                    raise ServerBusy(f"no free generation slot after {self.slot_timeout:.0f} s "
                                     f"({self.max_concurrency} at once)",
                                     retry_after=max(1, int(self.slot_timeout // 4)))
            return task.result()
        except BaseException:
            if task.done() and not task.cancelled() and task.exception() is None:
                if undo is not None:
                    undo()  # taken meanwhile
            else:
                task.cancel()
            raise

    def run(self, req: "GenerationRequest") -> GenerationThread:
        """A generation on a reserved slot, which it gives back when it ends (at once if it cannot start)."""
        try:
            run = GenerationThread(self.engine, req, self._on_exit)
            self.metrics.in_flight.inc()
            try:
                run.start()
            except BaseException:  # refused before it began: `_on_exit` will never run
                self.metrics.in_flight.dec()
                raise
        except BaseException:
            self.slots.release()
            raise
        return run

    def _on_exit(self, run: GenerationThread) -> None:  # on the run's thread
        self.metrics.in_flight.dec()
        if run.cancelled and run.by_client:
            self.metrics.cancelled.inc()
            log.info("client went away: generation stopped and its caches released")
        elif run.cancelled:
            log.info("generation stopped with its response (another choice of it failed), its caches released")

        try:
            run.loop.call_soon_threadsafe(self.slots.release)
        except RuntimeError:
            pass

    def first_token(self, endpoint: str, started: float, prompt_tokens: int) -> float:
        """A generation's first token is here (now, returned): its time to it and its prompt are counted,
        so a generation its client gives up on, or that fails, counts in them too (as vLLM's do)."""
        now = time.perf_counter()
        self.metrics.ttft_seconds.labels(endpoint=endpoint).observe(now - started)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        return now

    def generated(self, tokens: int) -> None:
        """Tokens a generation handed out, counted as they come."""
        self.metrics.completion_tokens.inc(tokens)

    def record(self, stats: "GenerationStats", endpoint: str, started: float, finish: str) -> None:
        """A finished generation's own figures: why it finished, its kept prefix, its drafts, its tokens, its
        latency (its wait before prefill: what the rest of its time leaves) and speed."""
        m = self.metrics
        m.finished.labels(finish_reason=finish).inc()
        e2e = time.perf_counter() - started
        m.e2e_seconds.labels(endpoint=endpoint).observe(e2e)
        m.queue_seconds.observe(max(0.0, e2e - stats.prefill_seconds - stats.decode_seconds))
        m.prefill_seconds.observe(stats.prefill_seconds)
        m.decode_seconds.observe(stats.decode_seconds)
        m.request_prompt_tokens.observe(stats.prompt_tokens)
        m.request_generation_tokens.observe(stats.generation_tokens)
        if stats.generation_tokens > 1 and stats.decode_seconds > 0:
            m.tpot_seconds.observe(stats.decode_seconds / (stats.generation_tokens - 1))
        m.cached_tokens.inc(stats.cached_tokens)
        m.drafted.inc(stats.drafted)
        m.accepted.inc(stats.accepted)
        if stats.decode_tps:
            m.decode_tps.observe(stats.decode_tps)

    def server_error(self, e: Exception, refused: bool = False) -> APIError:
        """`e` as the client hears it; `refused`: before the generation began (not counted as one that failed,
        as a request the engine's queue turned away is not)."""
        if isinstance(e, RequestError):  # (refused where it runs: an API in a process of its own checks less)
            return APIError(400, str(e), param=e.param, code=e.code)
        if not refused and not isinstance(e, ServerBusy):
            self.metrics.failed.inc()
        if isinstance(e, StageError):
            log.warning("a stage refused a generation: %s", e)
            return APIError(503, f"a pipeline stage refused the request: {e}", type="server_error", code="stage_error")
        if isinstance(e, ServerBusy):
            log.warning("a request was turned away (503, to retry): %s", e)
            return APIError(503, f"the server cannot take this request now: {e}", type="server_error",
                            code="server_busy", headers={"Retry-After": str(e.retry_after)})
        if isinstance(e, EngineLost):
            log.error("the engine is gone: %s", e)
            return APIError(503, f"the engine failed: {e}", type="server_error", code="engine_failure")
        if isinstance(e, StageUnavailable):
            log.warning("a node failed during a generation: %s", e)
            return APIError(503, f"a node failed: {e}", type="server_error", code="node_failure")
        log.error("generation failed", exc_info=e)
        return APIError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error", code="internal_error")

    # cluster --------------------------------------------------------------------------------

    def local_cluster(self) -> dict[str, Any]:
        """One local node: the engine's stages and their layer ranges, and a batch engine's rows, memory
        budget and preemptions."""
        engine = self.engine
        described = engine.pipeline.describe()
        stages = described["stages"]
        return {
            "mode": "local",
            "model": self.model_name,
            "mtp": engine.has_mtp,
            "max_context": engine.max_context,
            "placement": [{"node": "local", "layers": s["layers"]} for s in stages],
            "links": [],
            "nodes": [{"name": "local", "address": None, "healthy": True, "stages": stages}],
            **({"batch": described["batch"]} if "batch" in described else {}),
        }


def finite(value: Optional[float]) -> Optional[float]:
    """A log-probability JSON can carry: a token that could not come (-inf) is -9999.0, as OpenAI and vLLM
    give it."""
    return value if value is None or math.isfinite(value) else NEVER_LOGPROB


def _entry(tok: Any, token: int, value: Optional[float], as_id: bool = False) -> dict[str, Any]:
    return {"token": f"token_id:{token}" if as_id else tok.decode([token]), "logprob": finite(value),
            "bytes": list(token_bytes(tok, token))}


def _entries(tok: Any, tokens: list[int], logprobs: Any, as_ids: bool = False) -> list[dict[str, Any]]:
    """Chat-style entries for `tokens`, each with its (logprob, [(token, logprob) of the top others])."""
    return [{**_entry(tok, t, lp, as_ids), "top_logprobs": [_entry(tok, i, v, as_ids) for i, v in top]}
            for t, (lp, top) in zip(tokens, logprobs)]
