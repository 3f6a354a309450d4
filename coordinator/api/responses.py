"""A request's choices run and answered: whole, or streamed as server-sent events.

A request asks for several choices with `n` (that many replies to its prompt) or, on completions, with
a list of prompts; each choice is a generation of its own, and they run side by side in the batch.
They start as starting.py says. Choice i of prompt p has index p * n + i, as OpenAI orders them; usage
counts each prompt once and every choice's tokens. Any choice refused before the response starts refuses
the request (its status: 503 with Retry-After when busy); a choice that fails later fails the response,
and the others stop.
"""

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Optional

from .deltas import CallDeltas, calls_finish, thought_apart
from .errors import APIError
from .generation import SSE_DONE, GenerationThread, ResponseFormat, sse_event, usage_of, with_keepalive
from .service import DISCONNECT_POLL_S
from .starting import Begun, all_of, begin, client_gone
from .tool_held import HeldCalls
from .tools import ToolCallParser, parse_tool_calls

if TYPE_CHECKING:
    from ...node.protocol import Scored
    from ..engine.request import GenerationChunk, GenerationRequest, GenerationStats
    from .chat import ToolSpec
    from .reasoning import ReasoningSplit
    from .service import Service

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclasses.dataclass
class Choice:
    index: int
    prompt: int  # which of the request's prompts it continues
    req: "GenerationRequest"
    thinking: "Optional[ReasoningSplit]" = None  # its own: a split reads one reply
    echo: Optional[str] = None  # completions' echo: its prompt's text, before its own
    prompt_top: int = -1  # vLLM's prompt_logprobs: alternatives shown per prompt token (-1: not shown)
    token_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"
    echo_scored: bool = True  # the echoed text's logprobs shown (a completion's prompt; a chat's echo has none)


def int64(n: int) -> int:
    """`n` wrapped into a 64-bit integer's range, as a seed's arithmetic wraps."""
    return (n + 2**63) % 2**64 - 2**63


def choices_of(reqs: "list[GenerationRequest]", n: int, thinking: "Optional[ReasoningSplit]" = None,
               echo: Optional[list[str]] = None, prompt_top: Optional[int] = None,
               token_ids: bool = False) -> list[Choice]:
    """`n` choices for each prompt's request. A seeded request's choice i samples with seed + i (as vLLM's
    do), so that its choices differ and each is reproduced by the same request. `echo`: each prompt's
    text, shown first; `prompt_top`: vLLM's prompt_logprobs."""
    out = []
    for p, req in enumerate(reqs):
        for i in range(n):
            mine = req
            if i:  # (its own prompt list: nothing an engine does to one choice's request reaches another's)
                seed = req.params.seed
                params = req.params if seed is None else dataclasses.replace(req.params, seed=int64(seed + i))
                mine = dataclasses.replace(req, prompt_tokens=list(req.prompt_tokens), params=params)
            out.append(Choice(p * n + i, p, mine, None if thinking is None else dataclasses.replace(thinking),
                              None if echo is None else echo[p], -1 if prompt_top is None else prompt_top,
                              token_ids))
    return out


async def _prompt_shown(service: "Service", choice: Choice, scored: "Optional[list[Scored]]"
                        ) -> tuple[str, Optional[list[dict[str, Any]]], Optional[list[Any]]]:
    """What a choice shows of its prompt: the echoed text, that text's logprobs entries (where logprobs
    are asked) and vLLM's prompt_logprobs (where asked)."""
    tokens, top = choice.req.prompt_tokens, choice.req.params.top_logprobs
    entries = await service.prompt_entries(tokens, scored, top, as_ids=choice.token_ids) \
        if choice.echo is not None and top >= 0 and choice.echo_scored else None
    shown = await service.prompt_entries(tokens, scored, choice.prompt_top, ranked=True) \
        if choice.prompt_top >= 0 else None
    return choice.echo or "", entries, shown


async def _watch(request: Any, begun: Begun) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    begun.cancel()


# -- whole ------------------------------------------------------------------------------------


async def complete(service: "Service", endpoint: str, choices: list[Choice], fmt: ResponseFormat, request: Any,
                   started: float, tools: "Optional[ToolSpec]" = None) -> Any:
    from fastapi.responses import JSONResponse, Response

    begun, runs = await begin(service, choices, request, admitted=False)
    watcher = asyncio.create_task(_watch(request, begun))
    try:
        answers = await all_of([asyncio.ensure_future(_answer(service, endpoint, c, run, fmt.for_choice(c.index),
                                                            started, tools)) for c, run in zip(choices, runs)])
    except Exception as e:
        for run in runs:
            run.cancel(by_client=False)
        raise e if isinstance(e, APIError) else service.server_error(e) from None
    finally:
        watcher.cancel()
        for run in runs:
            run.cancel()
    if any(a is None for a in answers):  # stopped before it finished: its client went away, or the engine let it go
        if request is None or await request.is_disconnected():
            return Response(status_code=499)  # (nobody reads this)
        raise service.server_error(RuntimeError("a generation ended before it finished"))
    usage = usage_of([(c.prompt, stats) for c, (_, stats, _) in zip(choices, answers)], choices[0].req.depth_label)
    return JSONResponse(fmt.response([choice for choice, _, _ in answers], usage, prompt_logprobs=answers[0][2]))


