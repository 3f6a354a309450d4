"""`mtpipe node`, `serve`, `launch` and `health` (health.py): the cluster's subcommands.

`mtpipe launch` is the same command on every machine (exo-style). Each one starts a node server,
advertises it over zeroconf and browses for the nodes of its cluster. One of them coordinates:
the one started with `--coordinator`, else one that already says it coordinates, else the lowest
node id once `--expect` nodes are seen or discovery settles. The coordinator places the model,
has the nodes load their shards in parallel, confirms each hop's address with a measured round
trip (cluster/formation.py), and serves the REST API. Alone, it runs the whole model locally.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ...node.advertise import NodeAdvert, cluster_hash
from ...node.cache_cli import add_cache_command
from ...node.cli import add_node_command
from ...node.coordinators import Claim, next_term
from ...node.links import format_host_port, local_interfaces, warn_bridge_loops
from ...node.secrets import add_secret_file, check_exposure
from ..cluster.agent import (
    ClusterAgent,
    advertised_interfaces,
    discovery_addresses,
    offered_memory,
    wait_for_peers,
)
from ..cluster.discovery import elect_coordinator
from ..cluster.formation import (
    Formation,
    check_alone,
    cluster_info_fn,
    form_cluster,
    placed_addresses,
    resources_from_advert,
    single_node_engine,
    static_flags,
    static_nodes,
)
from ..cluster.follow import Watch, follow
from ..cluster.membership import Membership
from ..cluster.tenure import Tenure, claims_at, newest, release
from .common import (
    EXIT_OK,
    EXIT_USAGE,
    add_allowed_origins,
    add_api_tls,
    add_chat_template,
    add_default_max_tokens,
    add_generation_config,
    add_model,
    add_mtp,
    add_scheduling_policy,
    add_take_over,
    json_usage_errors,
    check_default_depth,
    check_port_free,
    exit_on_sigterm,
    progress_loader,
    stage_options,
    stderr_console,
)
from .cluster_args import add_cluster_args, resolve_config
from .health import add_health_command
from .serve import add_serve_command

log = logging.getLogger(__name__)

def add_cluster_commands(sub: argparse._SubParsersAction) -> None:
    """Register the cluster subcommands on the main parser."""
    add_node_command(sub)
    add_cache_command(sub)
    add_serve_command(sub)
    add_launch_commands(sub)
    add_health_command(sub)


def _emit(args: argparse.Namespace, console: Any, event: str, message: str, **fields: Any) -> None:
    """A readiness event: one JSON line on stdout with --json, else a line on the console."""
    if args.json:
        print(json.dumps({"event": event, **fields}), flush=True)
    else:
        console.print(message)


def _self_target(host: str, port: int) -> str:
    """How this process reaches its own node server."""
    return format_host_port("127.0.0.1" if host in ("0.0.0.0", "::", "") else host, port)


def when_listening(host: str, port: int, callback: Callable[[], object], timeout: float = 120.0) -> None:
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


def _stand_down(server: Any, agent: Any, newer: Claim) -> None:
    """This node coordinates no more: a coordinator of a newer term outranks its own (tenure.py)."""
    server.service.coordinators.see(newer)
    server.service.coordinating = False
    if agent is not None:
        agent.set_coordinator(False)


def _stood_down(args: argparse.Namespace, console: Any, me: str, claim: Claim, newer: Claim) -> None:
    _emit(args, console, "stepped_down", f"node {me}: coordinator {newer.holder} of term {newer.term} outranks "
          f"this one (term {claim.term}): it stepped down and follows it", node_id=me, coordinator=newer.holder,
          term=newer.term)


def cmd_launch(args: argparse.Namespace) -> int:
    """With --json, a launch that fails says so on stdout too (an "error" event), for whoever waits for
    its events; the error itself is reported as every command's is."""
    try:
        return _launch(args)
    except Exception as e:
        if args.json:
            why = str(e) if isinstance(e, (ValueError, FileNotFoundError)) else f"{type(e).__name__}: {e}"
            print(json.dumps({"event": "error", "error": why}), flush=True)
        raise


