"""Tokens per second by MTP depth, from acceptance and round costs, and the choice among noisy estimates
(depth.py keeps the estimates; this is the arithmetic over them)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

LEAD = 1.0  # standard errors by which drafting must beat no drafts to be chosen (`settled`)
# The machine's pace drifts (other work, clocks): two costs timed this many seconds or more apart may
# be off against each other by DRIFT (relative), however steady each one's own timings.
DRIFT, DRIFT_SECONDS = 0.1, 2.0


def expected_tokens(acceptance: list[float], depth: int) -> float:
    """Tokens a round with `depth` drafts emits on average: the accepted prefix plus one."""
    total, reach = 1.0, 1.0
    for a in acceptance[:depth]:
        reach *= a
        total += reach
    return total


def depth_rates(acceptance: list[float], round_seconds: list[float]) -> list[float]:
    """Expected tokens per second at each depth 0..len(round_seconds)-1."""
    return [expected_tokens(acceptance, k) / max(s, 1e-9) for k, s in enumerate(round_seconds)]


def batch_rates(rows: list[tuple[list[float], list[float]]], kmaxes: list[int],
                round_seconds: list[float]) -> list[tuple[float, float]]:
    """The same for rows decoding together: a round lasts as long as its deepest row makes it, so
    tokens per second summed over the rows (each row capped at its own most drafts). Each row gives
    its acceptance and its hopeful one (`Acceptance.hopeful`). Per depth: the rows' expected tokens
    per second, and the square of how far their hopes lie above it (`hoped` adds those up)."""
    out = []
    for k, s in enumerate(round_seconds):
        s = max(s, 1e-9)
        mean = [expected_tokens(a, min(k, m)) for (a, _), m in zip(rows, kmaxes)]
        hope = [expected_tokens(h, min(k, m)) for (_, h), m in zip(rows, kmaxes)]
        out.append((sum(mean) / s, sum((h - t) ** 2 for t, h in zip(mean, hope)) / s**2))
    return out


def hoped(parts: Iterable[list[tuple[float, float]]]) -> list[float]:
    """Tokens per second by depth of rows that share rounds (`batch_rates` of each batch), as hopeful
    as they are together: their errors add in quadrature, so many rows new to drafting hope for less
    each than one row alone (and their drafts cost more to try)."""
    return [sum(m for m, _ in col) + math.sqrt(sum(v for _, v in col)) for col in zip(*parts)]


def best_of(rates: list[float]) -> int:
    """The depth with the most tokens per second (ties: fewer drafts)."""
    return max(range(len(rates)), key=lambda k: (rates[k], -k))


def settled(rates: list[float], noise: list[float], when: list[float | None], lead: float | None = None) -> int:
    """The depth to run: the most tokens per second, less `lead` standard errors of each depth's gain
    over no drafts. `noise`: each depth's cost's relative error from its own timings; `when`: when it
    was last timed (seconds; None: never), as costs timed far apart differ by the machine's drift too.
    Costs are estimates from a few noisy timings, and the best of several noisy estimates is biased
    towards whichever dipped: where depths nearly tie, that picks drafts which then lose to no drafts,
    the one depth auto must never lose to. So drafts are chosen only when their gain shows through."""
    lead = LEAD if lead is None else lead

    def lower(k: int) -> float:
        if k == 0:
            return rates[0]
        t, t0 = when[k], when[0]
        drift = DRIFT if t is None or t0 is None else DRIFT * min(1.0, abs(t - t0) / DRIFT_SECONDS)
        return rates[k] - lead * math.sqrt((rates[k] * noise[k]) ** 2 + (rates[0] * noise[0]) ** 2
                                           + (rates[k] * drift) ** 2)
    return best_of([lower(k) for k in range(len(rates))])


def spread(xs: list[float]) -> float:
    """The variance of timings relative to their mean squared, in plain floats (`statistics` works in
    fractions, too slow for every round)."""
    n = len(xs)
    mean = sum(xs) / n
    return sum((x - mean) ** 2 for x in xs) / (n - 1) / max(mean * mean, 1e-24)


def shortfall(rates: list[float], best: int) -> float:
    """How far below the best depth's tokens per second its nearest neighbour is estimated (0..1)."""
    near = [rates[k] for k in (best - 1, best + 1) if 0 <= k < len(rates)]
    if not near or rates[best] <= 0:
        return 0.0
    return max(0.0, 1.0 - max(near) / rates[best])


def nearest(buckets: Iterable[int], at: int, index: Callable[[int], int] = lambda b: b) -> int:
    """The bucket closest to `at` by `index` (ties: the larger one)."""
    return min(buckets, key=lambda b: (abs(index(b) - index(at)), -b))


def context_bucket(context: int) -> int:
    """Costs are kept per power-of-two context length: attention grows with it."""
    return max(int(context), 1).bit_length()
