"""A cap on request bodies, as plain ASGI middleware.

A body over the cap is refused with 413 before it is parsed: at once when its Content-Length says
so, else as soon as the bytes read so far pass the cap (a chunked body carries no length). Parsing
and tokenizing many megabytes would otherwise cost seconds of CPU for a request refused anyway.
"""

from __future__ import annotations

import logging
from typing import Any

from .errors import APIError, Watched, body_for

log = logging.getLogger(__name__)


class BodyTooLarge(APIError):
    def __init__(self, limit: int, size: int | None = None):
        said = f" ({size} bytes)" if size is not None else ""
        super().__init__(413, f"the request body{said} is larger than this server accepts ({limit} bytes)",
                         code="request_too_large")


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers") or []:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class BodyLimit:
    """Refuses bodies over `max_bytes` with OpenAI's error body and status 413 (None: no cap)."""

    def __init__(self, app: Any, max_bytes: int | None):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.max_bytes is None:
            return await self.app(scope, receive, send)
        limit = self.max_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            log.info("refused a %d-byte body on %s", declared, scope["path"])
            return await self._refuse(BodyTooLarge(limit, declared), scope, receive, send)

        received = 0

        async def counted_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # the route's handler answers it (an APIError), or the except below
                    log.info("refused a body over %d bytes on %s (no Content-Length)", limit, scope["path"])
                    raise BodyTooLarge(limit)
            return message

        watched_send = Watched(send)
        try:
            await self.app(scope, counted_receive, watched_send)
        except BodyTooLarge as e:
            if watched_send.started:
                raise
            await self._refuse(e, scope, receive, send)

    @staticmethod
    async def _refuse(e: BodyTooLarge, scope: dict, receive: Any, send: Any) -> None:
        from fastapi.responses import JSONResponse

        # Connection: close, so the server need not read the rest of a body nobody wants.
        headers = {"Connection": "close"}
        body = body_for(scope, e.status, e.message, type=e.type, code=e.code)
        await JSONResponse(body, status_code=e.status, headers=headers)(scope, receive, send)
