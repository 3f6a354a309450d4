"""One generation on a thread of its own, and the OpenAI response and chunk objects it becomes."""

import asyncio
import codecs
import json
import logging
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from ..engine.engine import Engine
    from ..engine.request import GenerationChunk, GenerationRequest, GenerationStats

log = logging.getLogger(__name__)

_END = object()
_ADMITTED = object()  # (in the queue: the engine admitted the request)
_LIVE: "weakref.WeakSet[GenerationThread]" = weakref.WeakSet()  # every generation not yet ended
_live_lock = threading.Lock()  # (runs end on engine threads)
_closing: "weakref.WeakSet[asyncio.AbstractEventLoop]" = weakref.WeakSet()  # loops whose server stops
SHUTDOWN_RETRY_AFTER_S = 10  # what a generation refused or ended by a stop tells its client (503 Retry-After)


class LoopInbox:
    """Items for an event loop's queues from other threads, with one wake-up of the loop for all that
    arrive before it runs: a wake-up is a write to the loop's self-pipe on the sending thread, and
    the engine's thread would otherwise make one per stream per round."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = weakref.ref(loop)  # (the inboxes are kept by loop: a strong one would keep it alive)
        self.lock = threading.Lock()
        self.items: list[tuple[asyncio.Queue, Any]] = []

    def put(self, queue: asyncio.Queue, item: Any) -> None:
        with self.lock:
            self.items.append((queue, item))
            if len(self.items) > 1:  # a wake-up is on its way and will take this one too
                return
        loop = self.loop()
        try:
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed or gone (shutdown): nobody is listening
            with self.lock:
                self.items.clear()

    def _drain(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for queue, item in items:
            queue.put_nowait(item)


_inboxes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopInbox]" = weakref.WeakKeyDictionary()


def inbox(loop: asyncio.AbstractEventLoop) -> LoopInbox:
    """The loop's inbox (made on the loop's own thread, the only one that makes them)."""
    box = _inboxes.get(loop)
    if box is None:
        box = _inboxes[loop] = LoopInbox(loop)
    return box


def _shutting_down() -> Exception:
    from ..engine.sinks import ServerBusy

    return ServerBusy("the server is shutting down", retry_after=SHUTDOWN_RETRY_AFTER_S)


def stop_admitting() -> None:
    """The server on this loop stops: generations that would start from now on are refused (503)."""
    _closing.add(asyncio.get_running_loop())


def abort_all() -> int:
    """End every generation of this loop's server that has not finished with a 503 error (on the event
    loop): the server stops, and a stream that merely stopped would read as one that finished. How
    many there were."""
    loop = asyncio.get_running_loop()
    stop_admitting()
    with _live_lock:
        runs = [run for run in _LIVE if run.loop is loop and not run.finished]
    for run in runs:
        run.abort(_shutting_down())
    return len(runs)


def _began(item: Any) -> bool:
    """A queue item that shows a run under way or over: a chunk, or its end."""
    return item is _END or getattr(item, "text", None) is not None


class GenerationThread:
    """One generation, its chunks handed to the event loop.

    A batch engine (`open`) runs it in its own rounds and calls back with each chunk; a pipeline of
    nodes is iterated on a thread of its own (its `generate` is synchronous, and the MLX work is on
    the nodes). `cancel()` stops it at the next round or chunk, so the engine releases the sequence
    on every stage; the queue then ends.
    """

    def __init__(self, engine: "Engine", req: "GenerationRequest", on_exit: Callable[["GenerationThread"], None]):
        self.engine = engine
        self.req = req
        self.on_exit = on_exit
        self.loop = asyncio.get_running_loop()
        self.inbox = inbox(self.loop)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stopping = threading.Event()
        self.cancelled = False  # stopped before the last chunk
        self.by_client = True  # stopped because its client went away
        self.finished = False
        self.handle: Any = None
        self.early: list[Any] = []  # what came before the admission it was waiting for
        self.tells = hasattr(engine, "open")  # (a per-sequence engine runs on a thread of its own: admitted)
        self.thread = threading.Thread(target=self._work, name="mtpipe-generation", daemon=True)

    def start(self) -> None:
        from ..engine.sinks import open_admitted

        if self.loop in _closing:
            raise _shutting_down()
        with _live_lock:
            _LIVE.add(self)
        if self.tells:
            self.handle = open_admitted(self.engine, self.req, self._on_item, lambda: self._put(_ADMITTED))
        else:
            self.thread.start()

    async def admitted(self) -> None:
        """Once the engine admitted the request (it left the queue for the batch); raises a refusal that
        came first (a queue timeout, the pipeline down). At once with an engine that does not say."""
        if self.tells:
            await self._until(lambda item: item is _ADMITTED or _began(item))

    async def first(self) -> None:
        """Once its first chunk came (its prompt is in: a kept prefix another request may start from), or
        it ended; raises a refusal or failure that came first."""
        await self._until(_began)

    async def _until(self, done: Callable[[Any], bool]) -> None:
        """Read the queue into `early` (which `chunks` gives out first) until an item is `done`."""
        at = 0
        while True:
            while at < len(self.early):
                item, at = self.early[at], at + 1
                if isinstance(item, BaseException):
                    raise item
                if done(item):
                    return
            self.early.append(await self.queue.get())

    def cancel(self, by_client: bool = True) -> None:
        """Stop it; `by_client`: because its client went away (counted so), else with its response (the
        first cancel says which)."""
        if not self.stopping.is_set():
            self.by_client = by_client
        self.stopping.set()
        if self.handle is not None:
            self.handle.cancel()

    def abort(self, error: BaseException) -> None:
        """Stop, and end its chunks with `error` (on the event loop): its client hears why it ends."""
        self.cancel(by_client=False)
        self.queue.put_nowait(error)

    def _on_item(self, item: Any) -> None:
        """A batch engine's callback (on its MLX thread): chunks, maybe an exception, then its END."""
        from ..engine.sinks import END

        if item is END:
            self.cancelled = not self.finished and self.stopping.is_set()
            self.on_exit(self)
            self._ended()
            return
        if getattr(item, "finish_reason", None):
            self.finished = True
        self._put(item)

    async def chunks(self) -> AsyncIterator["GenerationChunk"]:
        while True:
            item = self.early.pop(0) if self.early else await self.queue.get()
            if item is _ADMITTED:
                continue
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _put(self, item: Any) -> None:
        self.inbox.put(self.queue, item)

    def _ended(self) -> None:
        with _live_lock:
            _LIVE.discard(self)
        self._put(_END)

    def _work(self) -> None:
        gen = self.engine.generate(self.req)
        finished = False
        try:
            while not self.stopping.is_set():
                chunk = next(gen, None)
                if chunk is None:
                    break
                if chunk.finish_reason:
                    finished = self.finished = True  # (before its client can read it: a stop lets it be)
                self._put(chunk)
                if finished:
                    break
        except Exception as e:  # handed to the request, which answers it
            self._put(e)
        finally:
            try:
                gen.close()  # the engine's finally: release the sequence on every node
            except Exception:
                log.exception("releasing a sequence failed")
            self.cancelled = not finished and self.stopping.is_set()
            self.on_exit(self)
            self._ended()