def _launch(args: argparse.Namespace) -> int:
    from ... import __version__
    from ...models.registry import local_model, model_name_for, resolve_model
    from ...node import (
        stage,  # noqa: F401  (MLX and mlx-lm now, not on the first shard load)
        sysinfo,
    )
    from ...node.identity import node_id as persistent_id
    from ...node.server import NodeServer
    from ..api.defaults import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONCURRENCY
    from ..api.front import FrontProcess, front_spec
    from ..api.model_defaults import generation_config_dir, generation_config_source
    from ..api.templates import chat_template_of, checked_for
    from ..api.tls import api_tls, scheme
    from ..api.serve import serve
    from ..api.stepped_down import SteppedDown
    from ..cluster.heal import Healer
    from ..cluster.placement import GiB

    console = stderr_console()
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # unwinds through the cleanup below: peers see this node leave
    cfg = resolve_config(args)
    secret = cfg.resolve_secret()
    check_exposure(cfg.node.host, secret, args.insecure)
    if not secret:
        log.warning("no cluster secret (cluster.yaml secret/secret_file/secret_env or $MTPIPE_SECRET): anyone "
                    "who reaches the node port can drive this node")
    me = persistent_id(cfg.node.state_dir)
    check_port_free(cfg.node.host, cfg.node.port, "the node port (node.host/node.port, --host/--port)")
    mtp = not args.no_mtp
    # Only the coordinator needs the model: another node loads its own copy when it has one (checked by
    # fingerprint), else its shard cache, else fetches its shard from the coordinator's node server.
    model_here = local_model(cfg.model, cfg.revision)
    interfaces = local_interfaces()
    warn_bridge_loops()
    bind = discovery_addresses(cfg.discovery.interfaces, interfaces) if cfg.discovery.enabled else []
    mem = sysinfo.memory()
    offered = offered_memory(sysinfo.placement_memory(mem.available, mem.gpu_limit), cfg.node.max_memory_gib)
    server = NodeServer(cfg.node.host, cfg.node.port, node_id=me, secret=secret,
                        model_dirs=[*cfg.node.model_dirs, *([model_here] if model_here else [])],
                        download=cfg.node.download, **cfg.drafting()).start()
    server.service.coordinating = bool(args.coordinator)

    def memory_offered(sharing: int = 1) -> int:
        # Its own shard counts as free: a new placement would replace it. (`sharing`: nodes on this machine.)
        worker = server.service.worker
        held = worker.shard.model.parameter_bytes() if worker is not None else 0
        now = sysinfo.memory()
        return offered_memory(sysinfo.placement_memory(now.available // sharing + held, now.gpu_limit),
                              cfg.node.max_memory_gib)

    server.service.memory_offered = memory_offered
    my_target = _self_target(cfg.node.host, server.port)
    advert = NodeAdvert(me, cluster_hash(cfg.name), server.port, mem.total, offered, sysinfo.chip(), __version__,
                        advertised_interfaces(interfaces, bind), coordinator=args.coordinator,
                        has_model=model_here is not None)
    placed: dict[str, str] = {}  # id -> where `mtpipe health` finds it (formation.placed_addresses)
    following: list[str] = []  # a follower: the coordinator it follows

    def on_change(kind: str, ad: NodeAdvert) -> None:
        if ad.node_id == me:
            return
        followed = list(following)  # (the main thread may change it meanwhile)
        if followed and ad.node_id == followed[0]:  # (a follower hears of its coordinator only here)
            if kind == "leave":
                heal = cfg.placement.heal_after_s
                _emit(args, console, "coordinator_left", f"node {me}: the coordinator {ad.node_id} left; this node "
                      "keeps its shard and waits for it" + ("" if heal is None else f", or for the nodes left to "
                                                            f"elect another after {heal:g} s"),
                      node_id=me, coordinator=ad.node_id)
            elif kind == "join":
                _emit(args, console, "coordinator_back", f"node {me}: the coordinator {ad.node_id} is back",
                      node_id=me, coordinator=ad.node_id)
        if placed and kind == "join" and ad.node_id not in placed:
            log.warning("node %s joined after placement: a spare, it takes layers in the next heal (a node lost), or "
                        "at the coordinator's restart", ad.node_id)
        elif placed and kind == "leave" and ad.node_id in placed:
            heal = cfg.placement.heal_after_s
            log.warning("node %s of the pipeline left; requests wait for it%s", ad.node_id,
                        "" if heal is None else f", or for the others to take its layers after {heal:g} s")

    agent = ClusterAgent(bind, advert, cfg.name, on_change=on_change, memory_offered=memory_offered) if bind else None
    membership = Membership(me, interfaces, secret)  # which discovered nodes count (membership.py)
    engine = front = gone = None
    try:
        if agent is not None:
            agent.start()
        _emit(args, console, "node", f"[bold]mtpipe[/bold] node {me} on port {server.port}, cluster "
              f"[cyan]{cfg.name}[/cyan], discovery on {', '.join(bind) or 'nothing (static nodes only)'}",
              node_id=me, port=server.port, pid=os.getpid())
        answered: set[str] = set()  # cluster.yaml's nodes that answered: `expect` counts them too

        def answering() -> set[str]:
            if len(answered) < len(cfg.nodes):
                answered.update(static_flags(cfg.nodes, secret, 0.0))
            return answered

        peers = wait_for_peers(agent, me, cfg, args.coordinator, membership.members, answering) \
            if agent is not None else {}
        peers[me] = advert  # its own, not an advert claiming its id
        peers = membership.shared(peers, memory_offered)  # (nodes on one machine share what it has free)
        # Static nodes vote too (by their Ping): without multicast between the machines, each would
        # otherwise see itself alone and coordinate.
        votes = static_flags(cfg.nodes, secret, cfg.discovery.settle) if cfg.nodes else {}
        coordinator = elect_coordinator(me, peers, forced=args.coordinator, listed=votes, taking_over=args.take_over)
        watch, gone, first = None, None, True  # (gone: this node stepped down, its API port says so)

        def followed(node_id: str) -> None:
            following[:] = [node_id]
            _emit(args, console, "follower", f"node {me}: {node_id} coordinates; serving shards until stopped",
                  node_id=me, coordinator=node_id)

        def members_at() -> list[str]:  # where the members and the placed nodes answer (tenure.py asks them)
            members = membership.members(agent.peers()) if agent is not None else {}
            found = [a for i, ad in members.items() if i != me and (a := membership.address(ad))]
            return [*found, *(n.address for n in cfg.nodes), *(a for i, a in dict(placed).items() if i != me)]

        while True:  # a follower until elected, a coordinator until a newer one outranks it (tenure.py)
            if coordinator != me:
                watch = watch or Watch(advert, agent, membership, interfaces, cfg.nodes, secret)
                followed(coordinator)
                # until SIGTERM or Ctrl-C ends the process through the finally below, or the coordinator is
                # gone and the nodes left elect this one (follow.py)
                try:
                    follow(me, coordinator, watch.coordinates, watch.elect, followed, cfg.placement.heal_after_s)
                except KeyboardInterrupt:  # (Ctrl-C stops a follower as it stops a coordinator: exit 0)
                    return EXIT_OK
                finally:
                    if gone is not None:
                        gone.close()
                _emit(args, console, "coordinating", f"node {me}: the coordinator {following[0]} is gone; the nodes "
                      "left elected this one", node_id=me, coordinator=me)
                following.clear()
                peers = membership.shared(watch.members(), memory_offered)
            # Its term: one more than any its members have seen (node/coordinators.py).
            claim = Claim(next_term([server.service.coordinators.claim.term,
                                     *(c.term for c in claims_at(members_at(), secret))]), me)
            server.service.coordinators.see(claim)
            log.info("%s coordinates %d node(s)%s, term %d", me, len(peers),
                     f" and {len(cfg.nodes)} static" if cfg.nodes else "", claim.term)
            check_port_free(cfg.api.host, cfg.api.port, "the API port (api.port, --api-port)")  # before the model loads
            try:
                defaults_from = generation_config_source(cfg.api.generation_config)
            except ValueError as e:
                raise ValueError(f"api.generation_config (--generation-config): {e}") from None
            named = ("api.chat_template (--chat-template)", "api.chat_template_args (--chat-template-args)")
            template = chat_template_of(cfg.api.chat_template, cfg.api.chat_template_args, named)
            tls = api_tls(cfg.api.ssl_certfile, cfg.api.ssl_keyfile, "api.ssl_certfile/ssl_keyfile (--ssl-certfile, "
                          "--ssl-keyfile)")
            server.service.coordinating = True  # before the advert says so: peers check the advert against it
            if agent is not None:
                agent.set_coordinator(True)
            model_path = model_here or resolve_model(cfg.model, cfg.revision)
            server.service.weights.add_model_dir(model_path)  # this node serves the model's tensors to the others
            name, api_key = model_name_for(cfg.model, model_path), cfg.resolve_api_key()
            settings = dict(default_mtp_depth=cfg.mtp_depth if mtp else 0, max_concurrency=DEFAULT_MAX_CONCURRENCY,
                            max_body_bytes=DEFAULT_MAX_BODY_BYTES, cors_origins=tuple(cfg.api.allowed_origins),
                            generation_config=generation_config_dir(defaults_from, model_path),
                            default_max_tokens=cfg.api.max_tokens, scheduling_policy=cfg.api.scheduling_policy,
                            chat_template=checked_for(template, model_path, named), tls=tls)
            static = static_nodes(cfg, secret, me, interfaces)
            alone = set(peers) | set(static) <= {me}  # (cluster.yaml may list this machine alone)
            # With peers, each machine's node drafts as its own command says (every machine runs the same one).
            options = stage_options(args, drafting=cfg.drafting()) if alone else {}
            if alone and cfg.prefix_cache() is not None:
                options["prefix_cache"] = cfg.prefix_cache()
            if alone and cfg.node.max_memory_gib is not None:  # (the weights and the batch's caches stay within it)
                options["memory_cap"] = int(cfg.node.max_memory_gib * GiB)
            if not alone and args.mtp_pre_norm:
                raise ValueError("--mtp-pre-norm applies to local stages; nodes take their own")
            if not args.api_in_process:  # its process imports the app while the model loads and the cluster forms
                front = FrontProcess(None, front_spec(model_path, cfg.api.host, cfg.api.port, api_key, name,
                                                      **settings))
                front.spawn()  # (assigned first: `finally` stops it whatever interrupts the spawn)
            if alone:
                log.info("no peers: running the whole model on this machine")
                check_alone(cfg, advert, model_path, mtp)
                with progress_loader("loading model")() as progress:
                    engine = single_node_engine(server, model_path, mtp, cfg.dtype, options, progress)
                formation = None
                placed[me] = my_target
            else:
                try:
                    engine, formation = form_cluster(cfg, me, my_target, peers, static, interfaces, model_path, mtp,
                                                     secret, console, take_over=args.take_over and first,
                                                     claim=claim)
                except Exception:
                    # (elected as another was, of a term that outranks it: its Loads were refused; it follows)
                    if (newer := newest(claims_at(members_at(), secret), claim)) is None:
                        raise
                    coordinator, first = newer.holder, False
                    _stand_down(server, agent, newer)
                    if front is not None:
                        front.stop()
                        front = None
                    _stood_down(args, console, me, claim, newer)
                    continue
                placed.update(placed_addresses(formation, static))

                def replaced(f: Formation) -> None:  # the others took a lost node's layers (heal.py)
                    now = placed_addresses(f, static)
                    placed.update(now)
                    for gone_id in set(placed) - set(now):
                        placed.pop(gone_id, None)
                    server.service.placed = dict(sorted(now.items()))

                def joined() -> dict[str, tuple[Any, str]]:  # (members not placed: spares for the next heal)
                    members = membership.members(agent.peers()) if agent is not None else {}
                    return {i: (resources_from_advert(ad, reserve), address) for i, ad in members.items()
                            if i != me and not ad.coordinator and (address := membership.address(ad))}

                reserve = int(cfg.placement.reserve_gib * GiB)
                Healer(formation, formation.footprint, me, secret, reserve, on_placed=replaced,
                       joined=joined).attach(engine.pipeline, cfg.placement.heal_after_s)
            server.service.placed = dict(sorted(placed.items()))  # (`mtpipe health` lists a member that is gone)
            check_default_depth(cfg.mtp_depth if mtp else 0, engine.has_mtp, "--mtp-depth (cluster.yaml mtp_depth)")
            info = cluster_info_fn(cfg, me, my_target, engine, name, formation, agent, secret, membership)
            state = info()
            url = f"{scheme(tls)}://{format_host_port(cfg.api.host, cfg.api.port)}/v1"
            stages = ", ".join(f"{p['node']} layers {p['layers'][0]}-{p['layers'][1] - 1}" for p in state["placement"])
            tenure = Tenure(claim, members_at, secret)
            when_listening(cfg.api.host, cfg.api.port, lambda: tenure.over.is_set() or _emit(  # (not its 503 port)
                args, console, "serving", f"[bold]mtpipe[/bold] serving [cyan]{name}[/cyan] at {url} over {stages}",
                term=claim.term, api=url, **{k: state[k] for k in ("placement", "links", "ring", "batching",
                                                                    "discovered", "left_out", "ignored")}))
            tenure.start()
            try:
                rc = serve(engine, cfg.api.host, cfg.api.port, api_key=api_key, model_name=name, cluster_info=info,
                           model_path=model_path, api_process=not args.api_in_process, front=front,
                           until=tenure.over, **settings)
            finally:
                tenure.stop()
            if tenure.successor is None:
                return rc
            # Stepped down (its API stopped): its port says so, what it held goes, and it follows the newer
            # coordinator (tenure.py).
            coordinator, first = tenure.successor.holder, False
            gone = SteppedDown(cfg.api.host, cfg.api.port, me, tenure.successor, tls).start()
            _stand_down(server, agent, tenure.successor)
            front, stopped, engine = None, engine, None
            release(stopped, secret)
            if formation is None:
                server.service.adopt(None, None)  # (the whole model, held in this process)
            placed.clear()
            server.service.placed = {}
            _stood_down(args, console, me, claim, tenure.successor)
    finally:
        if front is not None:
            front.stop()
        if engine is not None:
            engine.close()
        if gone is not None:
            gone.close()
        if agent is not None:
            agent.stop()
        server.stop()


def add_launch_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="run this machine as a node of a cluster (the same command on every machine)")
    add_cluster_args(p)
    add_model(p, "cluster.yaml's, else the demo model")
    p.add_argument("--coordinator", action="store_true",
                   help="coordinate: place the model and serve the API (refused where another node coordinates, "
                        "unless --take-over)")
    p.add_argument("--insecure", action="store_true",
                   help="without a secret, let the node server listen on a non-loopback address (a trusted network)")
    p.add_argument("--expect", type=int, help="nodes to wait for, this one included")
    p.add_argument("--settle", type=float, help="seconds: the most to wait for --expect nodes, else the quiet time "
                                                 "after the last join (default 5)")
    p.add_argument("--node", action="append", help="a static node host[:port] (networks without multicast)")
    p.add_argument("--host", help="address the node server listens on (default 0.0.0.0)")
    p.add_argument("--port", type=int, help="node server port (default 52700)")
    p.add_argument("--state-dir", help="where the node id is kept (default $MTPIPE_STATE_DIR or ~/.mtpipe)")
    p.add_argument("--max-memory", type=float, help="offer at most this many GiB to the cluster")
    p.add_argument("--model-dir", action="append",
                   help="a model, or a directory of models, this node may load (repeatable; see `mtpipe node --help`)")
    p.add_argument("--download", action="store_true", default=None,
                   help="when no node can send this node its shard, download only its files from the hub")
    p.add_argument("--api-host", help="API address on the coordinator (default 127.0.0.1)")
    p.add_argument("--api-port", type=int, help="API port on the coordinator (default 8000)")
    add_secret_file(p, "--api-key", "the key clients must send ('Authorization: Bearer KEY')",
                    "MTPIPE_API_KEY, or the variable cluster.yaml's api.api_key_env names")
    p.add_argument("--api-in-process", action="store_true",
                   help="serve HTTP from the coordinator's process (default: an API process of its own)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="cast weights on load")
    p.add_argument("--prefix-cache", type=float, metavar="GB",
                   help="GB of prompt prefixes kept (over all nodes, or on this machine alone), so that a chat's "
                        "next turn prefills only the rest (default: as `mtpipe serve`; 0: off)")
    p.add_argument("--json", action="store_true", help="print readiness events as JSON lines on stdout")
    add_generation_config(p, checked=False)  # (checked on the coordinator alone)
    add_default_max_tokens(p)
    add_chat_template(p)
    add_api_tls(p)
    add_allowed_origins(p, "cluster.yaml's api.allowed_origins, else *")
    add_scheduling_policy(p, None)
    add_take_over(p)
    add_mtp(p)
    p.set_defaults(func=cmd_launch)
    json_usage_errors(p, EXIT_USAGE, event="error")  # (cmd_launch's error event, for a bad command line too)
