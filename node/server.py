"""`NodeServer`: a NodeService on a grpc.aio server and a data-plane listener, on an event-loop thread.

That thread is the node's one MLX thread: MLX streams belong to threads (a lazy array built on one
cannot be evaluated on another, and on Apple silicon a thread without a GPU stream of its own fails
on its first evaluation), so the loop thread owns a thread-local stream for its whole life, as
mlx-lm's generation does, and every MLX operation of the node (loading included) runs on it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent import futures
from typing import Any

import grpc

from ..models.mlx_thread import end_thread_streams, wire_working_set
from ..proto import mtpipe_pb2_grpc as pb_grpc
from .dataplane import FrameListener
from .links import DEFAULT_PORT, bind_problem, format_host_port
from .service import NodeService
from .tls import server_credentials
from .wire import MAX_MESSAGE_BYTES, SERVER_OPTIONS

log = logging.getLogger(__name__)


class NodeServer:
    """A NodeService on a grpc.aio server, on its own event-loop thread ("node-loop", the node's MLX
    thread). `port=0` picks a free port. `model_dirs`: local copies of models it may load and serve to
    peers (each checked by fingerprint); `shard_cache`: its shard cache root (default
    $MTPIPE_SHARD_CACHE, else ~/.cache/mtpipe/shards)."""

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *, node_id: str | None = None,
                 secret: str | None = None, data_plane: bool = True, model_dirs: list[Any] | None = None,
                 shard_cache: Any = None, download: bool = False, draft_vocab: int | None = None,
                 mtp_window: int | None = None):
        self.host, self.requested_port, self.secret = host, port, secret
        self.service = NodeService(node_id=node_id, secret=secret, model_dirs=model_dirs, shard_cache=shard_cache,
                                   download=download, draft_vocab=draft_vocab,
                                   mtp_window=mtp_window)
        # Frames from other nodes over plain TCP on a port of its own (any free one), beside gRPC.
        self.listener = FrameListener(self.service.on_frame, secret, MAX_MESSAGE_BYTES,
                                      self.service.weights.serve_bulk) if data_plane else None
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._stopped = threading.Event()

    @property
    def thread(self) -> threading.Thread | None:
        """The node's loop thread, where all its MLX work runs."""
        return self._thread

    @property
    def address(self) -> str:
        return f"{_bracket(self.host)}:{self.port}"

    async def _start(self) -> None:
        if (why := bind_problem(self.host, self.requested_port)) is not None:  # (before gRPC logs its own words)
            raise OSError(f"cannot listen on {format_host_port(self.host, self.requested_port)}: {why}")
        self._server = grpc.aio.server(options=SERVER_OPTIONS)
        pb_grpc.add_NodeServicer_to_server(self.service, self._server)
        bind = f"{_bracket(self.host)}:{self.requested_port}"
        try:  # with a secret, only a peer that proves it gets through (tls.py)
            self.port = (self._server.add_secure_port(bind, server_credentials(self.secret)) if self.secret
                         else self._server.add_insecure_port(bind))
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            await self._server.stop(None)  # (a server left running aborts the process as it exits)
            why = bind_problem(self.host, self.requested_port) or "refused"
            raise OSError(f"cannot listen on {format_host_port(self.host, self.requested_port)}: {why}")
        self.service.name = f"{self.host}:{self.port}"
        self.service.loop = asyncio.get_running_loop()
        if self.listener is not None:
            self.service.data_port = self.service.weights.data_port = await self.listener.start(self.host)
        await self._server.start()

    def start(self) -> NodeServer:
        started: futures.Future = futures.Future()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                import mlx.core as mx

                wire_working_set()
                with mx.stream(mx.new_thread_local_stream(mx.default_device())):
                    self._loop.run_until_complete(self._start())
                    started.set_result(None)
                    self._loop.run_until_complete(self._server.wait_for_termination())
            except BaseException as e:
                if not started.done():
                    started.set_exception(e)
                else:
                    log.exception("node loop failed")
            finally:
                end_thread_streams()
                self._stopped.set()

        self._thread = threading.Thread(target=run, name="node-loop", daemon=True)
        self._thread.start()
        try:
            started.result()
        except BaseException:
            self._thread.join()  # (its loop and gRPC's threads end before the caller goes on, or exits)
            self._loop.close()
            raise
        log.info("node %s listening on %s", self.service.node_id, self.address)
        return self

    async def _stop(self, grace: float | None) -> None:
        if self.listener is not None:
            await self.listener.close()
        await self.service.close()
        await self._server.stop(grace)

    def stop(self, grace: float | None = 1.0) -> None:
        if self._thread is None or self._stopped.is_set():
            return
        asyncio.run_coroutine_threadsafe(self._stop(grace), self._loop)
        self._stopped.wait()

    def wait(self) -> None:
        """Until it stops. Timed waits: a signal the kernel gives another thread runs its Python handler on
        the main thread only once that wakes."""
        while not self._stopped.wait(0.25):
            pass


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