# -- response shapes --------------------------------------------------------------------------


def usage_of(stats: "GenerationStats | list[tuple[int, GenerationStats]]", depth: "int | str") -> dict[str, Any]:
    """Usage of one generation, or of a response's choices as (prompt index, stats): each prompt counted
    once however many choices continue it (as OpenAI and vLLM count `n`), every choice's tokens."""
    parts = [(0, stats)] if not isinstance(stats, list) else stats
    prompts = {p: s for p, s in reversed(parts)}  # (a prompt's first choice: the one that prefilled it)
    prompt_tokens = sum(s.prompt_tokens for s in prompts.values())
    generated = sum(s.generation_tokens for _, s in parts)
    drafted, accepted = sum(s.drafted for _, s in parts), sum(s.accepted for _, s in parts)
    depths: dict[int, int] = {}
    for _, s in parts:
        for k, v in s.depths.items():
            depths[k] = depths.get(k, 0) + v
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": prompt_tokens + generated,
        "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in prompts.values())},
        "mtp": {
            "depth": depth,
            "drafted": drafted,
            "accepted": accepted,
            "acceptance": round(accepted / drafted if drafted else 0.0, 4),
            "rounds": sum(s.rounds for _, s in parts),
            "depths": {str(k): v for k, v in sorted(depths.items())},  # rounds by drafts carried
        },
    }