async def _answer(service: "Service", endpoint: str, choice: Choice, run: GenerationThread, fmt: ResponseFormat,
                  started: float, tools: "Optional[ToolSpec]"
                  ) -> "Optional[tuple[dict[str, Any], GenerationStats, Optional[list[Any]]]]":
    """One choice, whole, its stats and vLLM's prompt_logprobs; None if it never finished (its client went away)."""
    parts: list[str] = []
    thoughts: list[str] = []
    final = None
    first_token = None
    asked = choice.req.params.top_logprobs >= 0
    entries: list[dict[str, Any]] = []
    shown, echo = None, ""
    async for chunk, thought in thought_apart(run.chunks(), choice.thinking):
        if first_token is None and (choice.echo is not None or choice.prompt_top >= 0):
            echo, echoed, shown = await _prompt_shown(service, choice, chunk.prompt_logprobs)
            entries += echoed or []
        first_token = first_token or service.first_token(endpoint, started, len(choice.req.prompt_tokens))
        service.generated(len(chunk.tokens))
        parts.append(chunk.text)
        thoughts.append(thought)
        if asked:
            entries += service.token_logprobs(chunk.tokens, chunk.logprobs, choice.token_ids)
        if chunk.finish_reason:
            final = chunk
    if final is None:
        return None
    service.record(final.stats, endpoint, started, final.finish_reason)
    text, calls, finish = _calls("".join(parts), final.finish_reason, tools)  # (the echo is no part of a call)
    return fmt.choice(echo + text, finish, logprobs=entries if asked else None, tool_calls=calls,
                      reasoning="".join(thoughts), prompt_logprobs=shown, stop_reason=final.stop_reason), \
        final.stats, shown


def _calls(text: str, finish: str, tools: "Optional[ToolSpec]") -> tuple[str, Optional[list[dict[str, Any]]], str]:
    """A reply's text left, its tool calls and its finish reason, as its stream would give them (the
    same readers: deltas.py): a reply held to a call is that call (tool_held.py); otherwise its text is
    parsed for calls. A reply that holds none stays text."""
    if tools is None or not tools.active:
        return text, None, finish
    by_budget = finish == "length"
    if tools.held:
        reader = HeldCalls(tools.name if tools.choice == "function" else None)
        left, found = "", [v for k, v in reader.feed(text) + reader.finish(by_budget) if k == "end"]
    else:
        left, found = parse_tool_calls(text, tools.tools, by_budget)
    if not found:
        return (left if not tools.held else "" if by_budget else text), None, finish
    found = found if tools.parallel else found[:1]
    held = tools.choice if tools.held else None
    return left, [c.to_dict() for c in found], calls_finish(finish, held, len(found), found[-1].cut)


# -- streamed ---------------------------------------------------------------------------------


async def stream(service: "Service", endpoint: str, choices: list[Choice], fmt: ResponseFormat, request: Any,
                 started: float, tools: "Optional[ToolSpec]" = None) -> Any:
    """Its first choices begun and admitted before the response, so that a request refused at once (no slot
    in time, the pipeline down) gets its status (503 with Retry-After), not an error event in a 200 stream;
    those past the free slots stream as they start."""
    from fastapi.responses import StreamingResponse

    begun, _ = await begin(service, choices, request, admitted=True, whole=False)
    watcher = asyncio.create_task(_watch(request, begun))  # also if the stream is never iterated
    return StreamingResponse(with_keepalive(_events(service, endpoint, choices, begun, fmt, watcher, started, tools)),
                             media_type="text/event-stream", headers=SSE_HEADERS)


