"""The API's defaults, shared by `mtpipe serve`, `mtpipe launch` and cluster.yaml without importing the app."""

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MODEL_NAME = "mtpipe"
DEFAULT_MAX_TOKENS = 256
DEFAULT_MAX_CONCURRENCY = 32  # generations at once; more wait their turn (a stage holds 64 sequences)
SLOT_TIMEOUT_S = 60.0  # how long a request waits for one of those, then 503 (as the engines' own queues do)
API_KEY_ENV = "MTPIPE_API_KEY"
DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # larger request bodies are refused with 413
STALL_TIMEOUT_S = 120.0  # an engine in one round (or silent) this long is stuck: its requests fail, the API stops
