"""Placement: which node holds which contiguous layers, in which order, reached at which address.

Pure functions over plain dataclasses (like exo's worker/plan.py), so every decision is testable
without a network:

- `model_footprint` reads only safetensors headers: bytes per layer, embedding, head, MTP head, and
  the draft vocabulary's copy of the output projection's rows (models/draft_vocab.py, default size).
- `order_nodes` picks the stage order whose consecutive stages share the best links
  (loopback > thunderbolt > ethernet > wifi > other), the coordinator first.
- `plan_layers` splits the layers in proportion to available memory (largest remainder), with the
  embedding counted on the first stage and norm + lm_head + MTP head on the last, honours
  per-node overrides, and refuses with "model needs X GiB, cluster has Y GiB available: Z GiB short".
- `hop_candidates` lists, best first, the addresses a stage can reach the next one at: a shared
  subnet of the best link type; link-local addresses only across links of the same type, IPv6
  ones scoped by the source's interface. The caller confirms one by a measured round trip.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ...models.fingerprint import tensor_bytes
from ...node.links import (
    LINK_RANK,
    Interface,
    LinkType,
    format_host_port,
    is_link_local,
    strip_scope,
)

log = logging.getLogger(__name__)

GiB = 2**30


class PlacementError(ValueError):
    pass


# -- the model's footprint ----------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFootprint:
    layer_bytes: tuple[int, ...]
    embed_bytes: int
    head_bytes: int  # final norm + lm_head (0 when tied)
    mtp_bytes: int  # the MTP head, on the last stage when speculating
    last_needs_embedding: bool  # tied lm_head or MTP head: the last stage keeps its own embedding
    draft_bytes: int = 0  # the draft vocabulary's rows of the projection, copied, on the last stage

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    def end_bytes(self, first: bool, last: bool) -> int:
        """What a stage holds besides its layers: the embedding first; head, MTP head, draft rows (and
        the embedding) last."""
        total = self.embed_bytes if first else 0
        if last:
            total += self.head_bytes + self.mtp_bytes + self.draft_bytes
            if not first and self.last_needs_embedding:
                total += self.embed_bytes
        return total

    def stage_bytes(self, start: int, end: int) -> int:
        return sum(self.layer_bytes[start:end]) + self.end_bytes(start == 0, end == self.num_layers)

    def total_bytes(self, stages: int) -> int:
        """Bytes over all stages of a pipeline of `stages` stages (the embedding may be held twice)."""
        ends = self.end_bytes(True, stages == 1) + (self.end_bytes(False, True) if stages > 1 else 0)
        return sum(self.layer_bytes) + ends


def safetensors_sizes(path: Path) -> dict[str, int]:
    """Tensor name -> bytes, from the file's header only."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta.get("data_offsets", (0, 0))
        out[name] = end - start if end > start else tensor_bytes(meta["dtype"], meta["shape"])
    return out


def footprint_from_sizes(
    sizes: dict[str, int], num_layers: int, *, mtp: bool, tied: bool, draft_share: float = 0.0
) -> ModelFootprint:
    """Sizes under checkpoint names (any layout mtpipe loads) -> a footprint. `draft_share`: the share of
    the projection's rows (lm_head, or the embedding when tied) the draft vocabulary copies."""
    from ...models.loading import canonical_name

    layers = [0] * num_layers
    embed = head = mtp_bytes = lm_head = 0
    for key, size in sizes.items():
        name = canonical_name(key)
        if name is None:
            continue
        m = re.match(r"layers\.(\d+)\.", name)
        if m and int(m.group(1)) < num_layers:
            layers[int(m.group(1))] += size
        elif name.startswith("embed_tokens."):
            embed += size
        elif name.startswith("mtp."):
            mtp_bytes += size
        elif name.startswith("norm.") or (name.startswith("lm_head.") and not tied):
            head += size
            lm_head += size if name.startswith("lm_head.") else 0
    speculating = mtp and mtp_bytes > 0
    draft = round((embed if tied else lm_head) * draft_share) if speculating else 0
    return ModelFootprint(tuple(layers), embed, head, mtp_bytes if mtp else 0, tied or speculating, draft)