async def one_choice(service: "Service", req: "GenerationRequest", thinking: "Optional[ReasoningSplit]", request: Any,
                     streamed: bool, events: Callable[[Choice, GenerationThread, bool], AsyncIterator[str]],
                     whole: Callable[[], Optional[dict[str, Any]]], token_ids: bool = False) -> Any:
    """One choice answered in another API's shape (responses_api.py, messages_api.py): streamed as
    `events(choice, run, False)` gives them (an error ends them as an event), or whole: its events run
    through (`events(choice, run, True)`: an error raised), then `whole()` is the object (None where it
    never finished: its client went away, or the engine let it go). `token_ids`: vLLM's
    return_tokens_as_token_ids, for its log-probabilities."""
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    (choice,) = choices_of([req], 1, thinking, token_ids=token_ids)
    begun, (run,) = await begin(service, [choice], request, admitted=streamed)
    watcher = asyncio.create_task(_watch(request, begun))  # (also if a stream is never iterated)
    if streamed:
        async def iterated() -> AsyncIterator[str]:
            watcher.cancel()  # (from here a client that leaves cancels the iteration)
            async for event in events(choice, run, False):
                yield event

        return StreamingResponse(with_keepalive(iterated()), media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        async for _ in events(choice, run, True):
            pass
    finally:
        watcher.cancel()
    if (answer := whole()) is None:
        if request is None or await request.is_disconnected():
            return Response(status_code=499)  # (nobody reads this)
        raise service.server_error(RuntimeError("a generation ended before it finished"))
    return JSONResponse(answer)


async def _events(service: "Service", endpoint: str, choices: list[Choice], begun: Begun,
                  fmt: ResponseFormat, watcher: "asyncio.Task[None]", started: float,
                  tools: "Optional[ToolSpec]") -> AsyncIterator[str]:
    # When the client leaves, Starlette cancels this generator and `finally` stops the runs: the
    # watcher, needed until the stream began, is not.
    watcher.cancel()
    finals: list[Any] = [None] * len(choices)

    async def chunks(i: int, c: Choice) -> AsyncIterator[dict[str, Any]]:  # (once its run has started)
        async for chunk in choice_chunks(service, endpoint, c, await begun.runs[i], fmt.for_choice(c.index),
                                         started, tools, finals, i):
            yield chunk

    try:
        async for event in _merged([chunks(i, c) for i, c in enumerate(choices)]):
            yield sse_event(event)
        if fmt.include_usage and all(f is not None for f in finals):
            usage = usage_of([(c.prompt, f) for c, f in zip(choices, finals)], choices[0].req.depth_label)
            yield sse_event(fmt.usage_chunk(usage))
        yield SSE_DONE
    except Exception as e:  # (a later choice refused as it started is an APIError already: told as it is)
        begun.cancel(by_client=client_gone(e))
        if client_gone(e):
            return
        yield sse_event((e if isinstance(e, APIError) else service.server_error(e)).body())
        yield SSE_DONE
    finally:
        begun.cancel()


_ENDED = object()


async def _merged(streams: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """The streams' items as they come; the first error raised, the other streams then stopped."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    items: asyncio.Queue = asyncio.Queue()

    async def pump(stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                items.put_nowait(item)
        except Exception as e:
            items.put_nowait(e)
        finally:
            items.put_nowait(_ENDED)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await items.get()
            if item is _ENDED:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def choice_chunks(service: "Service", endpoint: str, choice: Choice, run: GenerationThread,
                        fmt: ResponseFormat, started: float, tools: "Optional[ToolSpec]", finals: list[Any],
                        at: int, on_first: "Optional[Callable[[GenerationChunk], None]]" = None
                        ) -> AsyncIterator[dict[str, Any]]:
    """One choice's chunk objects, as `fmt` shapes them: its role, its deltas, its finish (its stats then
    in `finals[at]`); `on_first` is told the engine's first chunk before anything of it is shaped."""
    first_token = None
    parser = None
    if tools is not None and tools.active:  # (a reply held to a call is read as one: tool_held.py)
        held = tools.choice if tools.held else None
        parser = CallDeltas(HeldCalls(tools.name if held == "function" else None) if held else
                            ToolCallParser(tools.tools), tools.parallel, held)
    generated = 0
    fmt.counted(len(choice.req.prompt_tokens), 0)
    if fmt.chat:
        yield fmt.chunk(role=True)
    async for chunk, thought in thought_apart(run.chunks(), choice.thinking):
        if first_token is None and on_first is not None:
            on_first(chunk)
            yield fmt.chunk()  # (nothing of its own: the caller acts on it now, before any text is held back)
        if first_token is None and (choice.echo is not None or choice.prompt_top >= 0):
            echo, echoed, shown = await _prompt_shown(service, choice, chunk.prompt_logprobs)
            yield fmt.chunk(echo, logprobs=echoed, prompt_logprobs=shown)
        first_token = first_token or service.first_token(endpoint, started, len(choice.req.prompt_tokens))
        generated += len(chunk.tokens)
        service.generated(len(chunk.tokens))
        fmt.counted(len(choice.req.prompt_tokens), generated)
        asked = choice.req.params.top_logprobs >= 0 and chunk.tokens
        logprobs = service.token_logprobs(chunk.tokens, chunk.logprobs, choice.token_ids) if asked else None
        if thought:  # (a chunk all thinking carries its logprobs on its thinking)
            yield fmt.chunk(reasoning=thought, logprobs=None if chunk.text else logprobs)
            logprobs = logprobs if chunk.text else None
        if parser is not None:
            for delta in parser.deltas(fmt, chunk, logprobs):
                yield delta
        elif logprobs is not None:
            yield fmt.chunk(chunk.text, logprobs=logprobs)
        elif chunk.text:
            yield fmt.chunk(chunk.text)
        if chunk.finish_reason:
            service.record(chunk.stats, endpoint, started, chunk.finish_reason)
            finals[at] = chunk.stats
            yield fmt.chunk(finish=parser.finish(chunk.finish_reason) if parser else chunk.finish_reason,
                            stop_reason=chunk.stop_reason)
