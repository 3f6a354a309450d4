"""The coordinator's Prometheus metrics, on prometheus_client.

Each app gets a registry of its own, so several apps in one process (tests, embedding) never clash
and nothing lands in the library's global default registry. prometheus_client is thread-safe:
generation threads and the event loop both record. The scheduler's own state (rows, queue, memory,
preemptions as they happen) is read from the engine as the metrics are scraped, as vLLM reports its
running and waiting requests and its cache usage.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ...node.conditions import LINK_LOST
from ..engine.scheduler import SchedulerState

log = logging.getLogger(__name__)

REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
DECODE_TPS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
# (about vLLM's)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
# a request's tokens: 1-2-5 steps, as vLLM's
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)


class Registry(CollectorRegistry):
    """A registry that leaves out the `<name>_created` samples.

    The exposition never had them, and the library's own switch (`disable_created_metrics`) is
    process-wide, which would reach into any other registry in the process.
    """

    def collect(self) -> Iterator[Metric]:
        for family in super().collect():
            created = family.name + "_created"
            if any(s.name == created for s in family.samples):
                family = copy.copy(family)
                family.samples = [s for s in family.samples if s.name != created]
            yield family


def value_of(metric: Counter | Gauge) -> float:
    """The current value of an unlabelled counter or gauge, read through its public `collect()`."""
    (family,) = metric.collect()
    name = family.name + "_total" if family.type == "counter" else family.name
    return next(s.value for s in family.samples if s.name == name and not s.labels)


class SchedulerMetrics(Collector):
    """The engine's scheduler, asked as the metrics are scraped (`read`: the engine's `scheduler_state`, a
    SchedulerState or None for an engine without a queue of its own). An engine that does not answer in time
    is reported as it last was."""

    def __init__(self, read: Callable[[], Any], queued: Callable[[], int] = lambda: 0):
        self._read = read
        self.queued = queued  # requests waiting for a generation slot, before the engine's own queue
        self._last: Any = None

    def describe(self) -> Iterator[Metric]:  # (registered without asking the engine)
        return self._families(SchedulerState(0, 0, 0.0, 0), True)

    def collect(self) -> Iterator[Metric]:
        try:
            self._last, answered = self._read(), True
        except Exception as e:  # noqa: BLE001 - the last reading stands
            log.debug("the scheduler's state is unavailable: %s", e)
            answered = False
        state = self._last
        if state is not None and (queued := self.queued()):
            state = dataclasses.replace(state, waiting=state.waiting + queued)
        return self._families(state, answered)

    @staticmethod
    def _families(state: Any, answered: bool) -> Iterator[Metric]:
        yield GaugeMetricFamily("mtpipe_scheduler_answered", "1 when the engine told this scrape its scheduler's "
                                "state; 0 when it did not answer in time (the values are then its last answer).",
                                value=1.0 if answered else 0.0)
        yield CounterMetricFamily("mtpipe_preemptions", "Times a generation left the batch to wait for memory "
                                  "(it then went on where it stopped).", value=state.preemptions if state else 0)
        if state is None:
            return
        yield GaugeMetricFamily("mtpipe_requests_running", "Requests admitted (holding their room in memory).",
                                value=state.running)
        yield GaugeMetricFamily("mtpipe_requests_waiting", "Generations waiting (each choice of a request with "
                                "n > 1 is one): for a generation slot (--max-concurrency), then in the engine's queue "
                                "for room in memory.",
                                value=state.waiting)
        yield GaugeMetricFamily("mtpipe_cache_usage_ratio", "What the running requests' caches hold over the memory "
                                "budget (over nodes: the fullest node's; above 1 where one request alone needs more).",
                                value=state.cache_usage)


class ReadinessMetrics(Collector):
    """Whether the engine can serve now, as GET /health says (`read`: Readiness.check, which asks each
    node, bounded): what an alert tells a pipeline that is down from one that is busy by."""

    def __init__(self, read: Callable[[], tuple[bool, dict[str, Any]]]):
        self._read = read

    def describe(self) -> Iterator[Metric]:  # (registered without asking the nodes)
        return self._families(True, {})

    def collect(self) -> Iterator[Metric]:
        try:
            ready, details = self._read()
        except Exception as e:  # noqa: BLE001 - a check that fails is an engine that cannot serve
            log.debug("readiness unavailable: %s", e)
            ready, details = False, {}
        return self._families(ready, details)

    @staticmethod
    def _families(ready: bool, details: dict[str, Any]) -> Iterator[Metric]:
        yield GaugeMetricFamily("mtpipe_ready", "1 when the engine can serve (GET /health answers 200); 0 while a "
                                "node is down or the pipeline is being formed again.", value=1.0 if ready else 0.0)
        nodes = [u for u in details.get("unready", ()) if u.get("address") != "pipeline"]  # (not the ring itself)
        own = [u for u in nodes if LINK_LOST not in str(u.get("reason", ""))]
        yield GaugeMetricFamily("mtpipe_nodes_unready", "Nodes of the pipeline that cannot serve now (GET /health "
                                "names them and why); those that report only a lost link to another node are "
                                "counted only where no node has a problem of its own (then it is the likely "
                                "cause).", value=len(own or nodes))


class ServerMetrics:
    """The coordinator's metrics: requests, tokens, MTP acceptance, latency, and the scheduler's state
    (`scheduler`: how to read it).

    Names, help texts, labels and buckets are what dashboards query: change them only on purpose.
    """

    def __init__(self, scheduler: Callable[[], Any] | None = None) -> None:
        r = self.registry = Registry()
        r.register(scheduled := SchedulerMetrics(scheduler or (lambda: None)))
        self.scheduled = scheduled  # (`queued`: set by the service whose slots requests wait for)
        self.requests = Counter(
            "mtpipe_requests_total", "HTTP requests by endpoint and status code.", ("endpoint", "status"), registry=r
        )
        self.request_seconds = Histogram(
            "mtpipe_request_duration_seconds",
            "Time from request to the end of the response.",
            ("endpoint",),
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "mtpipe_time_to_first_token_seconds",
            "Time from request to the first generated token.",
            ("endpoint",),
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("mtpipe_generations_in_flight", "Generations running now.", registry=r)
        self.cancelled = Counter(
            "mtpipe_generations_cancelled_total", "Generations stopped because the client left.", registry=r
        )
        self.failed = Counter(
            "mtpipe_generations_failed_total", "Generations that ended with a server error (not those refused "
            "before they began: mtpipe_requests_total counts their 503s).", registry=r
        )
        self.finished = Counter(
            "mtpipe_generations_finished_total", "Generations that finished, by why (stop: an end token or a stop "
            "string; length: max_tokens or the context).", ("finish_reason",), registry=r
        )
        self.prompt_tokens = Counter("mtpipe_prompt_tokens_total", "Prompt tokens of generations (counted at their "
                                     "first token).", registry=r)
        self.cached_tokens = Counter("mtpipe_prompt_tokens_cached_total",
                                     "Prompt tokens taken from a kept prefix instead of prefilled.", registry=r)
        self.completion_tokens = Counter(
            "mtpipe_completion_tokens_total", "Tokens generated, counted as they are handed out.", registry=r
        )
        self.drafted = Counter("mtpipe_mtp_drafted_tokens_total", "Draft tokens proposed by the MTP head.", registry=r)
        self.accepted = Counter(
            "mtpipe_mtp_accepted_tokens_total", "Draft tokens accepted by verification.", registry=r
        )
        self.acceptance_ratio = Gauge(
            "mtpipe_mtp_acceptance_ratio",
            "Accepted over drafted tokens since start (0 before any draft).",
            registry=r,
        )
        self.acceptance_ratio.set_function(self._acceptance_ratio)
        self.e2e_seconds = Histogram(
            "mtpipe_e2e_request_latency_seconds",
            "Time from request to a finished generation's last token.",
            ("endpoint",),
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.tpot_seconds = Histogram(
            "mtpipe_time_per_output_token_seconds",
            "A finished generation's decode time per token after its first.",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.queue_seconds = Histogram(
            "mtpipe_request_queue_time_seconds",
            "A finished generation's time before its prompt went in: waiting for a slot and for room in memory.",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "mtpipe_request_prefill_time_seconds",
            "A finished generation's time from its prompt going in to its first token.",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.decode_seconds = Histogram(
            "mtpipe_request_decode_time_seconds",
            "A finished generation's time from its first token to its last (a preempted one's wait included).",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.request_prompt_tokens = Histogram(
            "mtpipe_request_prompt_tokens", "A finished generation's prompt tokens.", buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "mtpipe_request_generation_tokens", "A finished generation's generated tokens.", buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.decode_tps = Histogram(
            "mtpipe_decode_tokens_per_second",
            "Decode speed of finished generations.",
            buckets=DECODE_TPS_BUCKETS,
            registry=r,
        )

    def _acceptance_ratio(self) -> float:
        drafted = value_of(self.drafted)
        return value_of(self.accepted) / drafted if drafted else 0.0

    def in_flight_now(self) -> int:
        """Generations running now (what the in-flight gauge exposes), for `/health`."""
        return int(value_of(self.in_flight))
