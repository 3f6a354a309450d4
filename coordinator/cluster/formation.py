"""Forming a cluster on the coordinator: from the discovered nodes to a loaded pipeline.

Place the model over the nodes (placement.py), choose how the coordinator reaches each one, have
them load their shards in parallel (the last node linking back to the first at the best address
where the first node itself answers), then confirm each hop's address with a round trip measured by
the sending node. Also what GET /v1/cluster says.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...node.advertise import NodeAdvert
from ...node.links import Interface, format_host_port, split_host_port, strip_scope
from ...node.sysinfo import memory_offered, sharing
from .config import ClusterConfig, StaticNode
from .placement import GiB, HopCandidate, ModelFootprint, NodeResources, StagePlan, hop_candidates

if TYPE_CHECKING:
    from .agent import ClusterAgent
    from .health import Reached
    from .membership import Membership

log = logging.getLogger(__name__)


@dataclass
class Hop:
    source: str  # node id
    target: str  # node id
    address: str
    link: str | None
    rtt_ms: float | None


@dataclass
class Formation:
    plan: list[StagePlan]
    control: dict[str, str]  # node id -> address the coordinator uses
    hops: list[Hop]
    ring: Hop | None = None  # last node -> first node, for the decode rounds the last node starts
    order: list[NodeResources] = field(default_factory=list)  # the placed nodes, in pipeline order
    overrides: dict[str, int] = field(default_factory=dict)  # cluster.yaml's layer counts, by node id
    footprint: ModelFootprint | None = None  # what the model was placed as (read from its headers)


def placed_addresses(formation: Formation, static: dict[str, NodeResources]) -> dict[str, str]:
    """Each placed node's id -> the address `mtpipe health` finds it at: a cluster.yaml node's as listed
    there (`static_resources`: a down one is a row at that address, with no id of its own), another's
    where the coordinator reaches it."""
    return {s.node_id: format_host_port(static[s.node_id].addresses[0], static[s.node_id].port)
            if s.node_id in static else formation.control[s.node_id] for s in formation.plan}


def resources_from_advert(ad: NodeAdvert, reserve: int) -> NodeResources:
    return NodeResources(ad.node_id, max(ad.mem_available - reserve, 0), ad.interfaces, ad.port, ad.addresses)


def static_resources(nodes: list[StaticNode], secret: str | None, reserve: int,
                     timeout: float = 10.0, skip_unreachable: bool = False) -> list[NodeResources]:
    """Nodes named in cluster.yaml (no multicast): ask each one's Health for its id and memory. One that
    does not answer is an error, or with `skip_unreachable` left out (as discovery goes on without a
    node it did not see)."""
    import grpc

    from ...node.wire import describe_rpc_error, make_channel
    from ...proto import mtpipe_pb2 as pb
    from ...proto import mtpipe_pb2_grpc as pb_grpc

    answered: list[tuple[StaticNode, Any]] = []
    seen: dict[str, str] = {}  # node id -> the address that reached it first
    for n in nodes:
        try:
            with make_channel(n.address, secret) as channel:
                h = pb_grpc.NodeStub(channel).Health(pb.HealthRequest(), timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as e:
            if not skip_unreachable:
                raise ConnectionError(f"static node {n.address}: {describe_rpc_error(e)}") from None
            log.warning("static node %s does not answer (%s): going on without it", n.address, describe_rpc_error(e))
            continue
        if h.node_id in seen:  # two names of one machine would make two stages of one shard
            raise ValueError(f"static nodes {seen[h.node_id]} and {n.address} are the same node ({h.node_id}): "
                             "list each machine once")
        seen[h.node_id] = n.address
        answered.append((n, h))
    counts = sharing([h.machine for _, h in answered])
    return [NodeResources(h.node_id, offered_bytes(h, reserve, k), (), n.port, (n.host,))
            for (n, h), k in zip(answered, counts)]


def offered_bytes(h: Any, reserve: int, sharing: int = 1) -> int:
    """What a node's Health says it offers for weights (sysinfo.memory_offered), less `reserve`."""
    return max(memory_offered(h, sharing) - reserve, 0)


