"""How the serve benches time streams: a sink that stamps every chunk as the engine emits it, and the
decode window that turns those stamps into tokens per second."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from ..engine.sinks import END

WAIT_S = 1800.0


class Recorder:
    """A request's sink: when each chunk left the engine (called on the MLX thread), and its tokens."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.counts: list[float] = []
        self.tokens: list[int] = []
        self.error: BaseException | None = None
        self.ended = 0.0  # when END came
        self.done = threading.Event()

    def __call__(self, item: Any) -> None:
        if item is END:
            self.ended = time.perf_counter()
            self.done.set()
        elif isinstance(item, BaseException):
            self.error = item
        elif shown := item.shown:  # (as mlx-lm's, without the token that ended it)
            self.times.append(time.perf_counter())
            self.counts.append(len(shown))
            self.tokens += shown

    def wait(self) -> None:
        if not self.done.wait(WAIT_S):
            raise TimeoutError(f"a bench request did not finish in {WAIT_S:.0f} s")
        if self.error is not None:
            raise self.error


@dataclass(frozen=True)
class Decode:
    """Decode tokens and the seconds they took: one window, or several added up."""

    tokens: float = 0.0
    seconds: float = 0.0

    def __add__(self, other: Decode) -> Decode:
        return Decode(self.tokens + other.tokens, self.seconds + other.seconds)

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def decode_window(streams: list[tuple[list[float], list[float]]], full: bool = False) -> Decode:
    """Tokens arriving after every stream has its first chunk, over that moment to the last chunk
    (`full`: to the moment the first stream ends, while every stream is running)."""
    live = [(t, n) for t, n in streams if t]
    if not live:
        return Decode()
    start = max(t[0] for t, _ in live)
    end = min(t[-1] for t, _ in live) if full else max(t[-1] for t, _ in live)
    return window(live, start, end)


def window(streams: list[tuple[list[float], list[float]]], start: float, end: float) -> Decode:
    """The tokens of chunks stamped after `start` and up to `end`, over end - start."""
    if end <= start:
        return Decode()
    return Decode(sum(c for t, n in streams for ti, c in zip(t, n) if start < ti <= end), end - start)


def aggregate_tps(streams: list[tuple[list[float], list[float]]], full: bool = False) -> float:
    return decode_window(streams, full).tps


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]
