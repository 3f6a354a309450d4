"""Building an engine: over in-process stages on this machine, or over running nodes."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ...models.config import load_config
from ...models.shard import ShardSpec
from ...node.constraints import grammars_for
from ...node.sysinfo import sharing
from ..pipeline.local import even_split, local_pipeline
from .batch import BatchEngine
from .engine import DEFAULT_PREFILL_CHUNK, Engine
from .ring import DEFAULT_MAX_ROWS as RING_MAX_ROWS
from .ring import RESUME_WINDOW_S, RingEngine
from .ring_room import DTYPE_SIZES, RingRoom
from .scheduler import ADMIT_HORIZON, ModelDims
from .tokenizer import load_tokenizer

log = logging.getLogger(__name__)

RING_PREFIX_CACHE_SHARE = 8  # a quarter of the half of its memory a node's batch engine would take


def local_engine(
    model_path: Path | str, *, stages: int = 1, mtp: bool = True, dtype: Any = None, **pipeline_options: Any
) -> Engine:
    """Single-machine engine: the same engine over in-process stages."""
    config = load_config(Path(model_path))
    tokenizer = load_tokenizer(model_path, config.eos_token_ids)
    pipeline = local_pipeline(model_path, stages=stages, mtp=mtp, dtype=dtype, **pipeline_options)
    has_mtp = pipeline.stages[-1].shard.has_mtp
    pipeline.stages[-1].head.grammars = grammars_for(tokenizer, config.args.vocab_size, tokenizer.eos_token_ids)
    return Engine(pipeline, tokenizer, set(tokenizer.eos_token_ids), config.args.max_position_embeddings, has_mtp,
                  vocab_size=config.args.vocab_size)


def batch_engine(
    model_path: Path | str,
    *,
    stages: int = 1,
    mtp: bool = True,
    dtype: Any = None,
    mtp_pre_norm: bool = False,
    progress: Any = None,
    memory_budget: int | None = None,
    memory_cap: int | None = None,
    draft_vocab: int | None = None,
    mtp_window: int | None = None,
    **options: Any,
) -> BatchEngine:
    """Single-machine engine that batches every active sequence, on one MLX thread that also loads. Its
    caches may hold `memory_budget` bytes: by default half the memory free once the model is loaded,
    within `memory_cap` bytes for the weights and the caches where one is given (`mtpipe launch`'s
    --max-memory)."""
    from ...models.loading import load_shard
    from ...models.mlx_thread import MLXThread
    from ...models.ragged import CAPACITY_STEP
    from ...node.batch import BatchStage
    from ...node.stage import StageWorker
    from ...node.sysinfo import system_memory
    from ..pipeline.local import even_split

    config = load_config(Path(model_path))
    tokenizer = load_tokenizer(model_path, config.eos_token_ids)
    thread = MLXThread("mlx-engine")

    def build() -> list[BatchStage]:
        import mlx.core as mx

        from ...models.loading import arrays_in

        out = []
        for spec in even_split(config.num_layers, stages):
            shard = load_shard(model_path, spec, mtp=mtp, dtype=dtype, progress=progress)
            mx.eval(arrays_in(shard.model))
            out.append(BatchStage(StageWorker(shard, mtp_pre_norm=mtp_pre_norm, overlap=False, draft_vocab=draft_vocab,
                                              mtp_window=mtp_window)))
        return out

    try:
        built = thread.call(build)
    except BaseException:
        thread.close()
        raise
    last = built[-1].worker
    has_mtp = last.shard.has_mtp
    last.head.grammars = grammars_for(tokenizer, config.args.vocab_size, tokenizer.eos_token_ids)
    dims = ModelDims.of(config.args, itemsize=last.dtype.size, mtp=has_mtp, kv_step=CAPACITY_STEP)
    if memory_budget is None:
        def room() -> int:  # (MLX's memory and the weights' arrays, asked on its thread)
            free = system_memory()[1]
            weights = sum(s.worker.shard.model.parameter_bytes() for s in built)
            return free if memory_cap is None else min(free, max(0, memory_cap - weights))

        memory_budget = max(thread.call(room) // 2, 256 * 2**20)
    return BatchEngine(built, tokenizer, set(tokenizer.eos_token_ids), config.args.max_position_embeddings, has_mtp,
                       thread, dims=dims, budget=memory_budget, **options)


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
    """The same Engine as single-node mode, over `nodes` in pipeline order (even split by default):
    one sequence at a time per caller, each round its own trip around the nodes."""
    pipeline, tokenizer, config = _load_remote(model_path, nodes, mtp, secret, specs, dtype, pipeline_options)
    return Engine(
        pipeline,
        tokenizer,
        set(tokenizer.eos_token_ids),
        config.args.max_position_embeddings,
        has_mtp=pipeline.load_replies[-1].has_mtp,
        prefill_chunk=fit_prefill_chunk(config.args.hidden_size),
        vocab_size=config.args.vocab_size,
    )


def ring_engine(
    model_path: Path | str,
    nodes: list[str],
    mtp: bool = True,
    secret: str | None = None,
    *,
    specs: list[ShardSpec] | None = None,
    dtype: str | None = None,
    groups: int | None = None,
    max_rows: int = RING_MAX_ROWS,
    resume_window: float = RESUME_WINDOW_S,
    prefix_cache: int | None = None,
    memory_budget: int | None = None,
    horizon: int | None = ADMIT_HORIZON,
    **pipeline_options: Any,
) -> RingEngine | Engine:
    """Many sequences over `nodes`, in groups whose rounds circle the nodes (engine/ring.py). One node,
    or a last node that cannot reach the first, has no ring: the per-sequence Engine then. Prompt
    prefixes kept on the nodes take up to `prefix_cache` bytes over all of them (by default an eighth
    of the memory the node with least available has, its share where nodes share a machine, times the
    nodes; 0: none kept). Each node's rows may hold `memory_budget` bytes (by default half the memory it
    has free, or its share of it, less its share of prefixes)."""
    # (a pipeline of several nodes that loses all but one to a heal runs its groups on that one)
    pipeline_options.setdefault("ring_groups", len(nodes) > 1)
    pipeline, tokenizer, config = _load_remote(model_path, nodes, mtp, secret, specs, dtype, pipeline_options)
    eos, context, has_mtp = set(tokenizer.eos_token_ids), config.args.max_position_embeddings, \
        pipeline.load_replies[-1].has_mtp
    chunk = fit_prefill_chunk(config.args.hidden_size)
    if not pipeline.rings:
        log.warning("no ring groups over %d node(s) (%s): one sequence per round", len(nodes),
                    "one node" if len(nodes) == 1 else "the last node cannot reach the first")
        pipeline.ring_groups = False  # (one node left after a heal runs a sequence at a time, as it does best)
        if memory_budget is not None:
            log.warning("--memory-budget is not used: one sequence at a time needs no admission")
        return Engine(pipeline, tokenizer, eos, context, has_mtp, prefill_chunk=chunk, vocab_size=config.args.vocab_size)
    health = pipeline.health()
    if prefix_cache is None:
        shares = zip(health, sharing([h.machine for h in health]))
        prefix_cache = len(nodes) * min(h.memory_available // n for h, n in shares) // RING_PREFIX_CACHE_SHARE
    dims = ModelDims.of(config.args, itemsize=DTYPE_SIZES.get(health[-1].dtype, 2), mtp=has_mtp)
    from ...models.ragged import CAPACITY_STEP  # (the nodes' batches grow by it)

    room = RingRoom(config.args, has_mtp, max_rows=max_rows, horizon=horizon, budget=memory_budget,
                    prefix_share=prefix_cache // len(nodes), kv_step=CAPACITY_STEP)
    room.measure(health)
    return RingEngine(pipeline, tokenizer, eos, context, has_mtp, config.args.vocab_size, prefill_chunk=chunk,
                      groups=groups, room=room, resume_window=resume_window, dims=dims, prefix_cache=prefix_cache)


def _load_remote(model_path: Path | str, nodes: list[str], mtp: bool, secret: str | None,
                 specs: list[ShardSpec] | None, dtype: str | None, options: dict[str, Any]) -> tuple[Any, Any, Any]:
    from ..pipeline.remote import RemotePipeline

    config = load_config(Path(model_path))
    specs = specs or even_split(config.num_layers, len(nodes))
    pipeline = RemotePipeline(nodes, secret=secret, **options)
    try:
        pipeline.load(model_path, specs, mtp=mtp, dtype=dtype)
        tokenizer = load_tokenizer(model_path, config.eos_token_ids)
    except BaseException:
        pipeline.close()
        raise
    return pipeline, tokenizer, config