def static_reached(nodes: Sequence[StaticNode], secret: str | None, wait: float) -> list[Reached]:
    """cluster.yaml's nodes that answer within `wait` seconds (asked again until then): how each answered
    its Ping, over the cluster's TLS (its id, whether it says it coordinates, its address)."""
    import grpc

    from .health import ping

    deadline = time.monotonic() + wait
    out: list[Reached] = []
    left = list(nodes)
    while True:
        for n in list(left):
            try:
                out.append(ping(n.address, secret, timeout=2.0))
            except grpc.RpcError:
                continue
            left.remove(n)
        if not left or time.monotonic() >= deadline:
            return out
        time.sleep(0.5)


def static_flags(nodes: list[StaticNode], secret: str | None, wait: float) -> dict[str, bool]:
    """cluster.yaml's nodes that answer within `wait` seconds, by id, each with whether it says it
    coordinates: what they count for in the election."""
    return {r.node_id: r.coordinator for r in static_reached(nodes, secret, wait)}


def static_nodes(cfg: ClusterConfig, secret: str | None, me: str, local: list[Interface],
                 timeout: float = 10.0) -> dict[str, NodeResources]:
    """cluster.yaml's nodes that answer, by id. One that answers with this node's id must be this machine:
    another is a clone of its state directory, which would make two stages of one id."""
    reserve = int(cfg.placement.reserve_gib * GiB)
    out = {n.node_id: n for n in static_resources(cfg.nodes, secret, reserve, timeout, skip_unreachable=True)}
    if me in out and not is_this_machine(out[me].addresses[0], local):
        raise ValueError(f"static node {format_host_port(out[me].addresses[0], out[me].port)} answers with this "
                         f"node's id {me!r}: two machines share an id (a copied state directory? delete the "
                         "node_id file of one)")
    return out


def is_this_machine(host: str, local: list[Interface]) -> bool:
    """`host` (an address or a name) is one of this machine's addresses."""
    import ipaddress
    import socket

    mine = {str(n.ip) for i in local for n in i.networks()}
    try:
        found = {strip_scope(a[4][0])[0] for a in socket.getaddrinfo(strip_scope(host)[0], None)}
    except OSError:
        return False
    return any(a in mine or ipaddress.ip_address(a).is_loopback for a in found)


def with_static_host(node: NodeResources, listed: NodeResources | None) -> NodeResources:
    """A discovered node (or this one) that cluster.yaml lists too: the host it is listed under is one
    more address the others may reach it at (this node's own advert has none)."""
    if listed is None:
        return node
    return replace(node, addresses=tuple(dict.fromkeys([*node.addresses, *listed.addresses])))


def choose_control_addresses(
    order: list[NodeResources], me: str, my_target: str, local: list[Interface], secret: str | None
) -> dict[str, str]:
    """How the coordinator reaches each node: the best shared link that answers as that node."""
    from .health import first_reachable

    control = {}
    for n in order:
        if n.node_id == me:
            control[me] = my_target
            continue
        targets = [c.target for c in hop_candidates(local, n)] or [format_host_port(a, n.port) for a in n.addresses]
        reached = first_reachable(targets, secret, n.node_id if n.interfaces else None)
        if reached is None:
            raise ConnectionError(f"node {n.node_id} does not answer at {', '.join(targets) or 'any address'}")
        control[n.node_id] = reached.target
    return control


def link_candidates(src: NodeResources, dst: NodeResources, control: dict[str, str]) -> list[HopCandidate]:
    """Addresses `src` may reach `dst` at, best first (on a subnet they share, then where `dst` was seen
    or listed), ending with the coordinator's own address of `dst`."""
    candidates = hop_candidates(src.interfaces or None, dst)
    if control[dst.node_id] not in [c.target for c in candidates]:
        candidates.append(HopCandidate(*split_host_port(control[dst.node_id], dst.port), None))
    return candidates


