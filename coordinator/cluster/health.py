"""Node health over gRPC: probing one node, reaching a node at the best of several addresses,
classifying what came back, and the `mtpipe health` table.

A node is healthy when it answers, holds a shard, reports no error and reaches its next stage;
idle when it answers with no error and holds no shard (it waits for a coordinator to place one);
degraded when it answers but something else fails; unreachable when it does not answer (or refuses
the cluster secret). The cluster is idle when every node is: a node without a shard beside nodes
that hold one makes it degraded, unless a coordinator among them placed the model without it (a
spare; one that holds a shard from an earlier placement, as a node that hung and came back does until
its coordinator has it unloaded, is shown idle too). With no coordinator among them, the layers no node
holds are listed, unreachable. Exit codes follow: 0 healthy or idle, 1 degraded, 2 unreachable.
Whether a model is served is the API's GET /health.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

HEALTHY, IDLE, DEGRADED, UNREACHABLE = "healthy", "idle", "degraded", "unreachable"
EXIT_CODES = {HEALTHY: 0, IDLE: 0, DEGRADED: 1, UNREACHABLE: 2}
EXIT_CHECK_FAILED = 3  # `mtpipe health` could not check at all (a bad config, a missing secret file)


@dataclass(frozen=True)
class Reached:
    target: str
    node_id: str
    rtt_ms: float
    coordinator: bool = False  # what the node says over the authenticated channel
    term: int = 0  # the newest coordinator's term it has seen (node/coordinators.py), and that coordinator
    term_holder: str = ""


def ping(target: str, secret: str | None, timeout: float = 2.0) -> Reached:
    """Two Pings (the first opens the connection); the round trip of the second. Raises grpc.RpcError."""
    from ...node.wire import make_channel
    from ...proto import mtpipe_pb2 as pb
    from ...proto import mtpipe_pb2_grpc as pb_grpc

    with make_channel(target, secret) as channel:
        stub = pb_grpc.NodeStub(channel)
        stub.Ping(pb.PingRequest(), timeout=timeout)
        t0 = time.perf_counter()
        reply = stub.Ping(pb.PingRequest(), timeout=timeout)
        return Reached(target, reply.node_id, 1000.0 * (time.perf_counter() - t0), reply.coordinator, reply.term,
                       reply.term_holder)


def first_reachable(
    targets: Sequence[str], secret: str | None, node_id: str | None = None, timeout: float = 2.0
) -> Reached | None:
    """The first target (best first) that answers as node `node_id` (any node if None)."""
    import grpc

    for target in targets:
        try:
            reached = ping(target, secret, timeout)
        except grpc.RpcError as e:
            log.debug("%s does not answer: %s", target, e.code().name)
            continue
        if node_id is None or reached.node_id == node_id:
            return reached
        log.warning("%s answers as node %s, not %s; skipped", target, reached.node_id, node_id)
    return None


def _problems(h: Any, probe_next: bool) -> list[str]:
    problems = []
    if h.last_error:
        problems.append(f"error: {h.last_error}")
    if h.loaded and not h.is_last and not h.next:
        problems.append("knows no next stage")
    if h.next and h.next_rtt_ms < 0 and probe_next:
        problems.append(f"next stage {h.next} unreachable")
    return problems


def probe_node(target: str, secret: str | None, timeout: float = 3.0, probe_next: bool = True) -> dict[str, Any]:
    """Health of one node as a plain dict (see `mtpipe health --json`); probe_next measures its next hop."""
    import grpc

    from ...node.wire import describe_unreached, make_channel
    from ...proto import mtpipe_pb2 as pb
    from ...proto import mtpipe_pb2_grpc as pb_grpc

    row: dict[str, Any] = {"address": target}
    try:
        with make_channel(target, secret) as channel:
            stub = pb_grpc.NodeStub(channel)
            t0 = time.perf_counter()
            h = stub.Health(pb.HealthRequest(probe_next=probe_next), timeout=timeout)
            row["rtt_ms"] = round(1000.0 * (time.perf_counter() - t0), 3)
    except grpc.RpcError as e:
        row.update(status=UNREACHABLE, reachable=False, problems=[describe_unreached(target, secret, e)])
        return row
    problems = _problems(h, probe_next)
    row.update(
        status=DEGRADED if problems else HEALTHY if h.loaded else IDLE,
        reachable=True,
        problems=problems,
        node_id=h.node_id,
        version=h.version,
        model=h.model_path or None,
        layers=[h.start, h.end] if h.loaded else None,
        num_layers=h.num_layers if h.loaded else None,
        memory_used=h.memory_used,
        memory_available=h.memory_available,
        active_sequences=h.active_sequences,
        kept_prefixes=h.kept_prefixes,
        kept_prefix_bytes=h.kept_prefix_bytes,
        tokens_processed=h.tokens_processed,
        mean_step_ms=round(h.mean_step_ms, 3),
        round_fixed_ms=round(h.round_fixed_ms, 3),  # a decode round here: fixed + per row x rows (ring groups)
        round_row_ms=round(h.round_row_ms, 3),
        next=h.next or None,
        next_rtt_ms=round(h.next_rtt_ms, 3) if h.next_rtt_ms >= 0 else None,
        next_transport=h.next_transport or None,  # "tcp" (data plane) or "grpc", once a frame went
        coordinators=h.coordinators,  # subscribed to it now (an idle node none is subscribed to is a spare)
        placed=list(h.placed) or None,  # a coordinating node: the members of its pipeline
        term=h.term or None,  # the newest coordinator's term it has seen, and that coordinator (launch)
        term_holder=h.term_holder or None,
        placed_at=dict(zip(h.placed, h.placed_at)) or None,  # and where it reaches them
        data_port=h.data_port or None,
        ring=h.ring or None,  # last node: where it starts decode rounds
        last_error=h.last_error or None,
        uptime_s=round(h.uptime_s, 1),
        blas={"name": h.blas, "optimized": h.blas_optimized, "threads": h.blas_threads or None} if h.blas else None,
        weights={"fingerprint": h.fingerprint or None, "source": h.weights_source or None,
                 "transfer": {"state": h.transfer_state, "done": h.transfer_done, "total": h.transfer_total}
                 if h.transfer_state else None,
                 "fetched_bytes": h.fetched_bytes, "served_bytes": h.served_bytes},
    )
    return row


def transfer_text(row: dict[str, Any]) -> str:
    """A node's shard transfer in a few words ("" when none is under way)."""
    t = (row.get("weights") or {}).get("transfer")
    if not t or t["state"] not in ("fetching", "verifying"):
        return ""
    pct = 100.0 * t["done"] / max(t["total"], 1)
    return f"{t['state']} {t['done'] / 2**20:.1f}/{t['total'] / 2**20:.1f} MiB ({pct:.0f}%)"


