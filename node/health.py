"""A node's Health reply: what it holds, how it is doing, what is wrong with it now and since when."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from .. import __version__
from ..proto import mtpipe_pb2 as pb
from .sysinfo import gpu_limit, mlx_active_memory, system_memory

if TYPE_CHECKING:
    from .service import NodeService


async def health_reply(node: NodeService, probe_next: bool) -> pb.HealthReply:
    gpu_limit()  # asks MLX once, cached: here on the node's MLX thread, not on the executor's
    active = mlx_active_memory()  # (likewise)
    loop = asyncio.get_running_loop()
    used, available = await loop.run_in_executor(None, system_memory, active)
    offered = await loop.run_in_executor(None, node.memory_offered) if node.memory_offered is not None else 0
    condition = node.conditions.current()
    reply = pb.HealthReply(
        node_id=node.node_id,
        version=__version__,
        memory_used=used,
        memory_available=available,
        memory_offered=offered,
        mlx_active_memory=active,
        uptime_s=time.monotonic() - node.started,
        last_error=condition[0] if condition else "",
        last_error_at=condition[1] if condition else 0.0,
        next_rtt_ms=-1.0,
        forwarded_frames=node.link_stats.frames,
        forwarded_bytes=node.link_stats.bytes,
        forwarded_decode_frames=node.link_stats.decode_frames,
        forwarded_decode_bytes=node.link_stats.decode_bytes,
        ring=node.ring.target if node.ring is not None else ("self" if node.ring_self else ""),
        ring_frames=node.ring_stats.frames,
        ring_bytes=node.ring_stats.bytes,
        data_port=node.data_port,
        next_transport=node.next.transport if node.next is not None else "",
        blas=node.blas.name,
        blas_optimized=node.blas.optimized,
        blas_threads=node.blas.threads or 0,
        placed=list(node.placed),
        placed_at=list(node.placed.values()),
    )
    reply.MergeFrom(node.weights.health())
    w, key = node.worker, node.key
    if w is not None and key is not None:
        fixed, per_row = w.stats.rounds.line()
        reply.MergeFrom(
            pb.HealthReply(
                loaded=True,
                model_path=key.model_path,
                start=key.start,
                end=key.end,
                num_layers=key.num_layers,
                is_first=w.spec.is_first,
                is_last=w.spec.is_last,
                parameter_bytes=w.shard.model.parameter_bytes(),
                active_sequences=len(w.sequences) + (node.ring_groups.rows if not w.overlap else 0),
                tokens_processed=w.stats.tokens_processed,
                steps=w.stats.steps,
                mean_step_ms=w.stats.mean_step_ms,
                round_fixed_ms=1000.0 * fixed,
                round_row_ms=1000.0 * per_row,
                prefill_tokens=w.stats.prefill_tokens,
                prefill_seconds=w.stats.prefill_seconds,
                dtype=node._dtype_name(),
                has_mtp=w.shard.has_mtp,
                kept_prefixes=len(w.prefixes),
                kept_prefix_bytes=sum(p.nbytes for p in w.prefixes.values()),
            )
        )
    if node.next is not None:
        reply.next = node.next.target
        if probe_next:
            reply.next_rtt_ms = await node.next.ping_ms()
    return reply
