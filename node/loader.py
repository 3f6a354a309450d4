"""A node's shard, loaded on the node's event-loop thread, which is the node's one MLX thread.

MLX arrays belong to the thread (stream) that built them, so the shard is read and materialized on
the loop thread itself, not on a side thread. To keep the loop serving while a large shard loads,
the shard is built lazily (`mx.load` reads nothing until evaluated) and then evaluated a slice of
tensors at a time, yielding to the loop between slices: Ping, Health and the other nodes' calls are
answered between slices, each a fraction of a second of disk reading.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .stage import StageWorker

log = logging.getLogger(__name__)

PIECE_BYTES = 128 << 20  # evaluated between two turns of the loop
DTYPES = ("float32", "float16", "bfloat16")


@dataclass
class LoadKey:
    model_path: str
    start: int
    end: int
    num_layers: int
    mtp: bool
    dtype: str
    fingerprint: str = ""  # the model's identity (models/fingerprint.py); "" = the path's files as they are
    ring_groups: bool = False  # the whole model run as ring groups, not a sequence at a time (LoadRequest)


def same_shard(a: LoadKey, b: LoadKey) -> bool:
    """The same layers of the same model: a model named by its fingerprint may be at another path."""
    return a == b or bool(a.fingerprint) and replace(a, model_path="") == replace(b, model_path="")


def pieces(arrays: list[Any], limit: int) -> Iterator[list[Any]]:
    """Consecutive groups of arrays of at most `limit` bytes (an array larger than that alone)."""
    group: list[Any] = []
    size = 0
    for a in arrays:
        if group and size + a.nbytes > limit:
            yield group
            group, size = [], 0
        group.append(a)
        size += a.nbytes
    if group:
        yield group


@dataclass(frozen=True)
class ShardLoad:
    """A Load request checked against the model it names (`check_load`): what `load_stage` reads."""

    model_path: str
    spec: Any  # models.shard.ShardSpec
    mtp: bool
    dtype: Any  # an mx.Dtype, or None: as stored
    ring_groups: bool = False  # as LoadKey's


def check_load(key: LoadKey) -> ShardLoad:
    """Everything about a Load that can be checked without reading weights (dtype, layer range, the
    model's layer count), so a node refuses a bad one before it drops the shard it serves. Raises
    ValueError, FileNotFoundError or KeyError."""
    import mlx.core as mx

    from ..models.loading import shard_config
    from ..models.shard import ShardSpec

    if key.dtype and key.dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {key.dtype!r}")
    spec = ShardSpec(key.start, key.end, key.num_layers)
    shard_config(key.model_path, spec)
    return ShardLoad(key.model_path, spec, key.mtp, getattr(mx, key.dtype) if key.dtype else None,
                     ring_groups=key.ring_groups)


async def load_stage(load: ShardLoad, piece_bytes: int = PIECE_BYTES, draft_vocab: int | None = None,
                     mtp_window: int | None = None) -> StageWorker:
    """Load a checked shard on the calling loop's thread, yielding to the loop between pieces.

    Raises ValueError (a bad checkpoint), FileNotFoundError or KeyError for one the node cannot serve."""
    import mlx.core as mx

    from ..models.loading import arrays_in, load_shard
    from .stage import StageWorker

    mx.clear_cache()  # the caller dropped its old shard: give its memory back before reading
    shard = load_shard(load.model_path, load.spec, mtp=load.mtp, dtype=load.dtype, materialize=False)
    # Every array reachable from the model (parameters and private tables), in model order.
    arrays = arrays_in(shard.model)
    n = 0
    for group in pieces(arrays, piece_bytes):
        mx.eval(group)
        n += 1
        await asyncio.sleep(0)
    log.debug("materialized %d arrays in %d pieces", len(arrays), n)
    # (a whole model otherwise runs a sequence at a time, its verifies queued behind its drafts)
    return StageWorker(shard, draft_vocab=draft_vocab, mtp_window=mtp_window, overlap=not load.ring_groups)
