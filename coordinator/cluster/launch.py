"""`mtpipe launch` and `mtpipe health`: forming a cluster and looking at it.

`mtpipe launch` is the same command on every machine (exo-style). Each one starts a node server,
advertises it over zeroconf and browses for the nodes of its cluster. One of them coordinates:
the one started with `--coordinator`, else one that already says it coordinates, else the lowest
node id once `--expect` nodes are seen or discovery settles. The coordinator places the model
(placement.py), has the nodes load their shards in parallel, confirms each hop's address with a
measured round trip (formation.py), and serves the REST API. Alone, it runs the whole model locally.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ...node.advertise import Advertiser, NodeAdvert, cluster_hash, open_zeroconf
from ...node.links import (
    Interface,
    LinkType,
    format_host_port,
    local_interfaces,
    split_host_port,
    strip_scope,
)
from .config import ClusterConfig, StaticNode, load_cluster_config, validate
from .discovery import Discovery, elect_coordinator
from .formation import cluster_info_fn, form_cluster, resources_from_advert, single_node_engine
from .placement import GiB, hop_candidates

log = logging.getLogger(__name__)

CONFIG_ENV = "MTPIPE_CONFIG"
_DEFAULT_DISCOVERY = ((LinkType.ETHERNET, LinkType.WIFI), (LinkType.THUNDERBOLT,))  # the first kinds present


# -- configuration ------------------------------------------------------------------------------


def resolve_config(args: argparse.Namespace) -> ClusterConfig:
    """cluster.yaml (--config, $MTPIPE_CONFIG, or ./cluster.yaml if present) with flags on top."""
    path = args.config or os.environ.get(CONFIG_ENV) or ("cluster.yaml" if Path("cluster.yaml").exists() else None)
    cfg = load_cluster_config(path) if path else ClusterConfig()
    flags = {
        "name": getattr(args, "cluster", None),
        "model": getattr(args, "model", None),
        "dtype": getattr(args, "dtype", None),
        "mtp_depth": getattr(args, "mtp_depth", None),
    }
    cfg = replace(cfg, **{k: v for k, v in flags.items() if v is not None})
    if getattr(args, "secret_env", None):
        cfg.secret, cfg.secret_env = None, args.secret_env
    if getattr(args, "interface", None):
        cfg.discovery.interfaces = list(args.interface)
    if getattr(args, "node", None):
        cfg.nodes = [StaticNode(*split_host_port(n, cfg.node.port)) for n in args.node]
    for attr, section, key in (
        ("expect", cfg.discovery, "expect"), ("settle", cfg.discovery, "settle"),
        ("port", cfg.node, "port"), ("host", cfg.node, "host"), ("state_dir", cfg.node, "state_dir"),
        ("max_memory", cfg.node, "max_memory_gib"), ("api_host", cfg.api, "host"), ("api_port", cfg.api, "port"),
        ("api_key", cfg.api, "api_key"),
    ):
        value = getattr(args, attr, None)
        if value is not None:
            setattr(section, key, value)
    return validate(cfg)


def discovery_addresses(wanted: list[str], interfaces: list[Interface]) -> list[str]:
    """Addresses to bind zeroconf to: each entry an address, or an interface name (its IPv4 addresses).

    With none given: the IPv4 addresses of this machine's Ethernet and Wi-Fi interfaces, or of its
    Thunderbolt ones when it has neither (multicast can loop around a ring of Macs on one Thunderbolt
    Bridge; Thunderbolt addresses are advertised for hops all the same). Never 'all interfaces'.
    """
    by_name = {i.name: i for i in interfaces}
    out: list[str] = []
    for entry in wanted:
        if entry in by_name:
            v4 = [str(n.ip) for n in by_name[entry].networks() if n.version == 4]
            if not v4:
                raise ValueError(f"interface {entry} has no IPv4 address to discover peers on")
            out += v4
        else:
            try:
                ipaddress.ip_address(strip_scope(entry)[0])
            except ValueError:
                raise ValueError(f"--interface {entry}: neither an address nor an interface of this machine") from None
            out.append(entry)
    for links in ([] if wanted else _DEFAULT_DISCOVERY):
        out = [str(n.ip) for i in interfaces if i.link in links for n in i.networks() if n.version == 4]
        if out:
            break
    if not out:
        raise ValueError("no network interface to discover peers on; name one with --interface")
    return list(dict.fromkeys(out))


def advertised_interfaces(interfaces: list[Interface], bind: list[str]) -> tuple[Interface, ...]:
    """What peers may use to reach this node: every interface but loopback (unless discovery runs on it)."""
    on_loopback = any(ipaddress.ip_address(strip_scope(a)[0]).is_loopback for a in bind)
    return tuple(i for i in interfaces if i.link is not LinkType.LOOPBACK or on_loopback)


# -- advertisement and discovery on a loop of their own ------------------------------------------


class ClusterAgent:
    """Zeroconf advertisement and browsing on a private event loop (uvicorn owns the main thread's)."""

    def __init__(self, bind: list[str], advert: NodeAdvert | None, cluster: str,
                 on_change: Callable[[str, NodeAdvert], None] | None = None,
                 memory_offered: Callable[[], int] | None = None):
        self.bind = bind
        self.advert = advert
        self.memory_offered = memory_offered
        self._refresh: asyncio.Task | None = None
        self.hash = cluster_hash(cluster)
        self.on_change = on_change
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="zeroconf", daemon=True)
        self.azc = self.advertiser = self.discovery = None

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> ClusterAgent:
        self.thread.start()
        self.run(self._start(), timeout=30)
        return self

    async def _start(self) -> None:
        self.azc = open_zeroconf(self.bind)
        self.discovery = Discovery(self.azc, self.hash, on_change=self.on_change)
        await self.discovery.start()
        if self.advert is not None:
            self.advertiser = Advertiser(self.azc, self.advert, self.bind)
            await self.advertiser.start()
            if self.memory_offered is not None:
                self._refresh = asyncio.get_running_loop().create_task(
                    self.advertiser.keep_memory_current(self.memory_offered))

    def peers(self) -> dict[str, NodeAdvert]:
        return self.run(self._snapshot())

    async def _snapshot(self) -> dict[str, NodeAdvert]:
        return dict(self.discovery.peers)

    def set_coordinator(self) -> None:
        if self.advertiser is not None:
            self.run(self.advertiser.update(coordinator=True), timeout=10)

    def stop(self) -> None:
        if not self.thread.is_alive():
            return
        try:
            self.run(self._stop(), timeout=10)
        except Exception as e:  # shutting down: say so, never hang
            log.debug("zeroconf shutdown: %s", e)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def _stop(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
        if self.advertiser is not None:
            await self.advertiser.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        if self.azc is not None:
            await self.azc.async_close()


def offered_memory(available: int, max_memory_gib: float | None) -> int:
    """What this node offers a placement: the memory available, capped by `node.max_memory_gib`."""
    return available if max_memory_gib is None else min(available, int(max_memory_gib * GiB))


def wait_for_peers(agent: ClusterAgent, me: str, cfg: ClusterConfig, forced: bool) -> dict[str, NodeAdvert]:
    """With `expect`: wait for that many nodes (or, unless coordinating, for a coordinator), at most
    `settle` seconds. Without: wait until nothing joined or left for `settle` seconds."""
    expect, settle = cfg.discovery.expect, cfg.discovery.settle
    d = agent.discovery
    if expect is not None:
        def enough(peers: dict[str, NodeAdvert]) -> bool:
            return len(peers) >= expect or (not forced and any(a.coordinator and a.node_id != me for a in peers.values()))

        agent.run(d.wait_for(enough, settle))
    else:
        agent.run(d.settle(settle, settle * 6))
    peers = agent.peers()
    if expect is not None and len(peers) < expect:
        log.warning("found %d of %d expected node(s) after %.0f s; going on with them", len(peers), expect, settle)
    return peers


# -- the commands -------------------------------------------------------------------------------


def _emit(args: argparse.Namespace, console: Any, event: str, message: str, **fields: Any) -> None:
    """A readiness event: one JSON line on stdout with --json, else a line on the console."""
    if args.json:
        print(json.dumps({"event": event, **fields}), flush=True)
    else:
        console.print(message)


def _self_target(host: str, port: int) -> str:
    """How this process reaches its own node server."""
    return format_host_port("127.0.0.1" if host in ("0.0.0.0", "::", "") else host, port)


def when_listening(host: str, port: int, callback: Callable[[], None], timeout: float = 120.0) -> None:
    """Call `callback` once something accepts connections on host:port (the API server has started)."""
    target = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    idle = threading.Event()  # never set: a wait between connection attempts

    def watch() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection((target, port), timeout=1.0).close()
            except OSError:
                idle.wait(0.05)
                continue
            callback()
            return
        log.warning("the API did not start listening on %s:%d within %.0f s", host, port, timeout)

    threading.Thread(target=watch, name="api-ready", daemon=True).start()


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(0)  # unwinds through cmd_launch's cleanup: peers see this node leave


def cmd_launch(args: argparse.Namespace) -> int:
    from ... import __version__
    from ...models.registry import resolve_model
    from ...node import sysinfo
    from ...node import stage  # noqa: F401  (MLX and mlx-lm now, not on the first shard load)
    from ...node.identity import node_id as persistent_id
    from ...node.server import NodeServer
    from ..api.serve import model_name_for, serve
    from ..cli.main import _stderr_console

    console = _stderr_console()
    signal.signal(signal.SIGTERM, _terminate)
    cfg = resolve_config(args)
    secret = cfg.resolve_secret()
    if not secret:
        log.warning("no cluster secret (cluster.yaml secret/secret_env or $MTPIPE_SECRET): anyone who reaches "
                    "the node port can drive this node")
    me = persistent_id(cfg.node.state_dir)
    mtp = not args.no_mtp
    model_path = resolve_model(cfg.model)
    interfaces = local_interfaces()
    bind = discovery_addresses(cfg.discovery.interfaces, interfaces) if cfg.discovery.enabled else []
    mem = sysinfo.memory()
    offered = offered_memory(mem.available, cfg.node.max_memory_gib)
    server = NodeServer(cfg.node.host, cfg.node.port, node_id=me, secret=secret).start()

    def memory_offered() -> int:
        # Its own shard counts as free: a new placement would replace it.
        stage = server.service.worker
        held = stage.shard.model.parameter_bytes() if stage is not None else 0
        return offered_memory(sysinfo.memory().available + held, cfg.node.max_memory_gib)

    my_target = _self_target(cfg.node.host, server.port)
    advert = NodeAdvert(me, cluster_hash(cfg.name), server.port, mem.total, offered, sysinfo.chip(), __version__,
                        advertised_interfaces(interfaces, bind), coordinator=args.coordinator)
    placed: set[str] = set()

    def on_change(kind: str, ad: NodeAdvert) -> None:
        if ad.node_id == me:
            return
        if placed and kind == "join" and ad.node_id not in placed:
            log.warning("node %s joined after placement; restart the coordinator to use it", ad.node_id)
        elif placed and kind == "leave" and ad.node_id in placed:
            log.warning("node %s of the pipeline left; requests will fail until it is back", ad.node_id)

    agent = ClusterAgent(bind, advert, cfg.name, on_change=on_change, memory_offered=memory_offered) if bind else None
    engine = None
    try:
        if agent is not None:
            agent.start()
        _emit(args, console, "node", f"[bold]mtpipe[/bold] node {me} on port {server.port}, cluster "
              f"[cyan]{cfg.name}[/cyan], discovery on {', '.join(bind) or 'nothing (static nodes only)'}",
              node_id=me, port=server.port, pid=os.getpid())
        if agent is not None:
            peers = wait_for_peers(agent, me, cfg, args.coordinator)
            peers.setdefault(me, advert)
            coordinator = elect_coordinator(me, peers, forced=args.coordinator)
        else:  # static nodes only: the node started with --coordinator drives the others
            peers = {me: advert}
            coordinator = me if args.coordinator or not cfg.nodes else "the node started with --coordinator"
        if coordinator != me:
            _emit(args, console, "follower", f"node {me}: {coordinator} coordinates; serving shards until stopped",
                  node_id=me, coordinator=coordinator)
            while True:
                signal.pause()  # until SIGTERM or Ctrl-C ends the process through the finally below
        log.info("%s coordinates %d node(s)%s", me, len(peers), f" and {len(cfg.nodes)} static" if cfg.nodes else "")
        if agent is not None:
            agent.set_coordinator()
        pre_norm = getattr(args, "mtp_pre_norm", False)
        if len(peers) == 1 and not cfg.nodes:
            log.info("no peers: running the whole model on this machine")
            engine = single_node_engine(server, model_path, mtp, cfg.dtype, pre_norm)
            formation = None
            placed.add(me)
        else:
            if pre_norm:
                raise ValueError("--mtp-pre-norm applies to local stages, not to a cluster of nodes")
            engine, formation = form_cluster(cfg, me, my_target, peers, interfaces, model_path, mtp, secret, console)
            placed.update(s.node_id for s in formation.plan)
        name = model_name_for(cfg.model, model_path)
        info = cluster_info_fn(cfg, me, my_target, engine, name, formation, agent, secret)
        state = info()
        url = f"http://{format_host_port(cfg.api.host, cfg.api.port)}/v1"
        stages = ", ".join(f"{p['node']} layers {p['layers'][0]}-{p['layers'][1] - 1}" for p in state["placement"])
        when_listening(cfg.api.host, cfg.api.port, lambda: _emit(
            args, console, "serving", f"[bold]mtpipe[/bold] serving [cyan]{name}[/cyan] at {url} over {stages}",
            api=url, **{k: state[k] for k in ("placement", "links", "ring", "discovered", "ignored")}))
        serve(engine, cfg.api.host, cfg.api.port, api_key=cfg.resolve_api_key(), model_name=name,
              cluster_info=info, default_mtp_depth=0 if not mtp else cfg.mtp_depth)
        return 0
    finally:
        if engine is not None:
            engine.pipeline.close()
        if agent is not None:
            agent.stop()
        server.stop()


def cmd_health(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .health import EXIT_CODES, overall, probe_nodes, render_table

    cfg = resolve_config(args)
    secret = cfg.resolve_secret()
    targets = [format_host_port(*split_host_port(n, cfg.node.port)) for n in args.nodes]
    rows = probe_nodes(targets or browse_targets(cfg, args.wait), secret, timeout=args.timeout)
    status = overall(rows)
    if args.json:
        print(json.dumps({"status": status, "nodes": rows}))
    elif rows:
        console = Console()
        render_table(rows, console if console.is_terminal else Console(width=200))
    else:
        print("mtpipe: no nodes found", file=sys.stderr)
    return EXIT_CODES[status]


def browse_targets(cfg: ClusterConfig, wait: float) -> list[str]:
    """The cluster's nodes by zeroconf on the discovery interfaces, each at its best address from here."""
    from .health import first_reachable

    interfaces = local_interfaces()
    agent = ClusterAgent(discovery_addresses(cfg.discovery.interfaces, interfaces), None, cfg.name).start()
    try:
        agent.run(agent.discovery.settle(min(1.0, wait), wait))
        peers = agent.peers()
    finally:
        agent.stop()
    targets = []
    for ad in sorted(peers.values(), key=lambda a: a.node_id):
        candidates = [c.target for c in hop_candidates(interfaces, resources_from_advert(ad, 0))]
        reached = first_reachable(candidates, cfg.resolve_secret(), ad.node_id, timeout=1.0)
        targets.append(reached.target if reached else candidates[0])
    targets += [n.address for n in cfg.nodes]
    return targets


def add_launch_commands(sub: argparse._SubParsersAction) -> None:
    from ..cli.main import _add_mtp

    p = sub.add_parser("launch", help="run this machine as a node of a cluster (the same command on every machine)")
    _add_common(p)
    p.add_argument("--model", help="model directory or hub repo (default: cluster.yaml's, else the demo model)")
    p.add_argument("--coordinator", action="store_true", help="coordinate: place the model and serve the API")
    p.add_argument("--expect", type=int, help="nodes to wait for, this one included")
    p.add_argument("--settle", type=float, help="seconds: the most to wait for --expect nodes, else the quiet time "
                                                 "after the last join (default 5)")
    p.add_argument("--node", action="append", help="a static node host[:port] (networks without multicast)")
    p.add_argument("--host", help="address the node server listens on (default 0.0.0.0)")
    p.add_argument("--port", type=int, help="node server port (default 52700)")
    p.add_argument("--state-dir", help="where the node id is kept (default $MTPIPE_STATE_DIR or ~/.mtpipe)")
    p.add_argument("--max-memory", type=float, help="offer at most this many GiB to the cluster")
    p.add_argument("--api-host", help="API address on the coordinator (default 127.0.0.1)")
    p.add_argument("--api-port", type=int, help="API port on the coordinator (default 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $MTPIPE_API_KEY)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="cast weights on load")
    p.add_argument("--json", action="store_true", help="print readiness events as JSON lines on stdout")
    _add_mtp(p)
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("health", help="health of each node: a table, or --json; exit 0 healthy, 1 degraded, "
                                      "2 unreachable")
    _add_common(p)
    p.add_argument("nodes", nargs="*", metavar="NODE", help="host[:port] of a node (default: find them by zeroconf)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each node")
    p.add_argument("--wait", type=float, default=3.0, help="seconds to browse for nodes (without NODE)")
    p.set_defaults(func=cmd_health)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help=f"cluster.yaml (default: ${CONFIG_ENV}, else ./cluster.yaml if present)")
    p.add_argument("--cluster", help="cluster name (overrides cluster.yaml)")
    p.add_argument("--secret-env", help="environment variable holding the cluster secret (default MTPIPE_SECRET)")
    p.add_argument("--interface", action="append",
                   help="discover on this interface name or address (repeatable; default: Ethernet and Wi-Fi, "
                        "else Thunderbolt)")
