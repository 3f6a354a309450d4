"""A small Prometheus text-format registry: counters, gauges and histograms with labels.

Enough for the coordinator's `/metrics` without a prometheus_client dependency. Every method is
thread-safe (generation threads and the event loop both record).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable

LabelValues = tuple[str, ...]

DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Iterable[str], values: Iterable[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if float(x).is_integer():
        return str(int(x))
    return repr(float(x))


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()):
        self.name = name
        self.help = help
        self.label_names = labels
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> LabelValues:
        if set(labels) != set(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {tuple(labels)}")
        return tuple(str(labels[n]) for n in self.label_names)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()):
        super().__init__(name, help, labels)
        self._values: dict[LabelValues, float] = {} if labels else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels(self.label_names, k)} {_num(v)}" for k, v in items]


class Gauge(_Metric):
    """A gauge set directly, or read from a callable at scrape time."""

    kind = "gauge"

    def __init__(self, name: str, help: str, fn: Callable[[], float] | None = None):
        super().__init__(name, help)
        self._value = 0.0
        self._fn = fn

    def set(self, value: float) -> None:
        with self._lock:
            self._value = value

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self._value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.inc(-amount)

    def value(self) -> float:
        if self._fn is not None:
            return float(self._fn())
        with self._lock:
            return self._value

    def render(self) -> list[str]:
        return self.header() + [f"{self.name} {_num(self.value())}"]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(
        self, name: str, help: str, labels: tuple[str, ...] = (), buckets: tuple[float, ...] = DEFAULT_BUCKETS
    ):
        super().__init__(name, help, labels)
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self._series: dict[LabelValues, tuple[list[int], list[float]]] = {}  # key -> (bucket counts, [sum])

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            counts, total = self._series.setdefault(key, ([0] * len(self.buckets), [0.0]))
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    counts[i] += 1
            total[0] += value

    def count(self, **labels: str) -> int:
        with self._lock:
            series = self._series.get(self._key(labels))
            return series[0][-1] if series else 0

    def render(self) -> list[str]:
        lines = self.header()
        with self._lock:
            items = sorted((k, (list(c), s[0])) for k, (c, s) in self._series.items())
        for key, (counts, total) in items:
            for bound, n in zip(self.buckets, counts):
                le = 'le="' + _num(bound) + '"'
                lines.append(f"{self.name}_bucket{_labels(self.label_names, key, le)} {n}")
            lines.append(f"{self.name}_sum{_labels(self.label_names, key)} {_num(total)}")
            lines.append(f"{self.name}_count{_labels(self.label_names, key)} {counts[-1]}")
        return lines


class Registry:
    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def add(self, metric: _Metric) -> _Metric:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} already registered")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help: str, labels: tuple[str, ...] = ()) -> Counter:
        return self.add(Counter(name, help, labels))  # type: ignore[return-value]

    def gauge(self, name: str, help: str, fn: Callable[[], float] | None = None) -> Gauge:
        return self.add(Gauge(name, help, fn))  # type: ignore[return-value]

    def histogram(
        self, name: str, help: str, labels: tuple[str, ...] = (), buckets: tuple[float, ...] = DEFAULT_BUCKETS
    ) -> Histogram:
        return self.add(Histogram(name, help, labels, buckets))  # type: ignore[return-value]

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics.values():
            lines += metric.render()
        return "\n".join(lines) + "\n"


class ServerMetrics:
    """The coordinator's metrics: requests, tokens, MTP acceptance, latency."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.requests = r.counter(
            "mtpipe_requests_total", "HTTP requests by endpoint and status code.", ("endpoint", "status")
        )
        self.request_seconds = r.histogram(
            "mtpipe_request_duration_seconds", "Time from request to the end of the response.", ("endpoint",)
        )
        self.ttft_seconds = r.histogram(
            "mtpipe_time_to_first_token_seconds", "Time from request to the first generated token.", ("endpoint",)
        )
        self.in_flight = r.gauge("mtpipe_generations_in_flight", "Generations running now.")
        self.cancelled = r.counter("mtpipe_generations_cancelled_total", "Generations stopped because the client left.")
        self.failed = r.counter("mtpipe_generations_failed_total", "Generations that ended with a server error.")
        self.prompt_tokens = r.counter("mtpipe_prompt_tokens_total", "Prompt tokens of finished generations.")
        self.completion_tokens = r.counter(
            "mtpipe_completion_tokens_total", "Tokens generated by finished generations."
        )
        self.drafted = r.counter("mtpipe_mtp_drafted_tokens_total", "Draft tokens proposed by the MTP head.")
        self.accepted = r.counter("mtpipe_mtp_accepted_tokens_total", "Draft tokens accepted by verification.")
        r.gauge(
            "mtpipe_mtp_acceptance_ratio",
            "Accepted over drafted tokens since start (0 before any draft).",
            fn=lambda: self.accepted.value() / self.drafted.value() if self.drafted.value() else 0.0,
        )
        self.decode_tps = r.histogram(
            "mtpipe_decode_tokens_per_second",
            "Decode speed of finished generations.",
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000),
        )

    def render(self) -> str:
        return self.registry.render()
