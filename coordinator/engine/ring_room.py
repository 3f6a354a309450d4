"""Room on the nodes for the ring engine's rows: who waits for it, who holds it, who must give it back.

Every node holds, for each group, the caches of its rows for its own layers (node/groups.py: a batch
per group, as long as its longest row), and its budget is its own: half the memory it had free once
its shard was loaded (within what a launched node offers, its --max-memory cap), less its share of
kept prompt prefixes, unless one is given. A request is admitted when, with room for it to grow by a
horizon, every node's groups still fit (scheduler.py); where the running rows outgrow a node after
all, the last admitted (of the lowest priority) leave for the head of the queue and go on where they
stopped once there is room (ring.py puts them back as it puts back rows lost with a node). Nodes
sharing one machine (the same `machine` in their health) share what it has free.
The engine's lock order is a request's lock, then its own or this one: nothing here takes a request's.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ...node.protocol import StageUnavailable
from ...node.sysinfo import memory_offered, sharing
from . import scheduler as plan
from .ring_live import RingLive
from .sinks import ServerBusy

log = logging.getLogger(__name__)

ROOM_CHECK_S = 0.02  # rows are checked against their nodes' budgets at most this often (each round's outcome could)
RETRY_AFTER_DOWN_S = 5  # the Retry-After of a request refused while the pipeline is down
MIN_NODE_BUDGET = 64 * 2**20  # a node with less free than this still takes a row at a time
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}  # the nodes' (HealthReply.dtype)


class RingRoom:
    def __init__(self, args: Any, has_mtp: bool, *, max_rows: int, horizon: int | None = plan.ADMIT_HORIZON,
                 budget: int | None = None, prefix_share: int = 0, kv_step: int = 1):
        self.args, self.has_mtp, self.kv_step = args, has_mtp, kv_step  # (kv_step: models/ragged.py's)
        self.max_rows = max_rows
        self.horizon = horizon  # admitted with room to grow by this many tokens (None: by all its max tokens)
        self.budget = budget  # bytes each node's rows may hold (None: from the memory each had free)
        self.prefix_share = prefix_share  # what a node keeps for prompt prefixes, out of what it had free
        self.nodes: list[plan.NodeRoom] = []  # in pipeline order; none known: rows are admitted by count
        self._budgets: dict[str, int] = {}  # node -> its budget, from the memory it had free when first seen
        self.waiting: list[RingLive] = []  # the FIFO queue: those preempted at its head
        self.held: dict[int, RingLive] = {}  # id(live) -> a request that holds its room (until it ends)
        self.admissions = self.preemptions = 0
        self.lock = threading.Lock()

    def measure(self, health: list[Any]) -> None:
        """Each node's layers and budget from its health reply (pb.HealthReply), in pipeline order
        (without the model's config: rows are admitted by count). A node's budget is read once per shard
        it holds, and not while one has no shard (being formed again: its caches are gone then)."""
        if self.args is None or not all(h.loaded for h in health):
            return
        with self.lock:
            self.nodes = [self._node(h, n) for h, n in zip(health, sharing([h.machine for h in health]))]

    def _node(self, h: Any, sharing: int) -> plan.NodeRoom:
        """`sharing`: how many of the pipeline's nodes run on its machine, whose free memory is theirs together."""
        key = f"{h.node_id}:{h.start}-{h.end}/{sharing}"
        if key not in self._budgets:  # (a launched node's cap holds too: it offers what its weights and rows may use)
            room = memory_offered(h, sharing) - h.parameter_bytes
            free = max(0, room // 2 - self.prefix_share)
            self._budgets[key] = self.budget if self.budget is not None else max(MIN_NODE_BUDGET, free)
        dims = plan.ModelDims.of(self.args, DTYPE_SIZES.get(h.dtype, 2), mtp=self.has_mtp and h.end == h.num_layers,
                                 kv_step=self.kv_step, layers=(h.start, h.end))
        return plan.NodeRoom(dims, self._budgets[key])

    def rebudget(self, budget: int | None, health: list[Any]) -> None:
        """Every node's budget `budget` bytes from now on (None: from the memory each has free now)."""
        with self.lock:
            self.budget, self._budgets = budget, {}
        self.measure(health)

    def queue(self, live: RingLive) -> None:
        with self.lock:
            self.waiting.append(live)

    def admit(self, groups: int, now: float, timeout: float) -> tuple[list[RingLive], list[RingLive]]:
        """Those admitted now, each with the group it joins (`live.group`), and those refused after
        `timeout` seconds in the queue; both out of it."""
        with self.lock:
            self.waiting.sort(key=lambda x: x.req.priority)  # (stable: first come, first served within a priority)
            waiting = [plan.Waiting(str(id(x)), x.need(self.horizon), x.queued, preempted=x.order > 0)
                       for x in self.waiting]
            running: dict[int, list[plan.Footprint]] = {}
            for x in self.held.values():
                running.setdefault(x.group, []).append(x.need(self.horizon))
            if self.nodes:
                chosen = plan.admit_ring(waiting, running, groups, self.nodes, self.max_rows)
            else:  # (no node measured: by count)
                room = max(0, self.max_rows - len(self.held))
                chosen = [(w.seq_id, 0) for w in waiting[:room]]
            by_id = {str(id(x)): x for x in self.waiting}
            admitted = []
            for key, group in chosen:
                live = by_id.pop(key)
                live.group = group or plan.pick_group(_counts(self.held), groups)
                self.admissions += 1
                live.order = self.admissions
                self.held[id(live)] = live
                admitted.append(live)
            refused = [by_id.pop(key) for key in plan.expired([w for w in waiting if w.seq_id in by_id], now, timeout)]
            self.waiting = list(by_id.values())
            return admitted, refused

    def drain(self) -> list[RingLive]:
        """Every request in the queue, out of it (preempted ones too)."""
        with self.lock:
            out, self.waiting = self.waiting, []
            return out

    def give_back(self, live: RingLive) -> None:
        """It ended, or never got its room: out of the queue or the rows (a request's lock may be held)."""
        with self.lock:
            self.held.pop(id(live), None)
            if live in self.waiting:
                self.waiting.remove(live)

    def over(self, movable: set[int]) -> list[RingLive]:
        """The last admitted rows of the lowest priority that must leave, each grown by its next round, for
        the others to fit every node (only those in `movable`, by id: decoding)."""
        with self.lock:
            if not self.nodes or len(self.held) < 2:
                return []
            lives = sorted(self.held.values(), key=lambda x: (x.req.priority, x.order))
            running = [(x.group, x.need(1)) for x in lives]
            return [lives[i] for i in plan.ring_to_preempt(running, self.nodes, [id(x) in movable for x in lives])]

    def preempted(self, live: RingLive) -> None:
        """Out of the rows, to the head of the queue (it waits however long it takes)."""
        with self.lock:
            if self.held.pop(id(live), None) is not None:
                self.waiting.insert(0, live)
                self.preemptions += 1

    def _shares(self) -> list[float]:
        """What each node's rows hold now over its budget (under the lock)."""
        groups: dict[int, list[plan.Footprint]] = {}
        for x in self.held.values():
            groups.setdefault(x.group, []).append(x.need(0))
        return plan.held_shares(self.nodes, list(groups.values()))

    def state(self) -> plan.SchedulerState:
        with self.lock:
            usage = max(self._shares(), default=0.0)
            return plan.SchedulerState(len(self.held), len(self.waiting), usage, self.preemptions)

    def describe(self) -> dict[str, Any]:
        with self.lock:
            return {"admit_horizon": self.horizon, "preemptions": self.preemptions, "waiting": len(self.waiting),
                    "budget_bytes": [n.budget for n in self.nodes],
                    "cache_usage": [round(x, 4) for x in self._shares()]}


class RoomForRows:
    """Admissions and preemptions for RingEngine: it holds `room`, the pool its requests start on, the
    requests whose start is queued, the rows decoding, and how a request starts, leaves and ends."""

    room: RingRoom
    pipeline: Any  # a RemotePipeline (its reformer says whether it is down)
    groups: int
    queue_timeout: float
    _pool: ThreadPoolExecutor
    _lock: threading.Lock
    _queued: dict[int, RingLive]
    _decoding: dict[int, RingLive]
    _stop: threading.Event
    _room_checked: float = 0.0

    if TYPE_CHECKING:  # RingEngine's
        def _start(self, live: RingLive) -> None: ...
        def _finish(self, live: RingLive, error: BaseException | None, released: bool = False) -> None: ...
        def _release(self, live: RingLive, slot: bool = True, free: bool = True) -> None: ...
        def _end_kept(self, live: RingLive, fed: list[int] | None) -> None: ...

    def _admit(self, refuse: bool = False) -> None:
        """Start those the nodes have room for now; with `refuse` (never under a request's lock), refuse
        those that waited past the queue timeout, and every one in the queue once the pipeline will not be
        formed again."""
        admitted, refused = self.room.admit(self.groups, time.monotonic(), self.queue_timeout if refuse else math.inf)
        if refuse and self.pipeline.reformer.down is not None and self.pipeline.reformer.given_up:
            refused += self.room.drain()
        for live in admitted:
            try:
                self._pool.submit(self._start, live)
            except RuntimeError:  # (closed meanwhile: close() ends it)
                pass
        for live in refused:
            with self._lock:
                self._queued.pop(id(live), None)
            self._finish(live, self._down_refusal() or ServerBusy(
                f"no room for this request after {self.queue_timeout:.0f} s in the queue",
                retry_after=max(1, int(self.queue_timeout // 4))))

    def _down_refusal(self) -> Exception | None:
        """What a request is refused with while the pipeline is down (no room comes back then): the node lost,
        and whether it is being formed again."""
        reformer = self.pipeline.reformer
        down = reformer.down
        if down is not None and reformer.given_up:
            return StageUnavailable(str(down))
        if down is not None:
            tried = reformer.attempt_error
            return ServerBusy(f"{down}; the pipeline is being formed again" + (f" (the last attempt: {tried})"
                                                                               if tried is not None else ""),
                              retry_after=RETRY_AFTER_DOWN_S)
        return None

    def scheduler_state(self) -> plan.SchedulerState:
        return self.room.state()

    def _give_back(self, live: RingLive) -> None:
        with self._lock:  # (nothing of it left for close() to end)
            self._queued.pop(id(live), None)
        self.room.give_back(live)
        self._admit()

    def _tend(self) -> None:
        """The watch's turn (no lock held): refuse those that waited too long, admit, preempt."""
        self._admit(refuse=True)
        self._make_room()

    def _make_room(self) -> None:
        """Where the rows, each grown by its next round, outgrow a node: the last admitted leave (freed on
        every node) for the head of the queue, and go on where they stopped once there is room."""
        now = time.monotonic()
        if now - self._room_checked < ROOM_CHECK_S:  # (a row grows by a few tokens a round)
            return
        self._room_checked = now
        with self._lock:
            movable = {k for k, x in self._decoding.items() if not (x.done or x.resuming or x.prefilling)}
        victims = self.room.over(movable)
        for live in victims:
            with live.lock:
                if live.done or live.resuming or live.prefilling:
                    continue
                with self._lock:  # (until it starts again, close() ends it; once closed, the pipeline's end does)
                    if self._stop.is_set():
                        continue
                    self._queued[id(live)] = live
                log.info("sequence %s preempted after %d tokens: it waits for room", live.seq_id, live.generated)
                live.resuming = True  # (nothing on the nodes: a cancel gives its room back)
                self._end_kept(live, None)
                self._release(live, slot=False)
                live.seq_id = uuid.uuid4().hex[:16]  # (what still comes for the one freed is late: dropped)
                live.stats.preempted += 1
                self.room.preempted(live)
        if victims:
            self._admit()


def _counts(held: dict[int, RingLive]) -> dict[int, int]:
    out: dict[int, int] = {}
    for x in held.values():
        out[x.group] = out.get(x.group, 0) + 1
    return out
