"""Building an engine: over in-process stages on this machine, or over running nodes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...models.config import load_config
from ...models.shard import ShardSpec
from ..pipeline.local import even_split, local_pipeline
from .engine import DEFAULT_PREFILL_CHUNK, Engine


def load_tokenizer(model_path: Path | str, eos_token_ids: list[int]) -> Any:
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    return mlx_load_tokenizer(Path(model_path), eos_token_ids=eos_token_ids or None)


def local_engine(
    model_path: Path | str, *, stages: int = 1, mtp: bool = True, dtype: Any = None, **pipeline_options: Any
) -> Engine:
    """Single-machine engine: the same engine over in-process stages."""
    config = load_config(Path(model_path))
    tokenizer = load_tokenizer(model_path, config.eos_token_ids)
    pipeline = local_pipeline(model_path, stages=stages, mtp=mtp, dtype=dtype, **pipeline_options)
    has_mtp = pipeline.stages[-1].shard.has_mtp
    return Engine(pipeline, tokenizer, set(tokenizer.eos_token_ids), config.args.max_position_embeddings, has_mtp)


def fit_prefill_chunk(hidden_size: int, chunk: int = DEFAULT_PREFILL_CHUNK, itemsize: int = 4) -> int:
    """The largest prefill chunk whose hidden states fit a message (with a quarter kept for the frame)."""
    from ...node.wire import MAX_MESSAGE_BYTES

    return max(1, min(chunk, (MAX_MESSAGE_BYTES * 3 // 4) // (hidden_size * itemsize)))


def remote_engine(
    model_path: Path | str,
    nodes: list[str],
    mtp: bool = True,
    secret: str | None = None,
    *,
    specs: list[ShardSpec] | None = None,
    dtype: str | None = None,
    **pipeline_options: Any,
) -> Engine:
    """The same Engine as single-node mode, over `nodes` in pipeline order (even split by default)."""
    from ..pipeline.remote import RemotePipeline

    config = load_config(Path(model_path))
    specs = specs or even_split(config.num_layers, len(nodes))
    pipeline = RemotePipeline(nodes, secret=secret, **pipeline_options)
    try:
        replies = pipeline.load(model_path, specs, mtp=mtp, dtype=dtype)
        tokenizer = load_tokenizer(model_path, config.eos_token_ids)
    except BaseException:
        pipeline.close()
        raise
    hidden = config.args.hidden_size
    return Engine(
        pipeline,
        tokenizer,
        set(tokenizer.eos_token_ids),
        config.args.max_position_embeddings,
        has_mtp=replies[-1].has_mtp,
        prefill_chunk=fit_prefill_chunk(hidden),
    )
