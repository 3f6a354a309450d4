"""Where a lost node's layers go: the nodes left take them, when their memory holds the model.

`mtpipe launch` places the model once, over the nodes it found (formation.py). When one of them
stays lost (`placement.heal_after_s`), the pipeline's re-forming (pipeline/reform.py) asks the
`Healer` where the shards go now: over the placed nodes that still answer, placed again as at launch
(the memory each offers now, in the order their links favour, the coordinator first, cluster.yaml's
layer counts kept for them). One node left that holds the whole model runs the ring's groups by
itself (its rounds start in-process); nodes left that cannot hold the model wait for the lost one to
come back. Spares take layers too: a node an earlier heal left out that is back and idle (in the place
it had), and, under launch, a member that joined after placement (placed last). Once the pipeline serves
over the new shards, the hops between new neighbours are measured as at launch, and the formation (what
GET /v1/cluster and `mtpipe health` report) says where everything is. `serve --nodes --heal-after` heals
the same way over the nodes it was given, in their order (`Healer.over_nodes`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from ...models.shard import ShardSpec
from ...node.sysinfo import sharing
from ..pipeline.reform import Layout
from .formation import Formation, Hop, confirm_hops, offered_bytes, ring_candidates, ring_hop, weight_sources
from .placement import ModelFootprint, NodeResources, PlacementError, StagePlan, order_nodes, plan_layers

log = logging.getLogger(__name__)

CHECK_LEFT_S = 5.0  # how often a node a heal left out is asked whether it came back holding its old shard
SPARE_TIMEOUT_S = 1.0  # how long a heal waits for a node left out before to say whether it is back


def heal_plan(footprint: ModelFootprint, survivors: list[NodeResources], first: str,
              overrides: dict[str, int], keep_order: bool = False) -> tuple[list[NodeResources], list[StagePlan]]:
    """The nodes left in pipeline order and their layers (PlacementError when they cannot take them).
    Their layer counts in cluster.yaml stand where a placement with them fits; where none does (they
    leave no room for the layers of the node lost, say), layers follow memory. `keep_order`: the nodes
    stay in the order given (one a user chose, `serve --nodes`), else ordered as at launch."""
    if not survivors:
        raise PlacementError("no node is left")
    order = list(survivors) if keep_order else order_nodes(survivors, first=first)
    ids = {n.node_id for n in order}
    kept = {k: v for k, v in overrides.items() if k in ids}
    try:
        return order, plan_layers(footprint, order, kept)
    except PlacementError:
        if not kept:
            raise
        return order, plan_layers(footprint, order)


def formation_of(addresses: list[str], health: list[Any]) -> Formation:
    """The formation of a pipeline formed over nodes named by address (benches, tests): their Health
    replies in pipeline order say who holds what."""
    order = [NodeResources(h.node_id, 0, (), int(a.rsplit(":", 1)[1]), (a.rsplit(":", 1)[0].strip("[]"),))
             for a, h in zip(addresses, health)]
    plan = [StagePlan(h.node_id, h.start, h.end, h.parameter_bytes, 0) for h in health]
    return Formation(plan, {h.node_id: a for a, h in zip(addresses, health)}, [], order=order)


class Healer:
    """The `heal` of a launched pipeline (pipeline/reform.py's `Heal`), and what it does once healed.

    `me`: the node that coordinates, first in the ring, whose node server holds the model for the
    others to fetch. `sources`: instead, the addresses every node fetches what it lacks from (`serve
    --nodes --weights-from`: none, each loads from its model directories), its order kept.
    """

    def __init__(self, formation: Formation, footprint: ModelFootprint, me: str, secret: str | None,
                 reserve: int, on_placed: Callable[[Formation], None] = lambda f: None,
                 sources: list[str] | None = None,
                 joined: Callable[[], dict[str, tuple[NodeResources, str]]] | None = None):
        self.formation = formation
        self.footprint = footprint
        self.me = me
        self.secret = secret
        self.reserve = reserve
        self.on_placed = on_placed  # the formation changed (`mtpipe health`'s placed addresses)
        self.sources = sources
        # members that joined after placement: id -> (resources, control address)
        self.joined = joined or (lambda: {})
        self.pipeline: Any = None
        self._pending: dict[tuple[str, ...], tuple[list[NodeResources], list[StagePlan]]] = {}
        self._lock = threading.Lock()
        self._left: dict[str, str] = {}  # node id -> address: nodes a heal left out that may come back with a shard
        self.left_out: dict[str, str] = {}  # node id -> address: every node heals left out, until placed again
        self._known = {n.node_id: n for n in formation.order}  # every node placed at first, in its order
        self._sweeping = False
        self.check_left_s = CHECK_LEFT_S
        self._said = ""  # what the last attempt found (said once, not every second)

    @classmethod
    def over_nodes(cls, model_path: Any, pipeline: Any, secret: str | None = None, sources: list[str] | None = None,
                   reserve: int = 0) -> Healer:
        """For a pipeline formed over nodes named by address (`serve --nodes`, benches, tests): who
        holds what, from their Health; the nodes left keep the order given."""
        from .placement import model_footprint

        health = pipeline.health()
        ids = [h.node_id for h in health]
        if len(set(ids)) < len(ids):
            raise ValueError(f"the nodes do not have an id each ({', '.join(ids)}): give each its own --node-id "
                             "for the others to take its layers")
        formation = formation_of(pipeline.addresses, health)
        return cls(formation, model_footprint(model_path), formation.order[0].node_id, secret, reserve,
                   sources=list(sources or []))

    def attach(self, pipeline: Any, heal_after: float | None) -> None:
        """Heal `pipeline` (a RemotePipeline) after `heal_after` seconds of a node lost (None: never)."""
        self.pipeline = pipeline
        if heal_after is not None:
            pipeline.heal, pipeline.heal_after, pipeline.on_healed = self, heal_after, self.healed

    def __call__(self, addresses: list[str], missing: list[str]) -> Layout | None:
        control = self.formation.control
        placed = {control[n.node_id]: n for n in self.formation.order}
        survivors = [placed[a] for a in addresses if a not in missing and a in placed]
        spares = self._spares(missing)
        if spares:  # (where they were first, for an order a user chose)
            rank = list(self._known)
            survivors = sorted([*survivors, *spares], key=lambda n: rank.index(n.node_id))
        try:
            health = [self._health(n) for n in survivors]
            offered = [offered_bytes(h, self.reserve, k) for h, k in zip(health, sharing([h.machine for h in health]))]
            order, plan = heal_plan(self.footprint, [replace(n, available=k) for n, k in zip(survivors, offered)],
                                    self.me, self.formation.overrides, keep_order=self.sources is not None)
        except (PlacementError, ConnectionError) as e:
            self._say(f"the nodes left cannot take the layers of {', '.join(missing)} ({e}): waiting for it")
            return None
        sources = (weight_sources(order, self.me, control) if self.sources is None
                   else [[a for a in self.sources if a != control[n.node_id]] for n in order])
        layout = Layout([control[n.node_id] for n in order], [ShardSpec(s.start, s.end, plan[-1].end) for s in plan],
                        sources, [c.target for c in ring_candidates(order, control)])
        with self._lock:
            self._pending = {tuple(layout.addresses): (order, plan)}
        self._say(f"giving the layers of {', '.join(missing)} to "
                  + ", ".join(f"{s.node_id} ({s.start}-{s.end - 1})" for s in plan))
        return layout

    def _spares(self, missing: list[str]) -> list[NodeResources]:
        """The nodes an earlier heal left out that are back and idle (no shard: one it still held is being
        unloaded), and those that joined after placement (`joined`): they take layers, as at first, where a
        node is lost now. One that does not answer, or holds a shard, is left out of this heal."""
        with self._lock:
            left = dict(self.left_out)
        try:
            joined = self.joined()
        except Exception:  # noqa: BLE001 - without them, the heal goes on over the others
            log.warning("the nodes that joined after placement could not be listed", exc_info=True)
            joined = {}
        placed = {n.node_id for n in self.formation.order}
        for node_id, (node, address) in joined.items():  # (spares too, placed last)
            if node_id not in self._known:
                self._known[node_id] = node
                self.formation.control[node_id] = address
            if node_id not in placed:
                left.setdefault(node_id, address)
        asked = [n for n, address in left.items() if address not in missing and n in self._known]
        if not asked:
            return []

        def idle(node_id: str) -> bool:
            try:  # (briefly, and all at once: machines switched off must not hold every attempt up)
                h = self._health(self._known[node_id], timeout=SPARE_TIMEOUT_S)
            except ConnectionError:
                return False
            return h.node_id == node_id and not h.loaded

        with ThreadPoolExecutor(min(len(asked), 8), thread_name_prefix="heal-spares") as pool:
            out = [self._known[n] for n, ok in zip(asked, pool.map(idle, asked)) if ok]
        with self._lock:  # (idle: nothing for the sweep to unload, and the shard each loads now is ours)
            for n in out:
                self._left.pop(n.node_id, None)
        if out:
            log.info("spare node(s) %s (left out by an earlier heal, or joined since placement) can take layers",
                     ", ".join(n.node_id for n in out))
        return out

    def healed(self, layout: Layout) -> None:
        """The pipeline serves over `layout`: measure the new hops and say where everything is."""
        with self._lock:
            order, plan = self._pending.pop(tuple(layout.addresses))
        control = self.formation.control
        try:
            hops = confirm_hops(order, control, self.secret)
            self.pipeline.keep_next_targets([h.address for h in hops])
        except Exception as e:  # noqa: BLE001 - the hops carry (the pipeline checked): only unmeasured
            log.warning("the new hops could not be measured (%s): kept as loaded", e)
            hops = [Hop(a.node_id, b.node_id, control[b.node_id], None, None) for a, b in itertools.pairwise(order)]
        f = self.formation
        left = {n.node_id for n in f.order} - {n.node_id for n in order}
        f.order, f.plan, f.hops = order, plan, hops
        f.ring = ring_hop(order, ring_candidates(order, control), self.pipeline)
        self.on_placed(f)
        with self._lock:
            self._left.update({n: control[n] for n in left})
            placed = {n.node_id for n in order}
            self.left_out = {**{n: a for n, a in self.left_out.items() if n not in placed},
                             **{n: control[n] for n in left}}
            start, self._sweeping = bool(self._left) and not self._sweeping, self._sweeping or bool(self._left)
        if start:
            threading.Thread(target=self._sweep, name="heal-left-out", daemon=True).start()

    def _sweep(self) -> None:
        """Until the pipeline closes, ask each node a heal left out, every `check_left_s`, whether it came
        back holding its shard of an earlier placement (it hung, say): that memory serves nothing now, so
        it is unloaded. A node that is back without one, or serves another coordinator now, is left alone."""
        try:
            while True:
                time.sleep(self.check_left_s)
                with self._lock:  # (ends in the turn that finds nothing left: a heal meanwhile starts another)
                    if self.pipeline is None or self.pipeline.closed or not self._left:
                        self._sweeping = False
                        return
                    placed = {m.node_id for m in self.formation.order}
                    left = {n: a for n, a in self._left.items() if n not in placed}
                for node_id, address in left.items():
                    with self._lock:
                        if node_id not in self._left:  # (a heal took it as a spare meanwhile: its shard is ours)
                            continue
                    try:
                        done = unload_left_out(node_id, address, self.secret, self.pipeline.client_id)
                    except Exception:  # noqa: BLE001 - asked again next time
                        log.warning("cannot ask node %s whether it holds a shard", node_id, exc_info=True)
                        continue
                    if done is not None:
                        with self._lock:
                            self._left.pop(node_id, None)
        except BaseException:
            with self._lock:
                self._sweeping = False
            raise

    def _health(self, node: NodeResources, timeout: float = 5.0) -> Any:
        """The node's Health now: what it offers for weights (its own shard counts as free), its machine."""
        import grpc

        from ...node.wire import describe_rpc_error, make_channel
        from ...proto import mtpipe_pb2 as pb
        from ...proto import mtpipe_pb2_grpc as pb_grpc

        address = self.formation.control[node.node_id]
        try:
            with make_channel(address, self.secret) as channel:
                h = pb_grpc.NodeStub(channel).Health(pb.HealthRequest(), timeout=timeout)
        except grpc.RpcError as e:
            raise ConnectionError(f"node {node.node_id} at {address}: {describe_rpc_error(e)}") from None
        return h

    def _say(self, what: str) -> None:
        """Logged once while the attempts, a second apart, keep finding the same."""
        if what != self._said:
            log.warning("%s", what)
        self._said = what


def unload_left_out(node_id: str, address: str, secret: str | None, client_id: str) -> bool | None:
    """Unload the shard `node_id` (at `address`, left out of the pipeline) still holds for this client:
    True if it held one, False if there is nothing to do there (no shard, another node at that address
    now, or another coordinator's), None if it does not answer (asked again later)."""
    import grpc

    from ...node.wire import describe_rpc_error, make_channel
    from ...proto import mtpipe_pb2 as pb
    from ...proto import mtpipe_pb2_grpc as pb_grpc

    try:
        with make_channel(address, secret) as channel:
            stub = pb_grpc.NodeStub(channel)
            h = stub.Health(pb.HealthRequest(), timeout=5.0)
            if h.node_id != node_id or not h.loaded:
                return False
            reply = stub.Unload(pb.UnloadRequest(client_id=client_id), timeout=30.0)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # (a node of an earlier version)
            log.warning("node %s came back holding its shard and cannot unload it: restart it to free its memory",
                        node_id)
            return False
        if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
            return None
        log.info("node %s came back serving another coordinator: %s", node_id, describe_rpc_error(e))
        return False
    if reply.unloaded:
        log.warning("node %s came back holding layers %d-%d of an earlier placement: unloaded (%.2f GiB freed)",
                    node_id, h.start, h.end - 1, reply.freed_bytes / 2**30)
    return reply.unloaded