def model_footprint(model_path: Path | str, *, mtp: bool = True) -> ModelFootprint:
    """Read the checkpoint's safetensors headers (no tensor data) and its config; sizes as stored. The
    draft vocabulary is counted at its default size (a node told another size holds more or less)."""
    from ...models.config import load_config
    from ...models.draft_vocab import default_size

    path = Path(model_path)
    config = load_config(path)
    sizes: dict[str, int] = {}
    for f in sorted(path.glob("*.safetensors")):
        sizes.update(safetensors_sizes(f))
    if not sizes:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    vocab = config.args.vocab_size
    return footprint_from_sizes(sizes, config.num_layers, mtp=mtp and config.mtp_layers > 0,
                                tied=config.args.tie_word_embeddings, draft_share=default_size(vocab) / vocab)


# -- nodes and links ----------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeResources:
    node_id: str
    available: int  # bytes this node offers for weights
    interfaces: tuple[Interface, ...] = ()
    port: int = 0
    addresses: tuple[str, ...] = ()  # where it was seen (zeroconf A records, or a static host)


def _same_link(a: Interface, ai, b: Interface, bi) -> LinkType | None:
    """The link type over which address ai (of a) reaches address bi (of b), None if they share no subnet."""
    if ai.version != bi.version:
        return None
    if a.link is LinkType.LOOPBACK or b.link is LinkType.LOOPBACK:
        # Only nodes on one host share a loopback; both must advertise it.
        return LinkType.LOOPBACK if a.link is b.link and ai.ip.is_loopback and bi.ip.is_loopback else None
    if is_link_local(ai) or is_link_local(bi):
        # Every link-local interface is "on" 169.254/16 or fe80::/64: only a link of the same kind counts.
        return a.link if is_link_local(ai) and is_link_local(bi) and a.link is b.link else None
    if bi.ip in ai.network or ai.ip in bi.network:
        return a.link if LINK_RANK[a.link] <= LINK_RANK[b.link] else b.link
    return None


@dataclass(frozen=True)
class HopCandidate:
    host: str  # an IP, scoped ('fe80::1%en0') when link-local IPv6
    port: int
    link: LinkType | None  # None: not on a subnet the source shares (a fallback)
    source_interface: str | None = None

    @property
    def target(self) -> str:
        return format_host_port(self.host, self.port)


def hop_candidates(src: Sequence[Interface] | None, dst: NodeResources) -> list[HopCandidate]:
    """Addresses of `dst` that `src` (its interfaces; None = unknown) can use, best first, no duplicates."""
    ranked: list[tuple[tuple, HopCandidate]] = []
    for d in dst.interfaces:
        for dn in d.networks():
            for s in src or ():
                for sn in s.networks():
                    link = _same_link(s, sn, d, dn)
                    if link is None:
                        continue
                    host = str(dn.ip)
                    if dn.version == 6 and dn.ip.is_link_local:
                        host = f"{host}%{s.name}"  # the scope is the interface of the machine that connects
                    key = (-LINK_RANK[link], dn.version, is_link_local(dn), host)
                    ranked.append((key, HopCandidate(host, dst.port, link, s.name)))
    out: list[HopCandidate] = []
    seen: set[str] = set()
    for _, c in sorted(ranked, key=lambda kc: kc[0]):
        if c.host not in seen:
            seen.add(c.host)
            out.append(c)
    known = {strip_scope(c.host)[0] for c in out}
    for addr in dst.addresses:  # where it was seen: the last resort when no subnet is shared
        if strip_scope(addr)[0] not in known:
            known.add(strip_scope(addr)[0])
            out.append(HopCandidate(addr, dst.port, None))
    return out


def best_link(a: Sequence[Interface], b: NodeResources) -> LinkType | None:
    candidates = hop_candidates(a, b)
    return candidates[0].link if candidates else None


def _hop_score(a: NodeResources, b: NodeResources) -> int:
    link = best_link(a.interfaces, b)
    return -1 if link is None else LINK_RANK[link]


