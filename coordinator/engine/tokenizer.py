"""A model's tokenizer, as mlx-lm loads it (with its streaming detokenizer); apart from the engines so
that the API's process of its own loads it without a model's code."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(model_path: Path | str, eos_token_ids: list[int]) -> Any:
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    return mlx_load_tokenizer(Path(model_path), eos_token_ids=eos_token_ids or None)
