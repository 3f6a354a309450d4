"""Bringing a pipeline of nodes back after one is lost, without restarting the coordinator.

When a node dies or stops answering, the pipeline is down: every step in flight fails (naming the
node) and engines refuse new requests with a retry hint. A watcher then tries, about once a second,
to form the same pipeline again: every node answers, each is asked to load its shard (the ones that
kept theirs say so at once; a restarted node loads it, or fetches it from a peer), the ring is
connected again and the subscriptions renewed. From then on the pipeline serves, and requests that
wait for it (engine/ring.py resumes them) go on. An error of the kinds in `final` (another coordinator
took the nodes over) ends the attempts: the pipeline stays down, and whoever waits hears so at once.

A node that stays lost may have its layers taken by the others (`heal`, set by whoever placed the
model, as `mtpipe launch` does): after `heal_after` seconds down, the attempts ask it where the
shards go now, and form the pipeline over the nodes it names instead (each loads its new shard,
fetching what it lacks). An attempt that fails there puts the old nodes back, so the lost node may
still come back and be taken as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from ...models.shard import ShardSpec
from ...proto import mtpipe_pb2 as pb
from .nodes import FrameStream, NodeFailure, NodeLink, check_hops

if TYPE_CHECKING:
    from .renewals import Renewer

log = logging.getLogger(__name__)

RETRY_S = 1.0
HEAL_AFTER_S = 10.0  # a node lost this long has its layers taken by the others, where `heal` says they can


@dataclass(frozen=True)
class Layout:
    """Where a pipeline's shards are: its nodes in order, each one's layers, the nodes each may fetch
    tensors it lacks from, and the addresses the last node may reach the first at."""

    addresses: list[str]
    specs: list[ShardSpec]
    sources: list[list[str]]
    ring_targets: list[str]
    next_targets: list[str] | None = None  # where each node reaches the next (None: where this side does)


# (the pipeline's nodes, those that do not answer) -> where the shards go now; None: wait for them
Heal = Callable[[list[str], list[str]], "Layout | None"]


class Reformer:
    def __init__(self, reform: Callable[[], None], interval: float = RETRY_S,
                 final: tuple[type[Exception], ...] = ()):
        self._reform = reform  # raises while the pipeline cannot be formed again
        self.interval = interval
        self.final = final
        self.given_up = False  # down for good (`down` says why)
        self.down: Exception | None = None  # why the pipeline is down, None while it serves
        self.also: list[Exception] = []  # given up: the same of other nodes that came after (each taken over)
        self.down_at = 0.0  # since when (time.time())
        self.attempt_error: Exception | None = None  # why the last attempt to form it again failed
        self.reformed = threading.Event()  # set while it serves
        self.reformed.set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._losses = 0  # a loss reported while an attempt runs makes that attempt not count

    def lost(self, error: Exception) -> None:
        """A node is lost: down until formed again (one watcher however many failures report it)."""
        with self._lock:
            if self._stop.is_set():
                return
            if self.down is None:
                log.warning("pipeline down: %s; re-forming it", error)
                self.down_at = time.time()
                self.attempt_error = None
            self.down = error
            self._losses += 1
            self.reformed.clear()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="pipeline-reform", daemon=True)
                self._thread.start()

    def wait(self, timeout: float) -> bool:
        """True once the pipeline serves again (at once if it does), False after `timeout` seconds or
        once it is given up."""
        return self.reformed.wait(timeout) and not self.given_up

    def give_up(self, error: Exception) -> None:
        """Down for good: no more attempts."""
        with self._lock:
            named = [str(e) for e in (self.down, *self.also)]
            if self.given_up and type(error) is type(self.down) and str(error) not in named:
                self.also.append(error)  # (another node, for the same reason: each is told)
                return
            if self.given_up or (self._stop.is_set() and self.down is None):
                return  # (already, or the pipeline was closed)
            log.warning("pipeline down for good: %s", error)
            if self.down is None:
                self.down_at = time.time()
            self.down, self.given_up = error, True
            self._stop.set()
            self.reformed.set()  # waiters hear it at once (wait() says False)

    def stop(self) -> None:
        self._stop.set()
        self.reformed.set()  # nobody waits for a closed pipeline

    def _run(self) -> None:
        attempt = 0
        while not self._stop.wait(self.interval):
            attempt += 1
            with self._lock:
                losses = self._losses
            try:
                self._reform()
            except self.final as e:
                self.give_up(e)
                return
            except Exception as e:  # a node still missing, still loading: try again
                # (a new reason is logged once: a node back that cannot load its shard says why here)
                changed = self.attempt_error is None or str(e) != str(self.attempt_error)
                log.log(logging.WARNING if changed else logging.DEBUG, "re-forming the pipeline: attempt %d "
                        "failed: %s", attempt, e)
                self.attempt_error = e
                continue
            with self._lock:
                if self._stop.is_set():  # (closed meanwhile: nothing serves)
                    return
                if losses != self._losses:
                    continue
                log.warning("pipeline formed again after %d attempt(s)", attempt)
                self.down = self.attempt_error = None
                self.reformed.set()
                self._thread = None  # (a loss from now on starts a new watcher: this one is ending)
            return


class Reforming:
    """RemotePipeline's re-forming (a mixin): the same nodes again, or others where `heal` says so."""

    addresses: list[str]
    nodes: list[NodeLink]
    next_targets: list[str]
    ring_targets: list[str]
    sources: list[list[str]]
    secret: str | None
    reformer: Reformer
    heal: Heal | None
    heal_after: float
    on_healed: Callable[[Layout], None]
    _first: FrameStream
    _renewer: Renewer | None
    _connect_lock: threading.Lock
    _load_args: tuple[Path | str, list[ShardSpec], bool, str | None] | None
    _closed: bool
    _missing_since: dict[str, float]  # address -> when the attempts first found it not answering (monotonic)
    _heal_failed = ""  # the last reason a healed layout did not load (logged once)

    @property
    def closed(self) -> bool:
        return self._closed

    if TYPE_CHECKING:  # RemotePipeline's
        def load(self, model_path: Path | str, specs: list[ShardSpec], *, mtp: bool = True,
                 dtype: str | None = None, timeout: float | None = None) -> Any: ...
        def _connect(self) -> None: ...
        def _stream_failed(self, target: str, error: Exception) -> None: ...

    def _reform(self) -> None:
        """One of Reformer's attempts: every node answers and holds its shard (healed: the nodes `heal`
        names, with their new shards), the ring and the subscriptions are back."""
        if self._load_args is None:
            raise RuntimeError("the pipeline was never loaded")
        missing = []
        for n in self.nodes:
            try:
                n.stub.Ping(pb.PingRequest(), timeout=2.0)
            except grpc.RpcError:
                missing.append(n.address)
        now = time.monotonic()
        self._missing_since = {a: self._missing_since.get(a, now) for a in missing}
        healed = self._healed(missing, now) if missing else None
        if missing and healed is None:
            raise NodeFailure(missing[0], "does not answer")
        before = self._relayout(healed) if healed is not None else None
        try:
            model_path, specs, mtp, dtype = self._load_args
            self.load(model_path, specs, mtp=mtp, dtype=dtype)
            check_hops(self.nodes)
            self._connect()
            if healed is not None:
                self.on_healed(healed)
        except BaseException as e:
            if before is not None:
                self._relayout(before)
                if str(e) != self._heal_failed:
                    log.warning("the nodes left did not take the layers (%s): trying again", e)
                self._heal_failed = str(e)
            raise
        if healed is not None:
            self._missing_since, self._heal_failed = {}, ""
            log.warning("the pipeline now runs over %s: %s", ", ".join(healed.addresses),
                        ", ".join(f"layers {s.start}-{s.end - 1}" for s in healed.specs))

    def _healed(self, missing: list[str], now: float) -> Layout | None:
        """Where the shards go without the nodes in `missing`, once each has been missing long enough."""
        if self.heal is None or any(now - self._missing_since[a] < self.heal_after for a in missing):
            return None
        layout = self.heal(list(self.addresses), missing)
        if layout is not None and (len(layout.specs) != len(layout.addresses) or not layout.addresses
                                   or set(layout.addresses) & set(missing)):
            raise ValueError(f"a healed layout of {len(layout.specs)} shard(s) over {layout.addresses}")
        return layout

    def _relayout(self, layout: Layout) -> Layout:
        """Serve over the nodes of `layout`, its shards not loaded yet; the layout before, to go back to.
        Links to the nodes kept stay as they are; the others' close quietly (`retired`)."""
        assert self._load_args is not None
        model_path, specs, mtp, dtype = self._load_args
        before = Layout(list(self.addresses), list(specs), list(self.sources), list(self.ring_targets),
                        list(self.next_targets))
        with self._connect_lock:
            if self._closed:  # (closed while an attempt ran: it opens nothing more)
                raise RuntimeError("the pipeline was closed")
            links = {n.address: n for n in self.nodes}
            self.nodes = [links.pop(a, None) or NodeLink(a, self.secret) for a in layout.addresses]
            self.addresses = list(layout.addresses)
            for n in links.values():
                if n.subscription is not None:
                    n.subscription.cancel()
                n.channel.close()
            self.next_targets = list(layout.next_targets or [*self.addresses[1:], ""])
            self.ring_targets = list(dict.fromkeys([*layout.ring_targets, self.addresses[0]]))
            self.sources = list(layout.sources)
            self._load_args = (model_path, list(layout.specs), mtp, dtype)
            if self._renewer is not None:  # (one over the new nodes as the subscriptions come back)
                self._renewer.stop()
                self._renewer = None
            if self._first.target != self.addresses[0]:
                self._first.close()
                self._first = FrameStream(self.addresses[0], self.secret, self._stream_failed)
        return before

    def retired(self, node: NodeLink) -> bool:
        """A node's link no longer part of the pipeline (healed without it): its stream ends unreported."""
        return all(n is not node for n in self.nodes)