def order_nodes(nodes: Sequence[NodeResources], first: str | None = None) -> list[NodeResources]:
    """Stage order maximizing the links between consecutive stages, the ring back to the first included.

    `first` (the coordinator, which feeds the first stage and hears from the last) starts the ring;
    ties go to the order of node ids, so every node computes the same answer.
    """
    nodes = sorted(nodes, key=lambda n: n.node_id)
    if len(nodes) <= 2:
        head = [n for n in nodes if n.node_id == first]
        return head + [n for n in nodes if n.node_id != first]
    start = next((n for n in nodes if n.node_id == first), nodes[0])
    rest = [n for n in nodes if n is not start]
    score = {(a.node_id, b.node_id): _hop_score(a, b) for a in nodes for b in nodes if a is not b}

    def rank(order: Sequence[NodeResources]) -> tuple:
        hops = [score[(x.node_id, y.node_id)] for x, y in zip(order, list(order[1:]) + [order[0]])]
        return (-sum(hops), -min(hops), [n.node_id for n in order])  # best total, no weak hop, then ids

    if len(rest) <= 7:
        return min(([start, *p] for p in itertools.permutations(rest)), key=rank)
    order = [start]  # greedy nearest neighbour for big clusters
    while rest:
        nxt = min(rest, key=lambda n: (-score[(order[-1].node_id, n.node_id)], n.node_id))
        order.append(nxt)
        rest.remove(nxt)
    return order


# -- layers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StagePlan:
    node_id: str
    start: int
    end: int
    bytes: int
    available: int

    @property
    def layers(self) -> int:
        return self.end - self.start


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def largest_remainder(shares: Sequence[float], total: int) -> list[int]:
    """Integers summing to `total`, proportional to `shares` (Hamilton's method)."""
    s = sum(shares)
    if total == 0:
        return [0] * len(shares)
    if s <= 0:
        raise ValueError("no positive share")
    exact = [total * x / s for x in shares]
    counts = [math.floor(e) for e in exact]
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def plan_layers(
    footprint: ModelFootprint,
    nodes: Sequence[NodeResources],
    overrides: dict[str, int] | None = None,
) -> list[StagePlan]:
    """Contiguous layer ranges over `nodes` in this order; see the module docstring."""
    overrides = dict(overrides or {})
    L = footprint.num_layers
    nodes = list(nodes)
    if not nodes:
        raise PlacementError("no nodes to place the model on")
    unknown = sorted(set(overrides) - {n.node_id for n in nodes})
    if unknown:
        raise PlacementError(f"placement override names node {unknown[0]}, which is not in the cluster")
    needed = footprint.total_bytes(len(nodes))
    have = sum(max(n.available, 0) for n in nodes)
    if needed > have:
        raise PlacementError(
            f"model needs {_gib(needed)} GiB, cluster has {_gib(have)} GiB available: {_gib(needed - have)} GiB short"
        )
    if len(nodes) > L:
        raise PlacementError(f"{len(nodes)} nodes but the model has only {L} layers; use at most {L} nodes")
    fixed = sum(overrides.values())
    free = [n for n in nodes if n.node_id not in overrides]
    if fixed > L or (not free and fixed != L) or (free and L - fixed < len(free)):
        raise PlacementError(
            f"placement overrides give {fixed} of {L} layers, leaving {L - fixed} for {len(free)} other node(s)"
        )

    counts = _proportional_counts(footprint, nodes, overrides, L - fixed)
    bounds = list(itertools.accumulate([0] + counts))
    _repair(footprint, nodes, bounds, frozen={i for i, n in enumerate(nodes) if n.node_id in overrides})
    if any(footprint.stage_bytes(a, b) > n.available for n, a, b in zip(nodes, bounds, bounds[1:])):
        bounds = _fit(footprint, nodes, overrides) or bounds  # (none fits: the error below names a stage)
    plan = [
        StagePlan(n.node_id, a, b, footprint.stage_bytes(a, b), n.available)
        for n, a, b in zip(nodes, bounds, bounds[1:])
    ]
    for s in plan:
        if s.bytes > s.available:
            raise PlacementError(
                f"node {s.node_id} would hold layers {s.start}-{s.end - 1} ({_gib(s.bytes)} GiB) but has "
                f"{_gib(s.available)} GiB available: {_gib(s.bytes - s.available)} GiB short"
            )
    return plan


