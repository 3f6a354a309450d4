"""A request's choices started, each on a generation slot of its own.

A request's choices take their slots all at once, as many as there are; past that, each further one
waits for a slot in the request's own place in the queue (as vLLM queues them), for as long as it
takes: the request's own runs free them. Where the engine keeps prompt prefixes, a prompt's first choice
starts at once and its others once that one's first chunk shows the prompt is in, so that they take the
prompt from it instead of prefilling it again.

A streamed response begins once the choices that could start at once have (its `head`): the others
start as slots come free, while the first ones stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any

from .errors import APIError

if TYPE_CHECKING:
    from .generation import GenerationThread
    from .responses import Choice
    from .service import Service


async def until(service: "Service", waited: Any, request: Any, refused: bool = False) -> None:
    """Wait for `waited` (the run's admission, `refused`: an error then is a refusal, or its first chunk)
    while its client waits too; an error that comes instead is answered as the server's."""
    try:
        await service.waited(waited, request)
    except APIError:
        raise
    except Exception as e:
        raise service.server_error(e, refused=refused) from None


async def all_of(tasks: "list[asyncio.Future[Any]]") -> list[Any]:
    """The tasks' results; at the first that fails the others are cancelled and its error raised."""
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
        if failed is not None:
            raise failed.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def client_gone(e: BaseException) -> bool:
    """Whether `e` stopped a request because its client went away (a cancellation, or the 499 for it)."""
    return not isinstance(e, Exception) or (isinstance(e, APIError) and e.status == 499)


@dataclasses.dataclass
class Begun:
    """A request's choices as they start (`launch`): `runs[i]` once choice i has; `head` once every choice
    that could start without waiting for a further slot has (those runs), or the first refusal."""

    runs: "list[asyncio.Future[GenerationThread]]"
    head: "asyncio.Future[list[GenerationThread]]"
    task: "asyncio.Task[None]"

    def started(self) -> "list[GenerationThread]":
        return [f.result() for f in self.runs if f.done() and not f.cancelled() and f.exception() is None]

    def cancel(self, by_client: bool = True) -> None:
        """Start no more, and stop those started."""
        self.task.cancel()
        for run in self.started():
            run.cancel(by_client=by_client)


def launch(service: "Service", choices: "list[Choice]", request: Any) -> Begun:
    """Every choice's run started on a slot reserved for it, in index order (a task of its own). A refusal
    of any stops those begun, gives the slots back, and is what `head` (before it was ready) and each
    choice not started raise."""
    loop = asyncio.get_running_loop()
    priority, arrival = choices[0].req.priority, service.slots.arrival()
    runs: list[asyncio.Future[GenerationThread]] = [loop.create_future() for _ in choices]
    head: asyncio.Future[list[GenerationThread]] = loop.create_future()
    at = {c.index: i for i, c in enumerate(choices)}
    groups: dict[int, list[Choice]] = {}
    for choice in choices:
        groups.setdefault(choice.prompt, []).append(choice)
    settled = 0  # prompts all started, or waiting for a further slot
    unused = min(len(choices), service.max_concurrency)  # slots reserved and not yet handed to a run
    deferred = len(choices) - unused  # choices that ask for their slot later, one by one: they wait too (/metrics)
    service.slots.deferred += deferred

    def settle(by: int) -> None:
        nonlocal settled
        settled += by
        if settled == len(groups) and not head.done():
            head.set_result([f.result() for f in runs if f.done()])

    async def reserve(count: int, timed: bool = True) -> None:
        try:
            await service.reserve(count, request, priority, timed, arrival)
        except APIError:
            raise
        except Exception as e:  # no slots in time
            raise service.server_error(e, refused=True) from None

    async def start(choice: Choice) -> None:
        nonlocal unused, deferred
        if not unused:
            deferred -= 1
            service.slots.deferred -= 1  # (it asks now: the queue counts it)
            settle(1)
            try:
                await reserve(1, timed=False)
            finally:
                settle(-1)
            unused += 1
        unused -= 1  # (a run gives its slot back when it ends, or at once if it cannot start)
        try:
            runs[at[choice.index]].set_result(service.run(choice.req))
        except Exception as e:  # an engine that refuses at once (its pipeline down, its process gone)
            raise service.server_error(e, refused=True) from None

    async def prompt(group: list[Choice]) -> None:
        await start(group[0])
        scored = group[0].req.params.prompt_logprobs >= 0  # (a scored prompt is read whole, by each choice)
        shares = len(group) > 1 and getattr(service.engine, "keeps_prefixes", False) and not scored
        if shares and not head.done():  # (once the response streams, its chunks are read there)
            await until(service, runs[at[group[0].index]].result().first(), request)
        for choice in group[1:]:
            await start(choice)
        settle(1)

    async def run_all() -> None:
        await reserve(unused)
        try:
            await all_of([asyncio.ensure_future(prompt(group)) for group in groups.values()])
        except BaseException as e:
            service.release(unused)
            for f in runs:
                if f.done():
                    f.result().cancel(by_client=client_gone(e))
            raise

    def ended(task: "asyncio.Task[None]") -> None:
        nonlocal deferred
        service.slots.deferred -= deferred  # (those that never asked: the request failed or was left)
        deferred = 0
        e = None if task.cancelled() else task.exception()
        for f in [head, *runs]:
            if f.done():
                continue
            if e is None:
                f.cancel()
            else:
                f.set_exception(e)
                f.exception()  # (read here too: a choice nobody waits for any more logs nothing)

    task = asyncio.ensure_future(run_all())
    task.add_done_callback(ended)
    return Begun(runs, head, task)


async def begin(service: "Service", choices: "list[Choice]", request: Any, admitted: bool,
                whole: bool = True) -> tuple[Begun, "list[GenerationThread]"]:
    """The choices launched, and the runs begun: all of them (`whole`), or the `head` (with `admitted`,
    each admitted by the engine too), so that a request refused at once gets its status, not an error
    event in a stream that began. A refusal of any stops those begun and is raised."""
    begun = launch(service, choices, request)
    try:
        runs = await begun.head
        if admitted:
            await all_of([asyncio.ensure_future(until(service, run.admitted(), request, refused=True))
                          for run in runs])
        if whole:
            await asyncio.shield(begun.task)
            runs = [f.result() for f in begun.runs]
    except BaseException as e:
        begun.cancel(by_client=client_gone(e))
        raise
    return begun, runs

