"""A node's Health reply: what it holds, how it is doing, what is wrong with it now and since when."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import __version__
from ..proto import mtpipe_pb2 as pb
from .sysinfo import gpu_limit, machine_id, mlx_active_memory, system_memory

if TYPE_CHECKING:
    from .service import NodeService


MEMORY_FRESH_S = 2.0  # a memory reading this old is answered as it is while a new one is taken


class MemoryReadings:
    """(used, available, offered) bytes for Health. Reading them blocks (psutil, sysctl), so it runs on
    the executor, and on a node whose loop runs steps back to back (a long prompt's chunks) each await
    waits out a step: after the first, the last reading is answered at once, and a new one is taken
    beside it once that is MEMORY_FRESH_S old. Health then answers in one turn of the loop."""

    def __init__(self, offered: Callable[[], int] | None):
        self.offered = offered
        self._last: tuple[float, tuple[int, int, int]] | None = None
        self._task: asyncio.Task | None = None

    async def get(self, active: int) -> tuple[int, int, int]:
        if self._last is None:
            return await self._refresh(active)
        if time.monotonic() - self._last[0] > MEMORY_FRESH_S and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._refresh(active))
        return self._last[1]

    async def _refresh(self, active: int) -> tuple[int, int, int]:
        value = await asyncio.get_running_loop().run_in_executor(None, self._read, active)
        self._last = (time.monotonic(), value)
        return value

    def _read(self, active: int) -> tuple[int, int, int]:
        used, available = system_memory(active)
        return used, available, self.offered() if self.offered is not None else 0


async def health_reply(node: NodeService, probe_next: bool) -> pb.HealthReply:
    gpu_limit()  # asks MLX once, cached: here on the node's MLX thread, not on the executor's
    active = mlx_active_memory()  # (likewise)
    if node.memory_readings is None or node.memory_readings.offered is not node.memory_offered:
        # (re-made when `mtpipe launch` sets what it offers: a reading from before would not hold it)
        node.memory_readings = MemoryReadings(node.memory_offered)
    used, available, offered = await node.memory_readings.get(active)
    condition = node.conditions.current()
    reply = pb.HealthReply(
        node_id=node.node_id,
        version=__version__,
        machine=machine_id(),
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
        term=node.coordinators.claim.term,
        term_holder=node.coordinators.claim.holder,
        placed_at=list(node.placed.values()),
        coordinators=sum(node.coordinators.admits(c) for c in node.subscribed),  # (not those taken over here)
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