def _proportional_counts(
    footprint: ModelFootprint, nodes: list[NodeResources], overrides: dict[str, int], layers: int
) -> list[int]:
    """Every free node filled to the same fraction of its memory: its share of all the bytes, minus its fixed cost."""
    n = len(nodes)
    free = [i for i, node in enumerate(nodes) if node.node_id not in overrides]
    per_layer = sum(footprint.layer_bytes) / footprint.num_layers
    counts = [overrides.get(node.node_id, 0) for node in nodes]
    if not free:
        return counts
    end = [footprint.end_bytes(i == 0, i == n - 1) for i in range(n)]
    free_bytes = layers * per_layer + sum(end[i] for i in free)
    mem = sum(max(nodes[i].available, 0) for i in free)
    shares = [max(free_bytes * max(nodes[i].available, 0) / mem - end[i], 0.0) for i in free] if mem else []
    counts_free = largest_remainder(shares if sum(shares) > 0 else [1.0] * len(free), layers)
    for k in range(len(free)):  # every stage holds at least one layer: take it from the largest
        if counts_free[k] == 0:
            counts_free[max(range(len(free)), key=lambda j: (counts_free[j], -j))] -= 1
            counts_free[k] = 1
    for i, c in zip(free, counts_free):
        counts[i] = c
    return counts


def _repair(footprint: ModelFootprint, nodes: list[NodeResources], bounds: list[int], frozen: set[int]) -> None:
    """Rounding can leave a stage a layer over its memory: move boundary layers to neighbours with room."""
    n = len(nodes)

    def over(i: int) -> int:
        return footprint.stage_bytes(bounds[i], bounds[i + 1]) - nodes[i].available

    for _ in range(footprint.num_layers * n):
        worst = max(range(n), key=over)
        if over(worst) <= 0 or worst in frozen or bounds[worst + 1] - bounds[worst] <= 1:
            return
        moved = False
        for j in sorted((worst - 1, worst + 1), key=lambda j: over(j) if 0 <= j < n else 0):
            if not 0 <= j < n or j in frozen:
                continue
            old = list(bounds)
            if j < worst:
                bounds[worst] += 1  # worst's first layer goes to the previous stage
            else:
                bounds[worst + 1] -= 1  # worst's last layer goes to the next stage
            if over(j) <= 0:
                moved = True
                break
            bounds[:] = old
        if not moved:
            return


def _fit(footprint: ModelFootprint, nodes: list[NodeResources], overrides: dict[str, int]) -> list[int] | None:
    """Bounds under which every stage fits its node, filling the fullest node least (contiguous ranges
    in node order, at least a layer each, overrides kept), or None when none fit: for a tight cluster
    where rounding and moves to neighbours leave a stage over."""
    L, n = footprint.num_layers, len(nodes)
    prefix = [0, *itertools.accumulate(footprint.layer_bytes)]

    def fill(i: int, a: int, b: int) -> float:
        used = prefix[b] - prefix[a] + footprint.end_bytes(a == 0, b == L)
        return used / nodes[i].available if 0 < nodes[i].available and used <= nodes[i].available else math.inf

    best = [[math.inf] * (L + 1) for _ in range(n + 1)]  # best[i][k]: nodes before i hold layers before k
    back = [[0] * (L + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for i in range(n):
        last = L - (n - i - 1)  # the nodes after this one need a layer each
        for a in range(i, last):
            if best[i][a] == math.inf:
                continue
            fixed = overrides.get(nodes[i].node_id)
            for b in [a + fixed] if fixed else range(a + 1, last + 1):
                if b > last:  # (an override that leaves the nodes after it no layer)
                    continue
                f = max(best[i][a], fill(i, a, b))
                if f < best[i + 1][b]:
                    best[i + 1][b], back[i + 1][b] = f, a
    if best[n][L] == math.inf:
        return None
    bounds = [L]
    for i in range(n, 0, -1):
        bounds.append(back[i][bounds[-1]])
    return bounds[::-1]


def describe_plan(plan: Sequence[StagePlan]) -> str:
    return ", ".join(f"{s.node_id}: layers {s.start}-{s.end - 1} ({_gib(s.bytes)} GiB)" for s in plan)