def token_name(entry: dict[str, Any]) -> str:
    """A token as completions' logprobs name it: its text, or for bytes that are part of a character
    (no text of their own) "bytes:\\xNN..." as OpenAI writes them, so that no two tokens share a name
    (named by id, "token_id:N", as it is)."""
    if entry["token"].startswith("token_id:") and entry["token"][9:].isdigit():
        return entry["token"]
    raw = bytes(entry["bytes"])
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return entry["token"]


def _top(entry: dict[str, Any]) -> dict[str, float]:
    """Completions' top logprobs of a position: the most likely tokens and, as OpenAI always gives it,
    the sampled one (so up to `logprobs` + 1 of them)."""
    top = {token_name(t): t["logprob"] for t in entry["top_logprobs"]}
    top.setdefault(token_name(entry), entry["logprob"])
    return top


def _top_or_none(entry: dict[str, Any]) -> Optional[dict[str, float]]:
    """`_top`, or None for an echoed prompt's first token, which nothing before it predicts."""
    return None if entry["top_logprobs"] is None else _top(entry)


class ResponseFormat:
    """OpenAI's response and chunk objects for chat (`chat.completion`) or text (`text_completion`)."""

    def __init__(self, chat: bool, model: str, include_usage: bool = False, index: int = 0, continuous: bool = False):
        self.chat = chat
        self.model = model
        self.include_usage = include_usage
        self.continuous = continuous  # every chunk with the choice's usage so far (vLLM's continuous_usage_stats)
        self.so_far: dict[str, int] | None = None  # that usage (`counted`)
        self.index = index  # the choice this one formats (a request with `n` or several prompts has many)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text_offset = 0  # completions' logprobs: where the next token starts in the text
        self._text_chars = codecs.getincrementaldecoder("utf-8")(errors="replace")  # (a character may span tokens)

    def for_choice(self, index: int) -> "ResponseFormat":
        """The format of choice `index` of the same response (its id and time), with its own text offsets."""
        fmt = ResponseFormat(self.chat, self.model, self.include_usage, index, self.continuous)
        fmt.id, fmt.created = self.id, self.created
        return fmt

    def counted(self, prompt: int, completion: int) -> None:
        """The choice's tokens so far, for the chunks that follow (with `continuous`)."""
        self.so_far = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _object(self, object: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        out = {"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices}
        if self.chat:
            out["system_fingerprint"] = None
        out.update(extra)
        return out

    def logprobs(self, entries: Optional[list[dict[str, Any]]]) -> Optional[dict[str, Any]]:
        """Chat entries (token, logprob, bytes, top_logprobs) in this endpoint's shape; None if not asked."""
        if entries is None:
            return None
        if self.chat:
            return {"content": entries}
        offsets = []
        for e in entries:  # where each token's bytes begin in the text, in characters
            offsets.append(self.text_offset)
            self.text_offset += len(self._text_chars.decode(bytes(e["bytes"])))
        return {"tokens": [token_name(e) for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [_top_or_none(e) for e in entries],
                "text_offset": offsets}

    def choice(self, text: str, finish: str, logprobs: Optional[list[dict[str, Any]]] = None,
               tool_calls: list[dict[str, Any]] | None = None, reasoning: str = "",
               prompt_logprobs: Optional[list[Any]] = None,
               stop_reason: "str | int | None" = None) -> dict[str, Any]:
        """This choice of a whole response (`prompt_logprobs`: vLLM's, on a completions choice; a chat
        response carries them once, `response`; `stop_reason`: vLLM's, the stop string or token that ended it)."""
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:  # the text outside the calls, or null
                message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
            if reasoning:  # (reasoning.py: under both names clients read)
                message["reasoning_content"] = message["reasoning"] = reasoning
            return {"index": self.index, "message": message, "logprobs": self.logprobs(logprobs), "finish_reason": finish,
                    "stop_reason": stop_reason}
        return {"index": self.index, "text": text, "logprobs": self.logprobs(logprobs), "finish_reason": finish,
                "stop_reason": stop_reason, **({} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs})}

    def response(self, choices: list[dict[str, Any]], usage: dict[str, Any],
                 prompt_logprobs: Optional[list[Any]] = None) -> dict[str, Any]:
        """The whole response: its choices (`choice`, in index order) and their usage."""
        extra = {"prompt_logprobs": prompt_logprobs} if self.chat and prompt_logprobs is not None else {}
        return self._object("chat.completion" if self.chat else "text_completion", choices, usage=usage, **extra)

    def chunk(self, text: str = "", finish: Optional[str] = None, role: bool = False,
              logprobs: Optional[list[dict[str, Any]]] = None,
              tool_calls: list[dict[str, Any]] | None = None, reasoning: str = "",
              prompt_logprobs: Optional[list[Any]] = None, stop_reason: "str | int | None" = None) -> dict[str, Any]:
        shown = {} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs}  # (vLLM's, as in `choice`)
        ended = {} if finish is None else {"stop_reason": stop_reason}
        if self.chat:
            delta: dict[str, Any] = {"content": text} if text else {}
            if tool_calls:  # each whole: index, id, type, function name and arguments
                delta["tool_calls"] = tool_calls
            if reasoning:
                delta["reasoning_content"] = delta["reasoning"] = reasoning
            if role:
                delta = {"role": "assistant", "content": ""}
            choice = {"index": self.index, "delta": delta, "logprobs": self.logprobs(logprobs), "finish_reason": finish,
                      **ended}
        else:
            choice = {"index": self.index, "text": text, "logprobs": self.logprobs(logprobs), "finish_reason": finish,
                      **ended, **shown}
        usage = self.so_far if self.continuous else None
        extra = {**(shown if self.chat else {}), **({"usage": usage} if self.include_usage else {})}
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [choice], **extra)

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage)


