"""Running the REST API with uvicorn (`mtpipe serve` and `mtpipe launch`), and what /v1/cluster says
about an engine over running nodes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from .app import create_app
from .defaults import DEFAULT_HOST, DEFAULT_MAX_CONCURRENCY, DEFAULT_MODEL_NAME, DEFAULT_PORT

if TYPE_CHECKING:
    from ..engine.engine import Engine

log = logging.getLogger(__name__)


def nodes_cluster_info(engine: "Engine", model_name: str, timeout: float = 2.0) -> Callable[[], dict]:
    """GET /v1/cluster for an engine over running nodes (`mtpipe serve --nodes`): each node's Health."""
    pipeline = engine.pipeline

    def info() -> dict[str, Any]:
        addresses = [stage["address"] for stage in pipeline.describe()["stages"]]
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


def model_name_for(model: Optional[str], path: Path) -> str:
    """What clients call the model: a hub id as given, else the directory name."""
    if model and not Path(model).expanduser().exists():
        return model
    return path.name


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
