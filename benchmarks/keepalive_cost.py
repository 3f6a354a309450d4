"""What the API's keep-alive wrapper (coordinator/api/generation.py `with_keepalive`) costs an SSE event:
`python benchmarks/keepalive_cost.py [EVENTS]`, the same events read bare and through it, in one process."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Callable

from mtpipe.coordinator.api.generation import with_keepalive


async def events(n: int) -> AsyncIterator[str]:
    for _ in range(n):
        yield "data: x\n\n"
        await asyncio.sleep(0)  # (a stream's events come from other tasks: a switch each)


async def main(n: int) -> None:
    ways: list[tuple[str, Callable[[AsyncIterator[str]], AsyncIterator[str]]]] = [
        ("bare", lambda g: g), ("keep-alive", with_keepalive)]
    for name, wrap in ways:
        start = time.perf_counter()
        async for _ in wrap(events(n)):
            pass
        print(f"{name}: {(time.perf_counter() - start) / n * 1e6:.1f} us an event")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20000))
