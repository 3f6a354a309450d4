"""The API's defaults, shared by `mtpipe serve`, `mtpipe launch` and cluster.yaml without importing the app."""

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MODEL_NAME = "mtpipe"
DEFAULT_MAX_TOKENS = 256
DEFAULT_MAX_CONCURRENCY = 32  # generations at once; more wait their turn (a stage holds 64 sequences)
SLOT_TIMEOUT_S = 60.0  # how long a request waits for one of those, then 503 (as the engines' own queues do)
API_KEY_ENV = "MTPIPE_API_KEY"
DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # larger request bodies are refused with 413
DEFAULT_CORS_ORIGINS = ("*",)  # web pages that may call the API from a browser (as mlx-lm's and vLLM's allow)
STALL_TIMEOUT_S = 120.0  # an engine in one round (or silent) this long is stuck: its requests fail, the API stops


def check_origins(origins: list[str]) -> list[str]:
    """CORS origins as a browser sends them: "*" (any) or scheme://host[:port], without a trailing slash."""
    out = [o.strip().rstrip("/") for o in origins]
    bad = [o for o in out if o != "*" and ("://" not in o or o.split("://", 1)[1] in ("", "*"))]
    if bad:
        raise ValueError(f"expected '*' or origins such as http://localhost:3000, got {', '.join(map(repr, bad))}")
    return out
