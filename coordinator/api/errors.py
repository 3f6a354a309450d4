"""OpenAI-shaped errors for the REST API, and request bodies parsed into them."""

import asyncio
import logging
from typing import Any, Optional

log = logging.getLogger(__name__)

INLINE_PARSE_BYTES = 64 * 1024  # larger bodies are parsed on a worker thread, not on the event loop


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


ANTHROPIC_PATHS = "/v1/messages"  # (and below it): errors in Anthropic's shape
SHARED_PATHS = "/v1/models"  # (and below it): Anthropic's shape for callers that send its version header
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def anthropic_caller(scope: dict[str, Any]) -> bool:
    """Whether a request (its ASGI scope) is answered in Anthropic's shapes: anything under /v1/messages, and
    the model listing both APIs share when the caller sends `anthropic-version`, as Anthropic's clients do."""
    path = scope["path"]
    if path.startswith(ANTHROPIC_PATHS):
        return True
    return path.startswith(SHARED_PATHS) and any(name == b"anthropic-version" for name, _ in scope.get("headers") or ())


def body_for(scope: dict[str, Any], status: int, message: str, **fields: Any) -> dict[str, Any]:
    """An error body in the shape the request's clients read (its ASGI scope): Anthropic's for Anthropic's
    callers (`anthropic_caller`), else OpenAI's."""
    if anthropic_caller(scope):
        return anthropic_body(status, message)
    return error_body(message, **fields)


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 type: str = "invalid_request_error", headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


_UNION_TAGS = {"str", "int", "float", "bool", "none"}


def field_path(loc: tuple) -> str:
    """A pydantic error location as `messages[0].content`, without union member tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _UNION_TAGS:
            continue
        else:
            out += f".{part}" if out else part
    return out


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The first three problems, as `messages[0].role: Input should be ...; ...`."""
    parts = []
    for err in errors[:3]:
        where = field_path(tuple(err.get("loc", ())))
        parts.append(f"{where}: {err['msg']}" if where else err["msg"])
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    first = errors[0]
    param = next((p for p in first.get("loc", ()) if isinstance(p, str) and p != "body"), None)
    return APIError(400, "; ".join(parts) + more, param=param, code=first.get("type"))


async def parse_body(request: Any, cls: type) -> Any:
    """The request's JSON body as `cls`: 400 for invalid JSON and for a body of the wrong shape."""
    from pydantic import ValidationError

    raw = await request.body()
    try:
        if len(raw) > INLINE_PARSE_BYTES:  # megabytes of JSON take the loop from every other request
            return await asyncio.to_thread(cls.model_validate_json, raw)
        return cls.model_validate_json(raw)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        if any(err["type"] == "json_invalid" for err in errors):
            message = f"the request body is not valid JSON: {errors[0]['msg']}"
            raise APIError(400, message, code="invalid_json") from None
        if errors[0]["type"] == "model_type" and not errors[0].get("loc"):
            raise APIError(400, "the request body must be a JSON object", code="invalid_type") from None
        raise validation_error(errors) from None


class Watched:
    """An ASGI `send` that notes whether the response began: an error after that can only cut it."""

    def __init__(self, send: Any):
        self.send, self.started = send, False

    async def __call__(self, message: dict) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self.send(message)


class Unhandled:
    """ASGI middleware: an error no route answered is a 500 in the path's error shape, logged, and the
    connection stays open. (Starlette's own last-resort handler answers it too, but then raises it again,
    and uvicorn closes the connection without a word: a pooled client's next request meets a reset.) An
    error after a response began is left to the server, which can only cut that response."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sending = Watched(send)
        try:
            await self.app(scope, receive, sending)
        except Exception as e:
            if sending.started:
                raise
            from starlette.responses import JSONResponse

            log.error("unhandled error on %s", scope.get("path", ""), exc_info=e)
            body = body_for(scope, 500, f"internal error: {type(e).__name__}", type="server_error", code="internal_error")
            await JSONResponse(body, status_code=500)(scope, receive, send)
