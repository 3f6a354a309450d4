"""Auth, request ids and request metrics as plain ASGI middleware (it must not buffer streamed responses)."""

import hmac
import time
import uuid
from typing import Any, Optional

from .errors import body_for
from .metrics import ServerMetrics

OPEN_PATHS = ("/health", "/ping", "/version", "/metrics")  # reachable without the API key (as vLLM's)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models",
             "/v1/cluster", "/health", "/ping", "/version", "/metrics", "/tokenize", "/detokenize", "/v1/messages",
             "/v1/messages/count_tokens", "/v1/responses/input_tokens")


class Gate:
    def __init__(self, app: Any, api_key: Optional[str], metrics: ServerMetrics):
        self.app = app
        self.api_key = api_key
        self.metrics = metrics

    @staticmethod
    def _endpoint(path: str) -> str:
        if path in ENDPOINTS:
            return path
        return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"

    def _authorized(self, scope: dict) -> bool:
        if self.api_key is None or scope["path"] in OPEN_PATHS:
            return True
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":  # (Anthropic's clients send the key as x-api-key)
            token = headers.get(b"x-api-key", b"").decode("latin-1")
        return bool(token.strip()) and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    @staticmethod
    def _request_id(scope: dict) -> bytes:
        """The id the client sent (X-Request-Id, as a proxy sets it), else a new one."""
        sent = dict(scope.get("headers") or []).get(b"x-request-id", b"").strip()
        return sent if sent and len(sent) <= 256 and sent.isascii() else f"req_{uuid.uuid4().hex}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from fastapi.responses import JSONResponse

        endpoint = self._endpoint(scope["path"])
        status = 500
        start = time.perf_counter()

        request_id = self._request_id(scope)

        async def send_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                # the id OpenAI's clients read (x-request-id) and Anthropic's (request-id)
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id),
                                                  (b"request-id", request_id)]}
            await send(message)

        try:
            if self._authorized(scope):
                await self.app(scope, receive, send_status)
            else:
                body = body_for(scope, 401, "invalid or missing API key: send 'Authorization: Bearer <key>' "
                                "(or 'x-api-key: <key>')", code="invalid_api_key")
                await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(
                    scope, receive, send_status)
        finally:
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
            self.metrics.request_seconds.labels(endpoint=endpoint).observe(time.perf_counter() - start)
