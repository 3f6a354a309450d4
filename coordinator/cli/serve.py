"""`mtpipe serve`: the REST API over this machine's stages, or over running nodes with --nodes."""

from __future__ import annotations

import argparse
import logging
import math
import signal

from ...node.secrets import add_secret_args, add_secret_file, read_secret
from ..api.defaults import (
    API_KEY_ENV,
    DEFAULT_CORS_ORIGINS,
    DEFAULT_HOST,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_PORT,
    STALL_TIMEOUT_S,
)
from ..engine.ring import RESUME_WINDOW_S
from ...node.cli import number_arg, port_arg
from .common import (
    add_allowed_origins,
    add_api_tls,
    add_chat_template,
    add_default_max_tokens,
    add_generation_config,
    add_model,
    add_mtp,
    add_scheduling_policy,
    add_take_over,
    check_default_depth,
    check_port_free,
    exit_on_sigterm,
    nodes_arg,
    progress_loader,
    stage_options,
    stderr_console,
)


log = logging.getLogger(__name__)

seconds_or_never = number_arg(float, "a number of seconds (0: never)", lambda s: s >= 0 and math.isfinite(s))


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API, on this machine or over running nodes")
    add_model(p)
    p.add_argument("--nodes", type=nodes_arg, help="comma-separated host:port of running nodes, in pipeline order")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})")
    p.add_argument("--port", type=port_arg, default=DEFAULT_PORT)
    add_secret_file(p, "--api-key", "the key clients must send ('Authorization: Bearer KEY')", API_KEY_ENV)
    p.add_argument("--model-name", help="the model id clients use (default: the --model name)")
    add_secret_args(p, "the nodes' shared secret, with --nodes")
    p.add_argument("--weights-from", type=nodes_arg,
                   help="with --nodes: comma-separated host:port of nodes that hold the model "
                        "(`mtpipe node --model-dir`); the others fetch their shards from them")
    add_take_over(p)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="cast weights on load")
    p.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY,
                   help="generations at once; more requests wait")
    add_scheduling_policy(p)
    p.add_argument("--prefix-cache", type=float, metavar="GB",
                   help="GB of prompt prefixes kept so that a prompt starting with one (a chat's next turn) "
                        "prefills only the rest. One machine: dropped first when requests need the memory (default: "
                        "a quarter of the batch's memory budget). With --nodes: over all nodes together (default: an "
                        "eighth of the memory the node with least available has, per node). 0: off")
    p.add_argument("--memory-budget", type=float, metavar="GB",
                   help="GB the batch's caches may hold (attention KV, GatedDeltaNet states; one machine: kept "
                        "prefixes too; with --nodes: on each node, for its layers); requests past it wait, and where "
                        "running ones outgrow it the last admitted wait again, then go on (default: half the memory "
                        "free once the model is loaded, on each node less its share of kept prefixes)")
    p.add_argument("--resume-window", type=seconds_or_never,
                   help="with --nodes: how long a request whose node is lost waits for the pipeline to be formed "
                        f"again, then goes on where it stopped (default {RESUME_WINDOW_S:g} s, plus --heal-after; "
                        "0: fail at once)")
    p.add_argument("--heal-after", type=seconds_or_never, metavar="S",
                   help="with --nodes: once a node has been lost this long, the nodes left take its layers, in the "
                        "order given, when their memory holds the model (one node left runs it all); each loads from "
                        "its model directories or --weights-from. Default: wait for the node to come back")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"refuse larger request bodies with 413 (default {DEFAULT_MAX_BODY_BYTES}; 0: no limit)")
    p.add_argument("--stall-timeout", type=seconds_or_never, default=None, metavar="S",
                   help="once the engine has been stuck this long (one round, or its process silent), every open "
                        f"request fails with 503 and the command exits 1, for a supervisor to restart it (default "
                        f"{STALL_TIMEOUT_S:g} s; 0: never; not with --api-in-process)")
    p.add_argument("--api-in-process", action="store_true",
                   help="serve HTTP from the engine's process (default: an API process of its own, so that parsing "
                        "and streaming never hold up the engine's rounds)")
    add_allowed_origins(p)
    add_generation_config(p)
    add_default_max_tokens(p)
    add_chat_template(p)
    add_api_tls(p)
    add_mtp(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from ...models.registry import model_name_for, resolve_model
    from ..api.front import FrontProcess, front_spec  # (light: the rest comes in once the front is spawned)
    from ..api.model_defaults import generation_config_dir
    from ..api.templates import chat_template_of, checked_for
    from ..api.tls import api_tls

    for option, value in (("--weights-from", args.weights_from), ("--heal-after", args.heal_after),
                          ("--resume-window", args.resume_window)):
        if value is not None and not args.nodes:
            raise ValueError(f"{option} applies with --nodes")
    if args.memory_budget is not None and not (args.memory_budget > 0 and math.isfinite(args.memory_budget)):
        raise ValueError("--memory-budget must be a number of GB, more than 0")
    heal_after = args.heal_after or None
    resume_window = RESUME_WINDOW_S + (heal_after or 0.0) if args.resume_window is None else args.resume_window
    if heal_after and resume_window and resume_window < heal_after:
        log.warning("--resume-window %g s is shorter than --heal-after %g s: requests under way when a node is lost "
                    "fail before the others take its layers", resume_window, heal_after)
    if args.stall_timeout and args.api_in_process:  # (the API's own process is what watches the engine)
        raise ValueError("--stall-timeout applies without --api-in-process")
    stall_timeout = STALL_TIMEOUT_S if args.stall_timeout is None else args.stall_timeout or None
    if args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if args.max_body_bytes < 0:
        raise ValueError("--max-body-bytes must be 0 (no limit) or more")
    if args.prefix_cache is not None and not (args.prefix_cache >= 0 and math.isfinite(args.prefix_cache)):
        raise ValueError("--prefix-cache must be a number of GB, 0 (off) or more")
    template = chat_template_of(args.chat_template, args.chat_template_args)
    tls = api_tls(args.ssl_certfile, args.ssl_keyfile)
    check_port_free(args.host, args.port, "--host/--port")  # (before the model loads, which may take minutes)
    api_key = read_secret(args.api_key_file, API_KEY_ENV, option="--api-key-file")
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    path = resolve_model(args.model, args.revision)
    options = stage_options(args, remote=bool(args.nodes))
    if args.prefix_cache is not None:
        options["prefix_cache"] = int(args.prefix_cache * 2**30)
    if args.memory_budget is not None:
        options["memory_budget"] = int(args.memory_budget * 2**30)
    depth = 0 if args.no_mtp else args.mtp_depth
    name = args.model_name or model_name_for(args.model, path)
    settings = dict(default_mtp_depth=depth, max_concurrency=args.max_concurrency,
                    max_body_bytes=args.max_body_bytes or None, stall_timeout=stall_timeout,
                    generation_config=generation_config_dir(args.generation_config, path),
                    default_max_tokens=args.default_max_tokens, scheduling_policy=args.scheduling_policy,
                    chat_template=checked_for(template, path), tls=tls,
                    cors_origins=DEFAULT_CORS_ORIGINS if args.allowed_origins is None else tuple(args.allowed_origins))
    front = engine = None
    try:
        if not args.api_in_process:  # its process imports the app while the model loads
            front = FrontProcess(None, front_spec(path, args.host, args.port, api_key, name, **settings))
            front.spawn()  # (assigned first: `finally` stops it whatever interrupts the spawn)
        from ..api.serve import nodes_cluster_info, serve
        from ..engine.batch import DEFAULT_MAX_ROWS
        from ..engine.build import batch_engine

        if args.nodes:
            from ..engine.build import ring_engine

            secret = read_secret(args.secret_file)
            engine = ring_engine(path, args.nodes, mtp=not args.no_mtp, secret=secret, dtype=args.dtype,
                                 sources=args.weights_from or [], max_rows=args.max_concurrency,
                                 resume_window=resume_window, take_over=args.take_over, **options)
            if heal_after:
                from ..cluster.config import PlacementConfig
                from ..cluster.heal import Healer
                from ..cluster.placement import GiB

                reserve = int(PlacementConfig().reserve_gib * GiB)  # (kept free on each node, as launch keeps it)
                Healer.over_nodes(path, engine.pipeline, secret, args.weights_from or [], reserve).attach(
                    engine.pipeline, heal_after)
        else:
            import mlx.core as mx

            with progress_loader("loading model")() as progress:
                engine = batch_engine(path, mtp=not args.no_mtp, dtype=getattr(mx, args.dtype) if args.dtype else None,
                                      progress=progress, max_rows=max(DEFAULT_MAX_ROWS, args.max_concurrency),
                                      **options)
        check_default_depth(depth, engine.has_mtp)

        def announce(url: str) -> None:
            stderr_console().print(f"[bold]mtpipe[/bold] serving [cyan]{name}[/cyan] at {url}/v1"
                                   + (" (API key required)" if api_key else ""))

        cluster_info = nodes_cluster_info(engine, name) if args.nodes else None
        return serve(engine, args.host, args.port, api_key=api_key, model_name=name, cluster_info=cluster_info,
                     model_path=path, api_process=not args.api_in_process, front=front, announce=announce,
                     **settings)
    finally:
        if front is not None:
            front.stop()
        if engine is not None:
            engine.close()