def confirm_hops(order: list[NodeResources], control: dict[str, str], secret: str | None) -> list[Hop]:
    """For each hop, the best candidate address that the sending node measures a round trip to.

    Nodes were loaded with the coordinator's addresses of their successors; a better one (a
    Thunderbolt subnet the coordinator is not on, say) replaces it once the sender reaches it.
    """
    from ...node.wire import make_channel
    from ...proto import mtpipe_pb2 as pb
    from ...proto import mtpipe_pb2_grpc as pb_grpc

    hops = []
    for src, dst in itertools.pairwise(order):
        candidates = link_candidates(src, dst, control)
        loaded_with = control[dst.node_id]
        chosen = None
        with make_channel(control[src.node_id], secret) as channel:
            stub = pb_grpc.NodeStub(channel)
            for cand in candidates:
                if cand.target != loaded_with:
                    stub.Connect(pb.ConnectRequest(next=cand.target), timeout=30)
                    loaded_with = cand.target
                rtt = stub.Health(pb.HealthRequest(probe_next=True), timeout=10).next_rtt_ms
                if rtt >= 0:
                    chosen = Hop(src.node_id, dst.node_id, cand.target, cand.link.value if cand.link else None,
                                 round(rtt, 3))
                    break
                log.info("node %s cannot reach %s at %s", src.node_id, dst.node_id, cand.target)
            if chosen is None:
                if loaded_with != control[dst.node_id]:
                    stub.Connect(pb.ConnectRequest(next=control[dst.node_id]), timeout=30)
                log.warning("node %s reaches %s at none of %s", src.node_id, dst.node_id,
                            ", ".join(c.target for c in candidates))
                chosen = Hop(src.node_id, dst.node_id, control[dst.node_id], None, None)
        hops.append(chosen)
    return hops


def ring_candidates(order: list[NodeResources], control: dict[str, str]) -> list[HopCandidate]:
    """Addresses the last node may reach the first at, best first (the pipeline tries them in turn: the
    coordinator's own address of the first node may mean another host from there)."""
    return link_candidates(order[-1], order[0], control) if len(order) > 1 else []


def ring_hop(order: list[NodeResources], candidates: list[HopCandidate], pipeline: Any) -> Hop | None:
    """The last node's link back to the first, as the loaded pipeline connected it."""
    if len(order) < 2:
        return None
    if not pipeline.rings:
        log.warning("node %s reaches %s at none of %s: the coordinator will start every decode round",
                    order[-1].node_id, order[0].node_id, ", ".join(c.target for c in candidates))
        return None
    target = pipeline.ring_targets[0]
    link = next((c.link for c in candidates if c.target == target), None)
    return Hop(order[-1].node_id, order[0].node_id, target, link.value if link else None, None)


def weight_sources(order: list[NodeResources], holder: str, control: dict[str, str]) -> list[list[str]]:
    """For each node, the addresses it may fetch the model's tensors from: the node `holder` (the
    coordinator, whose node server serves the model it was given) over the best link first."""
    src = next((n for n in order if n.node_id == holder), None)
    if src is None:
        return [[] for _ in order]
    out = []
    for n in order:
        targets = [c.target for c in link_candidates(n, src, control)]
        targets[-1:-1] = [t for t in (format_host_port(a, src.port) for a in src.addresses) if t not in targets]
        out.append(targets)
    return out


