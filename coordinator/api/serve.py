"""Running the REST API with uvicorn (`mtpipe serve` and `mtpipe launch`), and what /v1/cluster says
about an engine over running nodes."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from .app import create_app
from .defaults import (
    DEFAULT_CORS_ORIGINS,
    DEFAULT_HOST,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_MODEL_NAME,
    DEFAULT_PORT,
    STALL_TIMEOUT_S,
)
from .readiness import NodeWatch, timestamp

if TYPE_CHECKING:
    from ..engine.engine import Engine
    from .front import FrontProcess
    from .templates import ChatTemplate
    from .tls import ApiTLS

log = logging.getLogger(__name__)


def nodes_cluster_info(engine: "Engine", model_name: str, timeout: float = 2.0) -> Callable[[], dict]:
    """GET /v1/cluster for an engine over running nodes (`mtpipe serve --nodes`): each node's Health,
    asked of each node on its own, so one that is down shows as down beside the others' real state; and
    a ring engine's groups, rows, queue, per-node memory budgets and preemptions."""
    watch = NodeWatch(engine.pipeline)

    def info() -> dict[str, Any]:
        states = watch.check(timeout, probe_next=True)
        nodes = [s.as_dict() for s in states]
        placement = [{"node": s.address, "layers": [s.reply.start, s.reply.end] if s.reply else None}
                     for s in states]
        links = [{"from": s.address, "to": s.reply.next, "rtt_ms": s.reply.next_rtt_ms}
                 for s in states if s.reply and s.reply.next]
        errors = [{"node": n["address"], "error": n["error"], "at": n["error_at"]} for n in nodes if n["error"]]
        out: dict[str, Any] = {"mode": "nodes", "model": model_name, "mtp": engine.has_mtp,
                               "batching": engine.batching, "max_context": engine.max_context, "healthy": not errors,
                               "checked_at": timestamp(min(s.checked_at for s in states)),
                               "placement": placement, "links": links, "nodes": nodes, "errors": errors}
        if errors:
            out["error"] = "; ".join(f"{e['node']}: {e['error']}" for e in errors)
        if engine.batching == "ring":
            out["ring"] = engine.describe()["ring"]
        healed = getattr(getattr(engine.pipeline, "heal", None), "left_out", None)
        if healed:  # (spares the next heal places layers on: `mtpipe health` shows them idle)
            out["left_out"] = {address: f"node {node_id}: a heal left it out" for node_id, address in healed.items()}
        return out

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
    max_body_bytes: Optional[int] = DEFAULT_MAX_BODY_BYTES,
    model_path: Optional[Path] = None,
    api_process: bool = True,
    front: Optional["FrontProcess"] = None,
    stall_timeout: Optional[float] = STALL_TIMEOUT_S,
    generation_config: Optional[Path] = None,
    cors_origins: Sequence[str] = DEFAULT_CORS_ORIGINS,
    default_max_tokens: Optional[int] = None,
    scheduling_policy: str = "fcfs",
    chat_template: Optional["ChatTemplate"] = None,
    tls: Optional["ApiTLS"] = None,
    announce: Optional[Callable[[str], None]] = None,
    until: Optional[threading.Event] = None,
) -> int:
    """Run the API with uvicorn until interrupted (Ctrl-C or SIGTERM: 0) or until the API process ends
    by itself (1, logged). Logging goes through the root logger.

    With `api_process` (and `model_path`, whose tokenizer it loads), an engine that batches is served by
    an API in a process of its own (front.py); otherwise, and for the per-sequence engine, in this one.
    `front`: that process, spawned early with these settings (`front_spec`); stopped if not used.
    `stall_timeout`: that process fails every open request and stops once the engine has been stuck this
    long (link.py); None: never. `generation_config`: the directory whose generation_config.json gives
    requests their defaults (None: OpenAI's), `default_max_tokens` the max_tokens of those that leave it
    out (None: the generation config's, else ours); `scheduling_policy` and `chat_template` as create_app's;
    `tls`: HTTPS (tls.py). `announce(url)` once the API listens (the port bound, if 0 was asked). Once `until` is set, the API stops as on
    SIGTERM and this returns 0 (a launched coordinator that steps down, coordinator/cluster/tenure.py).
    """
    if not api_key and not _is_loopback(host):
        log.warning("serving on %s without an API key: anyone who reaches this port can use the model", host)
    elif tls is None and not _is_loopback(host):
        log.warning("serving on %s over plain HTTP: the API key crosses the network in clear (--ssl-certfile and "
                    "--ssl-keyfile serve HTTPS)", host)
    if api_process and model_path is not None and hasattr(engine, "open"):
        from .front import FrontProcess, front_spec

        spec = front_spec(model_path, host, port, api_key, model_name, default_mtp_depth=default_mtp_depth,
                          max_concurrency=max_concurrency, max_body_bytes=max_body_bytes, stall_timeout=stall_timeout,
                          generation_config=generation_config, cors_origins=cors_origins,
                          default_max_tokens=default_max_tokens, scheduling_policy=scheduling_policy,
                          chat_template=chat_template, tls=tls)
        if front is not None and front.spec != spec:
            log.warning("the API process spawned early has other settings: starting another")
            front.stop()
            front = None
        front = front or FrontProcess(None, spec)
        return front.attach(engine, cluster_info).serve(announce, until)
    if front is not None:
        front.stop()
    import uvicorn

    from .front import api_server, base_url, when_serving
    from .tls import uvicorn_options

    log.info("serving %s at %s/v1", model_name, base_url(host, port, tls, host))

    app = create_app(engine, model_name, api_key=api_key, cluster_info=cluster_info,
                     default_mtp_depth=default_mtp_depth, max_concurrency=max_concurrency,
                     max_body_bytes=max_body_bytes, generation_config=generation_config, cors_origins=cors_origins,
                     default_max_tokens=default_max_tokens, scheduling_policy=scheduling_policy,
                     chat_template=chat_template)
    server = api_server(uvicorn.Config(app, host=host, port=port, log_config=None, timeout_graceful_shutdown=5,
                                       **uvicorn_options(tls)))
    if announce is not None:
        threading.Thread(target=when_serving, args=(server, lambda at, port: announce(base_url(at, port, tls, host))),
                         name="api-announce", daemon=True).start()
    if until is not None:
        threading.Thread(target=lambda: until.wait() and server.stop(),
                         name="api-until", daemon=True).start()
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the Ctrl-C it handled again once it has stopped
        pass
    return 0

