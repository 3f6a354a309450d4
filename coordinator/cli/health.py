"""`mtpipe health`: each node's health as a table or JSON, found by zeroconf or as given (cluster/health.py)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ...node.links import format_host_port, local_interfaces, split_host_port
from ..cluster.agent import ClusterAgent, discovery_addresses
from ..cluster.config import ClusterConfig
from ..cluster.health import EXIT_CHECK_FAILED
from ..cluster.membership import Membership
from .cluster_args import add_cluster_args, resolve_config
from .common import json_usage_errors, positive_seconds


def add_health_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("health", help="health of each node: a table, or --json; exit 0 healthy or idle (no shard "
                                      "placed yet), 1 degraded, 2 unreachable, 3 could not check")
    add_cluster_args(p)
    p.add_argument("nodes", nargs="*", metavar="NODE", help="host[:port] of a node (default: find them by zeroconf)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=positive_seconds, default=5.0, help="seconds to wait for each node")
    p.add_argument("--wait", type=positive_seconds, default=3.0, help="seconds to browse for nodes (without NODE)")
    p.set_defaults(func=cmd_health)
    # A mistyped health command is a check that could not run, never a cluster found unreachable (2,
    # argparse's own code for usage errors).
    json_usage_errors(p, EXIT_CHECK_FAILED, status="error")


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 / 1 / 2 for a healthy or idle / degraded / unreachable cluster, and EXIT_CHECK_FAILED (with a JSON
    status "error") when the check itself could not run, so a monitor never reads a failure as degraded."""
    try:
        return _health(args)
    except Exception as e:  # noqa: BLE001 - a bad config, a missing secret file, no interface to browse on
        why = str(e) if isinstance(e, (ValueError, FileNotFoundError)) else f"{type(e).__name__}: {e}"
        if args.json:
            print(json.dumps({"status": "error", "error": why}))
        print(f"mtpipe: error: {why}", file=sys.stderr)
        return EXIT_CHECK_FAILED


def _health(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..cluster.health import (
        EXIT_CODES,
        distinct_nodes,
        mark_coordinators,
        mark_spares,
        missing_layers,
        missing_members,
        name_placed,
        overall,
        probe_nodes,
        render_table,
    )

    cfg = resolve_config(args)
    secret = cfg.resolve_secret()
    targets = [format_host_port(*split_host_port(n, cfg.node.port)) for n in args.nodes]
    left_out: dict[str, str] = {}
    browsed = not targets
    if browsed and not cfg.discovery.enabled and not cfg.nodes:
        raise ValueError("nothing to check: give NODE addresses, list nodes in cluster.yaml, or enable discovery")
    ids: dict[str, str] = {}
    if browsed:
        targets, left_out, ids = browse_targets(cfg, secret, args.wait, args.timeout)
    rows = probe_nodes(targets, secret, timeout=args.timeout)
    for row in rows:  # (a member that stopped answering since it proved itself: named all the same)
        if "node_id" not in row and row["address"] in ids:
            row["node_id"] = ids[row["address"]]
    if browsed:  # (a node listed twice on the command line is shown twice, as asked; only those)
        rows = distinct_nodes(name_placed(rows))
        rows += missing_members(rows, set(left_out))
        rows += missing_layers(rows)
    rows = mark_coordinators(mark_spares(rows))
    status = overall(rows)
    if left_out and status in ("healthy", "idle"):  # something advertises the cluster and did not prove it belongs
        status = "degraded"
    if args.json:
        print(json.dumps({"status": status, "nodes": rows, "left_out": left_out}))
    else:
        if rows:
            console = Console()
            render_table(rows, console if console.is_terminal else Console(width=200), status)
        for node_id, why in sorted(left_out.items()):
            print(f"mtpipe: node {node_id} advertises this cluster but {why}: left out", file=sys.stderr)
        if not rows:
            print("mtpipe: no nodes found" + (" that prove they belong" if left_out else "")
                  + (" (is the secret right?)" if left_out and secret else ""), file=sys.stderr)
    return EXIT_CODES[status]


async def _browse(discovery: Any, wait: float) -> None:
    """Up to `wait` seconds for a first node, then until none joined or left for a second (within `wait`)."""
    start = time.monotonic()
    if await discovery.wait_count(1, wait):
        await discovery.settle(min(1.0, wait), max(0.0, wait - (time.monotonic() - start)))


def browse_targets(cfg: ClusterConfig, secret: str | None, wait: float,
                   timeout: float = 1.0) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """The cluster's nodes by zeroconf on the discovery interfaces, each at the address where it proved
    it belongs (membership.py), then the static ones; the advertised nodes left out, with why; and the
    discovered members' ids by address."""
    if not cfg.discovery.enabled:  # static nodes only: nothing to browse
        return [n.address for n in cfg.nodes], {}, {}
    interfaces = local_interfaces()
    agent = ClusterAgent(discovery_addresses(cfg.discovery.interfaces, interfaces), None, cfg.name).start()
    try:
        agent.run(_browse(agent.discovery, wait))
        peers = agent.peers()
    finally:
        agent.stop()
    membership = Membership("", interfaces, secret, timeout=timeout)
    members = membership.members(peers)
    targets = [membership.address(ad) or "" for _, ad in sorted(members.items())]
    ids = {target: node_id for target, node_id in zip(targets, sorted(members)) if target}
    unsure = "" if secret else "; no cluster secret was given ($MTPIPE_SECRET, --secret-file, cluster.yaml)"
    left_out = {node_id: f"{reason} ({', '.join(peers[node_id].addresses) or '?'}){unsure}"
                for node_id, reason in membership.report(peers)[1].items()}
    return targets + [n.address for n in cfg.nodes], left_out, ids
