"""The API port of a coordinator that stepped down (coordinator/cluster/tenure.py): every request gets a
503 that names the coordinator serving the cluster now, rather than a refused connection.

Clients pointed at this machine learn where to go; a load balancer's health check (`/health`) takes it
out of rotation. It listens until this node coordinates again (elected after the newer one is gone) or
stops.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from ...node.coordinators import Claim

if TYPE_CHECKING:
    from .tls import ApiTLS

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5


def stepped_down_message(me: str, successor: Claim) -> str:
    return (f"node {me} no longer coordinates this cluster: coordinator {successor.holder} of a newer term "
            f"({successor.term}) does, and serves the API on its machine; send requests there")


class SteppedDown:
    """A tiny HTTP server on the API's host and port that answers everything with that 503 (over HTTPS
    where the API was: `tls`)."""

    def __init__(self, host: str, port: int, me: str, successor: Claim, tls: ApiTLS | None = None):
        self.host, self.port, self.tls = host, port, tls
        self.body = json.dumps({"error": {"message": stepped_down_message(me, successor), "type": "server_error",
                                          "param": None, "code": "stepped_down"}}).encode()
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> SteppedDown:
        body = self.body

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                self.send_response(503)
                self.send_header("content-type", "application/json")
                self.send_header("retry-after", str(RETRY_AFTER_S))
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_OPTIONS = _answer

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
                log.debug("stepped down: %s", format % args)

        host = self.host or "0.0.0.0"
        try:
            self._server = (_V6Server if ":" in host else ThreadingHTTPServer)((host, self.port), Handler)
        except OSError as e:
            log.warning("the API port %s:%d cannot tell clients that this node stepped down: %s", self.host,
                        self.port, e)
            return self
        self._server.daemon_threads = True
        if self.tls is not None:  # (each handshake in its request's thread: a silent client holds up no other)
            import ssl

            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(self.tls.certfile, self.tls.keyfile)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True,
                                                      do_handshake_on_connect=False)
        threading.Thread(target=self._server.serve_forever, name="stepped-down-api", daemon=True).start()
        log.info("the API port %s:%d answers 503: %s", self.host, self.port, json.loads(body)["error"]["message"])
        return self

    @property
    def address(self) -> tuple[str, int] | None:
        """Where it listens (the port bound, if 0 was asked); None if it could not."""
        return self._server.server_address[:2] if self._server is not None else None

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


class _V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6
