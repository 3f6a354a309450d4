"""A forward over many sequences at once, each at its own length and with its own number of new tokens.

Rows are padded to the longest input of the round, so every matmul reads the weights once for the
whole batch. Attention keeps each row's keys at the row's own offset (`RaggedKV`): a row's entries
past its length are never visible to its queries (the mask), so padding writes there harmlessly and
trimming a row after a rejected draft is only lowering its length. GatedDeltaNet layers keep the
state after every position (gdn_snapshots.py), so each row takes the state at its own last real
position, and later at its own accepted position.
"""

from __future__ import annotations

import functools
import itertools
import threading
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from .attention import attention_layer
from .gdn_snapshots import CompiledLayers, GDNSnapshots, gdn_layer

CAPACITY_STEP = 256


class RaggedKV:
    """Keys and values of one attention layer for B rows, [B, heads, capacity, dim] as attention reads
    them; each row writes its new entries at its own offset in one scatter."""

    def __init__(self, keys: mx.array | None = None, values: mx.array | None = None, lengths: list[int] | None = None):
        self.keys = keys
        self.values = values
        self.lengths = list(lengths or [])

    @classmethod
    def from_cache(cls, cache: KVCache, length: int | None = None) -> RaggedKV:
        """One row from mlx-lm's single-sequence cache ([1, heads, positions, dim]); `length` keeps a prefix."""
        n = cache.offset if length is None else length
        if cache.keys is None or n == 0:
            return cls(None, None, [0])
        return cls(cache.keys[:, :, :n], cache.values[:, :, :n], [n])

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def offsets(self) -> int | mx.array:
        """Each row's next position: one number when the rows are level (then writes are a slice)."""
        first = self.lengths[0]
        return first if all(n == first for n in self.lengths) else _index(tuple(self.lengths), 0, 0, _thread())[0]

    def update(self, keys: mx.array, values: mx.array, real: list[int],
               window: int | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """Write new entries [B, T, heads, dim] at each row's length; row i keeps `real[i]` of them.
        Returns keys and values as [B, heads, L, dim] and the mask [B, 1, T, L] for the queries. With
        a `window`, each query reads only itself and the `window` entries before it (`sliding_mask`),
        and keys before every adding row's window are not read at all (rows adding nothing, whose
        outputs nobody reads, may then see other keys than their own)."""
        T = keys.shape[1]
        need = max(self.lengths) + T
        if need > self.capacity:
            self._grow(need, keys)
        level = self.offsets()
        start, adding = 0, []
        if window:  # (every attention layer of a batch forward comes here: nothing to do without one)
            adding = [n for n, r in zip(self.lengths, real) if r]
            start = max(0, min(adding) - window) if adding else 0
        if isinstance(level, int):  # every row at the same length: a slice, and a causal mask at most
            self.keys[:, :, level:need] = keys.transpose(0, 2, 1, 3)
            self.values[:, :, level:need] = values.transpose(0, 2, 1, 3)
            mask: mx.array | str | None = "causal" if T > 1 else None  # (aligned to the keys' end)
            if window and T > 1 and level + T - 1 > window:  # some query's window leaves out early keys
                mask = sliding_mask(level + mx.arange(T, dtype=mx.int32), start, need, window)
        else:
            _, rows, positions, mask = _index(tuple(self.lengths), T, need, _thread())
            self.keys[rows, :, positions] = keys  # (the indexed view is [B, T, heads, dim])
            self.values[rows, :, positions] = values
            if window:
                mask = sliding_mask(positions[:, None], start, need, window)
                if len(adding) < len(real):  # a row past every window start sees something: no NaN
                    mask = mask | mx.array([r == 0 for r in real])[:, None, None, None]
        self.lengths = [n + r for n, r in zip(self.lengths, real)]
        return self.keys[:, :, start:need], self.values[:, :, start:need], mask

    def _grow(self, need: int, like: mx.array) -> None:
        size = -(-need // CAPACITY_STEP) * CAPACITY_STEP
        heads, dim = like.shape[2:]
        shape = (len(self.lengths), heads, size - self.capacity, dim)
        pad = mx.zeros(shape, like.dtype)
        if self.keys is None:
            self.keys, self.values = pad, mx.zeros(shape, like.dtype)
        else:
            self.keys = mx.concatenate([self.keys, pad], axis=2)
            self.values = mx.concatenate([self.values, pad], axis=2)

    def trim(self, amounts: list[int]) -> None:
        self.lengths = [n - t for n, t in zip(self.lengths, amounts)]

    def take(self, rows: list[int]) -> RaggedKV:
        """The given rows, in that order, as long as the longest of them needs (a long row that left
        takes its share of the memory with it)."""
        lengths = [self.lengths[i] for i in rows]
        size = -(-max(lengths, default=0) // CAPACITY_STEP) * CAPACITY_STEP
        if self.keys is None or size == 0:
            return RaggedKV(None, None, lengths)
        index = mx.array(rows, dtype=mx.int32)
        if size < self.capacity:
            return RaggedKV(self.keys[index, :, :size], self.values[index, :, :size], lengths)
        return RaggedKV(self.keys[index], self.values[index], lengths)

    def row(self, i: int) -> tuple[mx.array, mx.array]:
        """Row i's valid keys and values as [1, heads, length, dim] (what a single-sequence cache holds)."""
        n = self.lengths[i]
        return self.keys[i : i + 1, :, :n], self.values[i : i + 1, :, :n]

    @staticmethod
    def concat(parts: list[RaggedKV]) -> RaggedKV:
        lengths = [n for p in parts for n in p.lengths]
        filled = [p for p in parts if p.keys is not None]
        if not filled:
            return RaggedKV(None, None, lengths)
        size = max(p.capacity for p in filled)
        like = filled[0].keys
        keys, values = [], []
        for p in parts:
            if p.keys is None:
                shape = (p.rows, like.shape[1], size, like.shape[3])
                keys.append(mx.zeros(shape, like.dtype))
                values.append(mx.zeros(shape, like.dtype))
                continue
            pad = [(0, 0), (0, 0), (0, size - p.capacity), (0, 0)]
            keys.append(mx.pad(p.keys, pad) if p.capacity < size else p.keys)
            values.append(mx.pad(p.values, pad) if p.capacity < size else p.values)
        return RaggedKV(mx.concatenate(keys), mx.concatenate(values), lengths)


@functools.lru_cache(maxsize=4)
def _index(lengths: tuple[int, ...], T: int, need: int, thread: int) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Row offsets, the scatter indices of T new entries per row and the mask of their queries; kept
    for the round's other attention layers, which see the same lengths (per thread: arrays belong to
    the thread that made them until evaluated)."""
    offsets = mx.array(lengths, dtype=mx.int32)
    positions = offsets[:, None] + mx.arange(T, dtype=mx.int32)[None, :]
    rows = mx.broadcast_to(mx.arange(len(lengths), dtype=mx.int32)[:, None], (len(lengths), T))
    mask = mx.arange(need, dtype=mx.int32)[None, None, None, :] <= positions[:, None, :, None]
    return offsets, rows, positions, mask


def sliding_mask(positions: mx.array, start: int, end: int, window: int) -> mx.array:
    """Which keys, at positions start..end-1, queries at `positions` ([..., T]) read: each its own and
    the `window` before it, wherever a call's queries begin. Shape [..., T, end - start]."""
    keys = mx.arange(start, end, dtype=mx.int32)
    queries = positions[..., None]
    return (keys <= queries) & (keys >= queries - window)


_serials = itertools.count()
_local = threading.local()


def _thread() -> int:
    """This thread's own number, never another's (the ids of threads that ended are given out again)."""
    serial = getattr(_local, "serial", None)
    if serial is None:
        serial = _local.serial = next(_serials)
    return serial


def ragged_layer(
    layer: Any, h: mx.array, cache: Any, real: list[int], compiled: CompiledLayers | None = None,
    window: int | None = None,
) -> tuple[mx.array, GDNSnapshots | None]:
    """One decoder layer over padded rows; GatedDeltaNet layers end at each row's last real position.
    With `compiled`, decode and verify inputs run compiled where that applies (on the CPU)."""
    if layer.is_linear:
        h, snaps = gdn_layer(layer, h, cache, compiled)
        if any(t != h.shape[1] for t in real):
            restore_rows(snaps, cache, [t - 1 for t in real])
        return h, snaps
    return attention_layer(layer, h, cache.offsets(), functools.partial(cache.update, real=real, window=window), compiled), None


def restore_rows(snaps: GDNSnapshots, cache: ArraysCache, positions: list[int]) -> None:
    """Each row's GatedDeltaNet state and conv window after its own position (rows of one forward).
    Rows next to each other at one position are sliced out of that position's snapshot together:
    gathering from a stack of every position's states costs several times more on the CPU."""
    if all(p == positions[0] for p in positions):
        snaps.restore(cache, positions[0])
        return
    runs: list[list[int]] = []  # [position, first row, row past the last]
    for i, p in enumerate(positions):
        if runs and runs[-1][0] == p:
            runs[-1][2] = i + 1
        else:
            runs.append([p, i, i + 1])
    cache[1] = mx.concatenate([snaps.states[p][a:b] for p, a, b in runs])
    cache[0] = mx.concatenate([snaps.conv_input[a:b, p + 1 : p + snaps.kernel] for p, a, b in runs])


def pad_rows(rows: list[list[int]], fill: int = 0) -> mx.array:
    width = max(len(r) for r in rows)
    return mx.array([r + [fill] * (width - len(r)) for r in rows], dtype=mx.int32)


# -- the batch's caches: one entry per layer ------------------------------------------------------


def rows_cache(cache: list, lengths: list[int] | None = None) -> list:
    """A batch cache of one row from a single-sequence cache (KVCache / ArraysCache per layer)."""
    out: list = []
    for c in cache:
        if isinstance(c, KVCache):
            out.append(RaggedKV.from_cache(c))
        else:
            a = ArraysCache(size=2)
            a[0], a[1] = c[0], c[1]
            out.append(a)
    return out


def concat_caches(parts: list[list]) -> list:
    """Batch caches side by side (rows of the first, then of the second, ...)."""
    out: list = []
    for layer in zip(*parts):
        if isinstance(layer[0], RaggedKV):
            out.append(RaggedKV.concat(list(layer)))
        else:
            a = ArraysCache(size=2)
            a[0] = mx.concatenate([c[0] for c in layer])
            a[1] = mx.concatenate([c[1] for c in layer])
            out.append(a)
    return out


def take_rows(cache: list, rows: list[int]) -> list:
    out: list = []
    index = mx.array(rows, dtype=mx.int32)
    for c in cache:
        if isinstance(c, RaggedKV):
            out.append(c.take(rows))
        else:
            a = ArraysCache(size=2)
            a[0], a[1] = c[0][index], c[1][index]
            out.append(a)
    return out


def cache_arrays(cache: list) -> list[mx.array]:
    out: list[mx.array] = []
    for c in cache:
        if isinstance(c, RaggedKV):
            out += [a for a in (c.keys, c.values) if a is not None]
        else:
            out += [a for a in (c[0], c[1]) if a is not None]
    return out
