"""A model's tokenizer, as mlx-lm loads it (with its streaming detokenizer); apart from the engines so
that the API's process of its own loads it without a model's code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...models.fingerprint import TOKENIZER_SOURCES

UNLIMITED = int(1e30)  # transformers' own "no limit" model_max_length


def load_tokenizer(model_path: Path | str, eos_token_ids: list[int]) -> Any:
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    path = Path(model_path)
    if not any((path / name).exists() for name in TOKENIZER_SOURCES):
        raise FileNotFoundError(f"no tokenizer in {path} (none of {', '.join(TOKENIZER_SOURCES)})")
    tokenizer = mlx_load_tokenizer(path, eos_token_ids=eos_token_ids or None)
    # The engine checks lengths against the model's context itself: transformers' warning about a text longer
    # than the tokenizer's model_max_length would come before that clear error, and name another limit.
    tokenizer._tokenizer.model_max_length = UNLIMITED
    return tokenizer