def sse_event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_KEEPALIVE = ": keep-alive\n\n"  # a comment: SSE clients skip it
KEEPALIVE_S = 5.0
KEEPALIVE_AHEAD = 16  # events read ahead of the client at most


async def with_keepalive(events: AsyncIterator[str], every: Optional[float] = None) -> AsyncIterator[str]:
    """`events`, with a comment after each `every` seconds without one: a stream waiting (a long prompt's
    prefill, a node lost and the request waiting to resume) keeps the clients' and proxies' read timeouts
    from cutting it. The events are read on a task of their own and a beat adds the comments, so that an
    event costs a queue's hand-over, not a timed wait; they are read no further ahead of the client than
    KEEPALIVE_AHEAD events."""
    every = KEEPALIVE_S if every is None else every
    loop = asyncio.get_running_loop()
    items: asyncio.Queue = asyncio.Queue()
    room = asyncio.Semaphore(KEEPALIVE_AHEAD)  # (a client that reads slowly, or left, holds the events back)
    last = [loop.time()]
    ended = object()

    async def pump() -> None:
        try:
            async for event in events:
                last[0] = loop.time()
                await room.acquire()
                items.put_nowait(event)
        except Exception as e:  # (raised where the events are read)
            items.put_nowait(e)
        finally:
            items.put_nowait(ended)

    async def beat() -> None:
        while True:
            await asyncio.sleep(max(every - (loop.time() - last[0]), 0.0))
            if loop.time() - last[0] >= every:
                last[0] = loop.time()
                items.put_nowait(SSE_KEEPALIVE)

    tasks = [asyncio.ensure_future(pump()), asyncio.ensure_future(beat())]
    try:
        while (item := await items.get()) is not ended:
            if isinstance(item, Exception):
                raise item
            if item is not SSE_KEEPALIVE:
                room.release()
            yield item
    finally:  # (the client left, or it ended: the events' own cleanup runs as their task is cancelled)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