def load_with_progress(
    model_path: Path, order: list[NodeResources], plan: list[StagePlan], control: dict[str, str], mtp: bool,
    dtype: str | None, secret: str | None, console: Any, sources: list[list[str]] | None = None,
    take_over: bool = False, prefix_cache: int | None = None, ring_targets: list[str] | None = None,
    resume_window: float | None = None, claim: Any = None,
) -> Any:
    """ring_engine over the placed nodes, with a line per node until its shard is loaded (and how
    much of it has arrived, while a node fetches its shard from a peer)."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from ...models.shard import ShardSpec
    from ..engine.build import ring_engine
    from .health import probe_node, transfer_text

    addresses = [control[n.node_id] for n in order]
    specs = [ShardSpec(s.start, s.end, plan[-1].end) for s in plan]
    with ThreadPoolExecutor(1) as pool, Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                                 TimeElapsedColumn(), console=console, transient=False) as progress:
        tasks = {
            s.node_id: progress.add_task(f"{s.node_id}: layers {s.start}-{s.end - 1} ({s.bytes / GiB:.2f} GiB) loading",
                                         total=1)
            for s in plan
        }
        future = pool.submit(ring_engine, model_path, addresses, mtp, secret, specs=specs, dtype=dtype,
                             sources=sources, take_over=take_over, prefix_cache=prefix_cache,
                             ring_targets=ring_targets, **({} if resume_window is None else
                                                           {"resume_window": resume_window}),
                             **({} if claim is None else {"claim": claim}))
        pending = dict(zip([s.node_id for s in plan], zip(plan, addresses)))
        while not wait([future], timeout=0.5).done:
            for node, (s, address) in list(pending.items()):
                row = probe_node(address, secret, timeout=1.0, probe_next=False)
                if row.get("layers") == [s.start, s.end]:
                    progress.update(tasks[node], completed=1, description=f"{node}: layers {s.start}-{s.end - 1} loaded")
                    del pending[node]
                elif transfer_text(row):
                    progress.update(tasks[node], description=f"{node}: layers {s.start}-{s.end - 1} "
                                                             f"{transfer_text(row)}")
        engine = future.result()
        for node, (s, _) in pending.items():
            progress.update(tasks[node], completed=1, description=f"{node}: layers {s.start}-{s.end - 1} loaded")
    return engine


def check_alone(cfg: ClusterConfig, advert: NodeAdvert, model_path: Path, mtp: bool) -> None:
    """A machine that runs the model alone is placed as one of several would be: PlacementError where
    its memory (less the reserve) cannot hold the model, or where placement.layers names another node
    or gives it other than all the layers."""
    from .placement import model_footprint, plan_layers

    me = resources_from_advert(advert, int(cfg.placement.reserve_gib * GiB))
    plan_layers(model_footprint(model_path, mtp=mtp), [me], dict(cfg.placement.layers))


def form_cluster(
    cfg: ClusterConfig, me: str, my_target: str, peers: dict[str, NodeAdvert], static: dict[str, NodeResources],
    local: list[Interface], model_path: Path, mtp: bool, secret: str | None, console: Any, take_over: bool = False,
    claim: Any = None,
) -> tuple[Any, Formation]:
    """Place the model over the discovered and static nodes (`static_nodes`) and build the engine over them,
    its Loads carrying this coordinator's `claim` (its term, node/coordinators.py)."""
    from ..engine.ring import RESUME_WINDOW_S
    from .placement import describe_plan, model_footprint, order_nodes, plan_layers

    reserve = int(cfg.placement.reserve_gib * GiB)
    nodes = [with_static_host(resources_from_advert(ad, reserve), static.get(ad.node_id)) for ad in peers.values()]
    nodes += [n for n in static.values() if n.node_id not in peers]
    footprint = model_footprint(model_path, mtp=mtp)
    order = order_nodes(nodes, first=me)
    hosts = {n.addresses[0]: n.node_id for n in static.values()}  # static nodes: by host too
    overrides = {hosts.get(k, k): v for k, v in cfg.placement.layers.items()}
    plan = plan_layers(footprint, order, overrides)
    log.info("placement: %s", describe_plan(plan))
    control = choose_control_addresses(order, me, my_target, local, secret)
    sources = weight_sources(order, me, control)  # nodes without the model fetch their shards from this one
    ring = ring_candidates(order, control)
    # Requests wait for a lost node, or for the others to take its layers (heal.py) and load them.
    resume = RESUME_WINDOW_S + (cfg.placement.heal_after_s or 0.0)
    engine = load_with_progress(model_path, order, plan, control, mtp, cfg.dtype, secret, console, sources,
                                take_over, cfg.prefix_cache(), [c.target for c in ring], resume, claim)
    try:
        hops = confirm_hops(order, control, secret)
        engine.pipeline.keep_next_targets([h.address for h in hops])
    except BaseException:
        engine.close()
        raise
    return engine, Formation(plan, control, hops, ring_hop(order, ring, engine.pipeline), order, overrides,
                             footprint)


