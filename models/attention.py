"""Qwen3.5's gated attention decoder layer (mlx-lm's modules and weights) in three parts, so that decode
and verify inputs on the CPU run the two around the cache compiled.

    project: input norm, q/k/v projections, q/k norms, rotary positions  (compiled)
    the cache update and the attention over the whole context            (as is)
    finish:  output gate, output projection, residual, post norm, MLP     (compiled)

The middle part's shapes change with the context length at every step, so it stays out of the
compiled functions, which are traced once per input shape; the parts around it are mostly small
elementwise ops whose launches, on the CPU, cost more than their arithmetic. Compiled or not, the
parts compute mlx-lm's attention layer bit for bit (tests hold it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

# (keys, values) [B, T, kv heads, dim] -> (every key and value to attend to [B, kv heads, L, dim], mask)
Update = Callable[[mx.array, mx.array], tuple[mx.array, mx.array, Any]]


def cache_update(cache: Any, mask: Any) -> Update:
    """An `Update` into mlx-lm's single-sequence cache (or a view with its `update_and_fetch`), whose
    queries read under `mask`."""
    def update(keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array, Any]:
        keys, values = cache.update_and_fetch(keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3))
        return keys, values, mask

    return update


def attention_entries(attn: Any, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array]:
    """The keys (normed, rotated) and values [B, T, heads, dim] Qwen3.5's gated attention caches for
    inputs `x` (after the layer's input norm) starting at position `offset` (per row: an array)."""
    B, T, _ = x.shape
    keys = attn.k_norm(attn.k_proj(x).reshape(B, T, attn.num_key_value_heads, -1))
    values = attn.v_proj(x).reshape(B, T, attn.num_key_value_heads, -1)
    keys = attn.rope(keys.transpose(0, 2, 1, 3), offset=offset).transpose(0, 2, 1, 3)
    return keys, values


def project(attn: Any, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Queries [B, heads, T, dim] (normed, rotated), the output gate [B, T, heads * dim], and the new
    keys and values (`attention_entries`) of inputs `x` after the layer's input norm."""
    B, T, _ = x.shape
    queries, gate = mx.split(attn.q_proj(x).reshape(B, T, attn.num_attention_heads, -1), 2, axis=-1)
    queries = attn.rope(attn.q_norm(queries).transpose(0, 2, 1, 3), offset=offset)
    keys, values = attention_entries(attn, x, offset)
    return queries, gate.reshape(B, T, -1), keys, values


def attention_layer(layer: Any, h: mx.array, offset: int | mx.array, update: Update, compiled: Any = None) -> mx.array:
    """The whole decoder layer over `h` [B, T, hidden] at position `offset` (per row: an array);
    `update` writes the new keys and values to the cache and returns what to attend to. With
    `compiled` (gdn_snapshots.CompiledLayers) where it applies to `h`, the parts around the update
    and the attention run compiled."""
    if compiled is not None and compiled.applies(h):
        if isinstance(offset, int):  # (an array, one per row as for rows at their own positions: a number
            offset = mx.full((h.shape[0],), offset, dtype=mx.int32)  # would be traced again at every position)
        run = compiled.call
    else:
        run = _call
    queries, gate, keys, values = run(layer, _project_layer, h, offset)
    keys, values, mask = update(keys, values)
    out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=layer.self_attn.scale, mask=mask)
    return run(layer, _finish_layer, h, out, gate)


def _project_layer(layer: Any, h: mx.array, offset: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    return project(layer.self_attn, layer.input_layernorm(h), offset)


def _finish_layer(layer: Any, h: mx.array, out: mx.array, gate: mx.array) -> mx.array:
    """The residual past the attention (`out`: its output [B, heads, T, dim], before the gate) and the MLP."""
    B, _, T, _ = out.shape
    h = h + layer.self_attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1) * mx.sigmoid(gate))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _call(layer: Any, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(layer, *args)
