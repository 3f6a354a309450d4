"""What ends a request, from its body: stop strings, and vLLM's stop_token_ids and min_tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import APIError

if TYPE_CHECKING:
    from .models import _GenerationBody

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64


def stops(body: _GenerationBody) -> tuple[list[str], list[int]]:
    """The body's stop strings and stop token ids (the engine checks the ids against the vocabulary; its
    sampling holds them, EOS and stop strings back for `min_tokens`)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
    ids = list(body.stop_token_ids or [])
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise APIError(400, f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(ids)}", param="stop_token_ids")
    return stop, ids
