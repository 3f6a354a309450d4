"""The API's defaults, shared by `mtpipe serve`, `mtpipe launch` and cluster.yaml without importing the app."""

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MODEL_NAME = "mtpipe"
DEFAULT_MAX_TOKENS = 32768  # a request without max_tokens (and a model without max_new_tokens): Qwen's advice
DEFAULT_MAX_CONCURRENCY = 32  # generations at once; more wait their turn (a stage holds 64 sequences)
SLOT_TIMEOUT_S = 60.0  # how long a request waits for one of those, then 503 (as the engines' own queues do)
API_KEY_ENV = "MTPIPE_API_KEY"
DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # larger request bodies are refused with 413
DEFAULT_CORS_ORIGINS = ("*",)  # web pages that may call the API from a browser (as mlx-lm's and vLLM's allow)
STALL_TIMEOUT_S = 120.0  # an engine in one round (or silent) this long is stuck: its requests fail, the API stops


def check_origins(origins: list[str] | str) -> list[str]:
    """CORS origins as a browser sends them (compared as exact strings): "*" (any), or http(s)://host[:port]
    with no path, in lower case. A string is a comma-separated list; "none" (or an empty list): no origin,
    only the API's own."""
    from urllib.parse import urlsplit

    if isinstance(origins, str):
        origins = [o for o in origins.split(",") if o.strip()] or [origins]
    elif not origins:
        return []
    if [o.strip().lower() for o in origins] == ["none"]:
        return []
    out, bad = [], []
    for raw in origins:
        origin = raw.strip()
        try:
            parts = urlsplit(origin)
            parts.port  # (a port that is not one raises)
        except ValueError:
            parts = None
        if origin == "*":
            out.append(origin)
        elif (parts is None or parts.scheme.lower() not in ("http", "https") or not parts.hostname
              or "*" in parts.netloc or "@" in parts.netloc or parts.path not in ("", "/") or parts.query
              or parts.fragment):
            bad.append(raw)
        else:  # (a browser leaves out the scheme's own port)
            default = {"http": 80, "https": 443}[parts.scheme.lower()]
            host = parts.netloc.rsplit(":", 1)[0] if parts.port == default else parts.netloc
            out.append(f"{parts.scheme}://{host}".lower())
    if bad or not out:
        got = ", ".join(map(repr, bad or origins)) or "nothing"
        raise ValueError(f"expected '*', 'none' or origins such as http://localhost:3000, got {got}")
    return out