def single_node_engine(server: Any, model_path: Path, mtp: bool, dtype: str | None, options: dict[str, Any],
                       progress: Callable[[int, int], None] | None = None) -> Any:
    """The whole model in this process, batched on its own MLX thread; the node server reports the
    stage in Health (its statistics are the batch's)."""
    import mlx.core as mx

    from ...node.service import LoadKey
    from ..engine.build import batch_engine

    engine = batch_engine(model_path, mtp=mtp, dtype=getattr(mx, dtype) if dtype else None, progress=progress,
                          **options)
    stage = engine.stages[0].worker
    n = stage.spec.num_layers
    server.service.adopt(stage, LoadKey(str(Path(model_path).resolve()), 0, n, n, mtp, dtype or ""))
    return engine


def cluster_info_fn(cfg: ClusterConfig, me: str, my_target: str, engine: Any, model_name: str,
                    formation: Formation | None, agent: ClusterAgent | None, secret: str | None,
                    membership: Membership | None = None) -> Callable[[], dict]:
    """What GET /v1/cluster answers: placement, hops, each node's health, what discovery saw (only the
    nodes that proved membership count as discovered; the others are left out, with why)."""
    from .health import probe_nodes

    def placement() -> tuple[list[dict], list[dict], dict | None]:
        """(read at each call: a healed pipeline changes the formation, heal.py)"""
        if formation is None:
            return [{"node": me, "address": my_target,
                     "layers": engine.pipeline.describe()["stages"][0]["layers"]}], [], None
        plan = [{"node": s.node_id, "address": formation.control[s.node_id], "layers": [s.start, s.end],
                 "bytes": s.bytes} for s in formation.plan]
        return plan, [asdict(h) for h in formation.hops], asdict(formation.ring) if formation.ring else None

    def info() -> dict:
        plan, hops, ring = placement()
        peers = agent.peers() if agent else {}
        members = membership.members(peers) if membership else {}  # (one that joined since proves it, once)
        discovered, left_out = membership.report(peers) if membership else (sorted(peers), {})
        idle = sorted(set(discovered) - {p["node"] for p in plan})
        # A spare is asked too: one killed outright keeps its advert until zeroconf's records expire.
        where = {n: a for n in idle
                 if n in members and (a := membership.address(members[n]))}  # type: ignore[union-attr]
        rows = probe_nodes([p["address"] for p in plan] + list(where.values()), secret)
        gone = sorted(n for n, row in zip(where, rows[len(plan):]) if not row.get("reachable"))
        return {
            "mode": "cluster" if formation else "local",
            "cluster": cfg.name,
            "coordinator": me,
            "model": model_name,
            "mtp": engine.has_mtp,
            "batching": engine.batching,
            "max_context": engine.max_context,
            "placement": plan,
            "links": hops,
            "ring": ring,
            "nodes": rows[:len(plan)],
            "discovered": discovered,
            # members that hold no layers: the next heal places layers on those idle then (heal.py)
            "spares": [n for n in idle if n not in gone],
            "unreachable": gone,  # (discovered members that hold no layers and do not answer)
            "left_out": left_out,
            "ignored": sorted(agent.discovery.ignored) if agent else [],
        }

    return info