def probe_nodes(targets: Sequence[str], secret: str | None, timeout: float = 3.0) -> list[dict[str, Any]]:
    if not targets:
        return []
    with ThreadPoolExecutor(min(len(targets), 16)) as pool:
        return list(pool.map(lambda t: probe_node(t, secret, timeout), targets))


def distinct_nodes(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per node: a node found twice (discovered, and listed in cluster.yaml) keeps its first."""
    seen: set[str] = set()
    out = []
    for r in rows:
        node_id = r.get("node_id")
        if node_id and node_id in seen:
            continue
        seen.add(node_id or "")
        out.append(r)
    return out


def name_placed(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows`, each unreachable one without an id (a cluster.yaml node that is down) named by the id a
    coordinator among them placed at its address: the node it is, listed once."""
    placed = {address: node_id for r in rows for node_id, address in (r.get("placed_at") or {}).items()}
    return [{**r, "node_id": placed[r["address"]]} if "node_id" not in r and r.get("address") in placed else r
            for r in rows]


def mark_spares(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows`, where a coordinator among them placed the model, with each node it did not place that still
    holds a shard (one that hung and came back after the others took its layers) idle, a spare: its shard
    and links are from an earlier placement and serve nothing."""
    placed = {n for r in rows for n in r.get("placed") or []}
    if not placed:
        return list(rows)
    return [{**r, "status": IDLE, "spare": True, "problems": []}
            if r.get("reachable") and r.get("layers") and r.get("node_id") not in placed else r for r in rows]


def missing_members(rows: Sequence[dict[str, Any]], left_out: Collection[str] = ()) -> list[dict[str, Any]]:
    """A row for each node a coordinator among `rows` placed the model on that is not among them (nor
    left out, listed apart): gone (its advert went with it), so unreachable."""
    found = {r.get("node_id") for r in rows} | set(left_out)
    gone = sorted({n for r in rows for n in r.get("placed") or [] if n not in found})
    where = {n: a for r in rows for n, a in (r.get("placed_at") or {}).items()}  # (where the coordinator reached it)
    return [{"address": where.get(n, "-"), "node_id": n, "status": UNREACHABLE, "reachable": False,
             "problems": ["in the pipeline its coordinator placed, and not found"]} for n in gone]


def missing_layers(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where no coordinator is among `rows` (its placement went with it): a row for each run of a model's
    layers that no node found holds, unreachable. The nodes left may look healthy, each with its shard,
    while the pipeline they were part of cannot run."""
    if any(r.get("placed") for r in rows):
        return []  # (the coordinator names its missing members: `missing_members`)
    models: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for r in rows:
        if r.get("layers") and r.get("num_layers"):
            models.setdefault((r.get("model") or "?", r["num_layers"]), []).append(tuple(r["layers"]))
    out = []
    for (model, n), held in sorted(models.items()):
        at = 0
        for start, end in [*sorted(held), (n, n)]:
            if start > at:
                out.append({"address": "-", "node_id": "-", "status": UNREACHABLE, "reachable": False,
                            "model": model, "layers": [at, start], "num_layers": n,
                            "problems": [f"layers {at}-{start - 1} of {n} are held by no node found (their node and "
                                         "the coordinator that placed them are gone)"]})
            at = max(at, end)
    return out


def mark_coordinators(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows`, where more than one of them coordinates (each placed a model: two clusters where there
    was one, after a partition healed, say), with each of those degraded and saying so: a cluster has one.
    The one of the older term steps down within seconds of reaching the other's members (tenure.py); one
    that stays cannot reach them."""
    coordinating = sorted(f"{r.get('node_id') or r['address']}" + (f" term {r['term']}" if r.get("term") else "")
                          for r in rows if r.get("placed"))
    if len(coordinating) < 2:
        return list(rows)
    why = (f"one of {len(coordinating)} coordinators ({', '.join(coordinating)}): a cluster has one; the older "
           "steps down once it reaches the newer one's nodes (else stop it)")
    return [{**r, "status": DEGRADED, "problems": [*(r.get("problems") or []), why]} if r.get("placed") else r
            for r in rows]


def overall(rows: Sequence[dict[str, Any]]) -> str:
    statuses = {r["status"] for r in rows}
    if not rows or UNREACHABLE in statuses:
        return UNREACHABLE
    if statuses == {IDLE}:
        return IDLE
    # An idle node where others serve is a gap, unless a coordinator among them placed the model
    # without it, or (no placement among them: `serve --nodes`) no coordinator is subscribed to it: a
    # spare (one that came back after the others took its layers, one that joined late).
    placed = {n for r in rows for n in r.get("placed") or []}
    gaps = [r for r in rows if r["status"] == IDLE
            and (r.get("node_id") in placed if placed else bool(r.get("coordinators")))]
    return DEGRADED if DEGRADED in statuses or gaps else HEALTHY


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f}"


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _next_hop(r: dict[str, Any]) -> str:
    """Where the node sends frames: the next stage (rtt, transport) or, on the last node, its ring."""
    if r.get("next"):
        rtt = f" {r['next_rtt_ms']:.2f} ms" if r.get("next_rtt_ms") is not None else ""
        return f"{r['next']}{rtt}" + (f" {r['next_transport']}" if r.get("next_transport") else "")
    return f"ring -> {r['ring']}" if r.get("ring") else "-"


def _blas(b: dict[str, Any] | None) -> str:
    if not b:
        return "-"
    text = b["name"] + (f" x{b['threads']}" if b.get("threads") else "")
    return text if b["optimized"] else f"[yellow]{text} (slow)[/]"


def render_table(rows: Sequence[dict[str, Any]], console: Any, status: str | None = None) -> None:
    """The rows as a table, titled with the cluster's `status` (default: `overall(rows)`)."""
    from rich.table import Table

    colours = {HEALTHY: "green", IDLE: "cyan", DEGRADED: "yellow", UNREACHABLE: "red"}
    table = Table(title=f"mtpipe cluster: {status or overall(rows)}", title_justify="left")
    for col in ("node", "status", "version", "model", "layers", "mem GiB used/avail", "seqs", "tokens", "step ms",
                "blas", "next", "uptime", "problems"):
        table.add_column(col, overflow="fold")
    for r in rows:
        layers, model = r.get("layers"), r.get("model")
        table.add_row(
            f"{r.get('node_id', '?')}\n{r['address']}" + (f"\ncoordinates, term {r['term']}" if r.get("placed") and
                                                         r.get("term") else ""),
            f"[{colours[r['status']]}]{r['status']}[/]",
            r.get("version", "-"),
            (model.rstrip("/").rsplit("/", 1)[-1] if model else "-") + (f"\n{transfer_text(r)}" if transfer_text(r) else ""),
            f"{layers[0]}-{layers[1] - 1} of {r['num_layers']}" if layers else "-",
            f"{_gib(r.get('memory_used'))}/{_gib(r.get('memory_available'))}" if r["reachable"] else "-",
            str(r.get("active_sequences", "-")) + (f"\n{r['kept_prefixes']} kept" if r.get("kept_prefixes") else ""),
            str(r.get("tokens_processed", "-")),
            f"{r['mean_step_ms']:.2f}" if r.get("mean_step_ms") else "-",
            _blas(r.get("blas")),
            _next_hop(r),
            _duration(r.get("uptime_s")),
            "; ".join(r["problems"]) or ("a spare: its shard is from an earlier placement" if r.get("spare") else "-"),
        )
    console.print(table)
