"""Serving the REST API: `mtpipe serve` (this machine, or running nodes with --nodes) and `serve()`,
which `mtpipe launch` uses too."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from .app import API_KEY_ENV, DEFAULT_HOST, DEFAULT_MAX_CONCURRENCY, DEFAULT_MODEL_NAME, DEFAULT_PORT, create_app

if TYPE_CHECKING:
    from ..engine.engine import Engine

log = logging.getLogger(__name__)


def nodes_cluster_info(engine: "Engine", model_name: str, timeout: float = 2.0) -> Callable[[], dict]:
    """GET /v1/cluster for an engine over running nodes (`mtpipe serve --nodes`): each node's Health."""
    pipeline = engine.pipeline

    def info() -> dict[str, Any]:
        addresses = list(getattr(pipeline, "addresses", []))
        out: dict[str, Any] = {"mode": "nodes", "model": model_name, "mtp": engine.has_mtp,
                               "max_context": engine.max_context}
        try:
            replies = pipeline.health(probe_next=True, timeout=timeout)
        except Exception as e:  # one node down fails the whole call: say so, and which nodes there are
            from ...node.wire import describe_rpc_error

            return {**out, "healthy": False, "error": describe_rpc_error(e), "placement": [], "links": [],
                    "nodes": [{"address": a, "healthy": None} for a in addresses]}
        nodes = [{"address": a, "healthy": r.loaded, **{f.name: getattr(r, f.name) for f in r.DESCRIPTOR.fields}}
                 for a, r in zip(addresses, replies)]
        placement = [{"node": a, "layers": [r.start, r.end]} for a, r in zip(addresses, replies)]
        links = [{"from": a, "to": r.next, "rtt_ms": r.next_rtt_ms} for a, r in zip(addresses, replies) if r.next]
        return {**out, "healthy": all(n["healthy"] for n in nodes), "placement": placement, "links": links,
                "nodes": nodes}

    return info


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def serve(
    engine: "Engine",
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    api_key: Optional[str] = None,
    model_name: str = DEFAULT_MODEL_NAME,
    cluster_info: Optional[Callable[[], dict]] = None,
    *,
    default_mtp_depth: Optional[int] = None,
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
) -> None:
    """Run the API with uvicorn until interrupted. Logging goes through the root logger."""
    import uvicorn

    app = create_app(engine, model_name, api_key=api_key, cluster_info=cluster_info,
                     default_mtp_depth=default_mtp_depth, max_concurrency=max_concurrency)
    if not api_key and not _is_loopback(host):
        log.warning("serving on %s without an API key: anyone who reaches this port can use the model", host)
    log.info("serving %s at http://%s:%d/v1", model_name, host, port)
    uvicorn.run(app, host=host, port=port, log_config=None, timeout_graceful_shutdown=5)


# -- `mtpipe serve` -------------------------------------------------------------------------------


def add_serve_command(sub: "argparse._SubParsersAction") -> None:
    from ..cli.main import _add_mtp

    p = sub.add_parser("serve", help="serve the OpenAI-compatible API, on this machine or over running nodes")
    p.add_argument("--model", help="model directory or hub repo (default: the bundled demo model)")
    p.add_argument("--nodes", help="comma-separated host:port of running nodes, in pipeline order")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    p.add_argument("--model-name", help="the model id clients use (default: the --model name)")
    p.add_argument("--secret", default=None, help="the nodes' shared secret, with --nodes (default: $MTPIPE_SECRET)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="cast weights on load")
    p.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY,
                   help="generations at once; more requests wait")
    _add_mtp(p)
    p.set_defaults(func=cmd_serve)


def model_name_for(model: Optional[str], path: Path) -> str:
    """What clients call the model: a hub id as given, else the directory name."""
    if model and not Path(model).expanduser().exists():
        return model
    return path.name


def cmd_serve(args: argparse.Namespace) -> int:
    from ...models.registry import resolve_model
    from ..cli.main import _progress_loader, _stderr_console
    from ..engine.engine import local_engine

    if args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if args.mtp_depth is not None and args.mtp_depth < 0:
        raise ValueError("--mtp-depth must be >= 0")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    path = resolve_model(args.model)
    if args.nodes:
        from ..pipeline.remote import remote_engine

        if getattr(args, "mtp_pre_norm", False):
            raise ValueError("--mtp-pre-norm applies to local stages, not to --nodes")
        nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
        secret = args.secret or os.environ.get("MTPIPE_SECRET") or None
        engine = remote_engine(path, nodes, mtp=not args.no_mtp, secret=secret, dtype=args.dtype)
    else:
        import mlx.core as mx

        options = {"mtp_pre_norm": True} if getattr(args, "mtp_pre_norm", False) else {}
        with _progress_loader("loading model")() as progress:
            engine = local_engine(path, mtp=not args.no_mtp, dtype=getattr(mx, args.dtype) if args.dtype else None,
                                  progress=progress, **options)
    depth = 0 if args.no_mtp else args.mtp_depth
    if depth and not engine.has_mtp:
        raise ValueError("--mtp-depth needs a model with an MTP head")
    name = args.model_name or model_name_for(args.model, path)
    _stderr_console().print(
        f"[bold]mtpipe[/bold] serving [cyan]{name}[/cyan] at http://{args.host}:{args.port}/v1"
        + (" (API key required)" if api_key else "")
    )
    try:
        cluster_info = nodes_cluster_info(engine, name) if args.nodes else None
        serve(engine, args.host, args.port, api_key=api_key, model_name=name, cluster_info=cluster_info,
              default_mtp_depth=depth, max_concurrency=args.max_concurrency)
    finally:
        engine.pipeline.close()
    return 0
