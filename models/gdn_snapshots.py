"""GatedDeltaNet forward that keeps the layer's state after every position.

A verify forward feeds [y, d1..dK] in one pass. To roll back to "after position n" without a second
forward we need the recurrent state after each position and the conv window ending at each position.
The projections run batched over all positions (one weight read); only the recurrence is stepped,
as mlx-lm's own decode runs it, one token at a time (on the CPU with the state's reads as matrix
products: `_step`).

On the CPU a decode or verify input runs each whole layer compiled: the same arithmetic (bit for
bit; tests hold it), with its elementwise ops fused and its graph traced once per input shape, so a
step launches fewer kernels and builds less graph on the host. Metal keeps the uncompiled path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import compute_g, gated_delta_update, normalize_qk
from mlx_lm.models.qwen3_5 import GatedDeltaNet


@dataclass
class GDNSnapshots:
    """Per-position states of one GatedDeltaNet layer from one multi-token forward."""

    conv_input: mx.array  # [B, kernel-1+T, C]: old conv window followed by the T new inputs
    states: list[mx.array]  # T recurrent states [B, Hv, Dv, Dk], state after position t
    kernel: int

    def conv_after(self, position: int) -> mx.array:
        return self.conv_input[:, position + 1 : position + self.kernel, :]

    def restore(self, cache: ArraysCache, position: int) -> None:
        cache[0] = mx.contiguous(self.conv_after(position))
        cache[1] = self.states[position]


COMPILED_MAX_TOKENS = 8  # decode and verify inputs; a compiled layer is traced once per input shape


class CompiledLayers:
    """A shard's layers' compiled parts (a GatedDeltaNet layer whole, an attention layer's parts
    around its cache: attention.py), each compiled once and kept by the shard that owns them (a
    compiled function holds its layer, and reads the layer's weights afresh at every call)."""

    def __init__(self) -> None:
        self._fns: dict[tuple[int, Callable], Callable] = {}
        self._traced: set[tuple] = set()  # (layer, part, input shapes and dtypes) traced without an error

    def applies(self, h: mx.array) -> bool:
        return h.shape[1] <= COMPILED_MAX_TOKENS and on_cpu()

    def run(self, layer: Any, h: mx.array, conv_state: mx.array, state: mx.array) -> tuple:
        """The compiled GatedDeltaNet layer."""
        return self.call(layer, _layer, h, conv_state, state)

    def call(self, layer: Any, fn: Callable, *arrays: mx.array) -> Any:
        """`fn(layer, *arrays)` compiled. While MLX traces a new input shape it swaps the layer's
        weights for placeholders and puts them back only if the trace succeeds: a failed trace (bad
        input) must not leave the layer without its weights."""
        part = (id(layer), fn)
        compiled = self._fns.get(part)
        if compiled is None:
            compiled = self._fns[part] = mx.compile(partial(fn, layer), inputs=layer.state)
        key = (*part, *((a.shape, a.dtype) for a in arrays))
        if key in self._traced:
            return compiled(*arrays)
        weights = tree_flatten(layer.parameters())
        try:
            out = compiled(*arrays)
        except BaseException:
            layer.update(tree_unflatten(weights))
            raise
        self._traced.add(key)
        return out


def gdn_layer(
    layer: Any, h: mx.array, cache: ArraysCache, compiled: CompiledLayers | None = None
) -> tuple[mx.array, GDNSnapshots]:
    """A GatedDeltaNet decoder layer (input norm, mixer, residual, MLP) over `h` [B, T, hidden]; the
    cache ends after the last position, and the snapshots hold every position's state."""
    gdn = layer.linear_attn
    B = h.shape[0]
    conv_state, state = cache[0], cache[1]
    if conv_state is None:
        conv_state = mx.zeros((B, gdn.conv_kernel_size - 1, gdn.conv_dim), dtype=h.dtype)
    if state is None:
        state = mx.zeros((B, gdn.num_v_heads, gdn.head_v_dim, gdn.head_k_dim), dtype=mx.float32)
    if compiled is not None and compiled.applies(h):
        h, conv_input, states = compiled.run(layer, h, conv_state, state)
    else:
        h, conv_input, states = _layer(layer, h, conv_state, state)
    return h, _snapshots(gdn, cache, conv_input, states)


def _layer(layer: Any, h: mx.array, conv_state: mx.array, state: mx.array) -> tuple[mx.array, mx.array, list[mx.array]]:
    r, conv_input, states = _mixer(layer.linear_attn, layer.input_layernorm(h), conv_state, state)
    h = h + r
    return h + layer.mlp(layer.post_attention_layernorm(h)), conv_input, states


def _snapshots(gdn: GatedDeltaNet, cache: ArraysCache, conv_input: mx.array, states: list[mx.array]) -> GDNSnapshots:
    snaps = GDNSnapshots(conv_input=conv_input, states=states, kernel=gdn.conv_kernel_size)
    snaps.restore(cache, len(states) - 1)
    cache.advance(len(states))
    return snaps


def _mixer(
    gdn: GatedDeltaNet, x: mx.array, conv_state: mx.array, state: mx.array
) -> tuple[mx.array, mx.array, list[mx.array]]:
    """Output, conv input (old window + new inputs) and the state after each position."""
    B, S, _ = x.shape
    qkv = gdn.in_proj_qkv(x)
    z = gdn.in_proj_z(x).reshape(B, S, gdn.num_v_heads, gdn.head_v_dim)
    b = gdn.in_proj_b(x)
    a = gdn.in_proj_a(x)

    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    q, k, v = qkv_heads(gdn, nn.silu(gdn.conv1d(conv_input)))

    if _on_metal():
        y, states = _stepped_kernel(gdn, q, k, v, a, b, state)
    else:
        y, states = _stepped_ops(q, k, v, compute_g(gdn.A_log, a, gdn.dt_bias), mx.sigmoid(b), state)
    out = gdn.norm(y, z)
    return gdn.out_proj(out.reshape(B, S, -1)), conv_input, states


def qkv_heads(gdn: Any, conv_out: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The conv output [B, S, conv_dim] split into q, k (normalized, q scaled) and v, by heads."""
    B, S, _ = conv_out.shape
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [gdn.key_dim, 2 * gdn.key_dim], -1),
            [gdn.num_k_heads, gdn.num_k_heads, gdn.num_v_heads],
            [gdn.head_k_dim, gdn.head_k_dim, gdn.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=gdn.head_k_dim**-0.5, eps=1e-6)
    return q, k, v


def on_cpu() -> bool:
    """MLX computes on the CPU here: what the compiled layers and the per-layer queuing are for."""
    return mx.default_device() == mx.cpu


def _on_metal() -> bool:
    return mx.default_device() == mx.gpu and mx.metal.is_available()


@mx.compile
def _stepped_ops(q, k, v, g, beta, state):
    """The CPU recurrence one position at a time (as decode runs it), compiled per verify length. The
    key heads are repeated for the value heads once, not at every position."""
    if (repeat := v.shape[-2] // q.shape[-2]) > 1:
        q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
    ys, states = [], []
    for t in range(q.shape[1]):
        y, state = _step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y[:, None])
        states.append(state)
    return mx.concatenate(ys, axis=1), states


def _step(q, k, v, g, beta, state):
    """One position of mlx-lm's recurrence (S' = g S + delta k^T, delta = beta (v - g S k), y = S' q),
    its two reads of the state as matrix-vector products instead of elementwise products summed over
    the whole state (fewer passes over it), in float32 as the state is. q, k [B, H, Dk]; v [B, H, Dv];
    g [B, H] or [B, H, Dk]; beta [B, H]; state [B, H, Dv, Dk]."""
    decay = g[..., None] if g.ndim == 2 else g  # [B, H, 1] or [B, H, Dk]
    kv = (state @ (decay * k)[..., None])[..., 0]
    delta = (v - kv) * beta[..., None]
    state = state * decay[..., None, :] + delta[..., None] * k[..., None, :]
    y = (state @ q.astype(mx.float32)[..., None])[..., 0]
    return y.astype(q.dtype), state


def _stepped_kernel(gdn, q, k, v, a, b, state):
    """On Metal: mlx-lm's recurrence kernel, one position per call."""
    ys, states = [], []
    for t in range(q.shape[1]):
        s = slice(t, t + 1)
        y, state = gated_delta_update(q[:, s], k[:, s], v[:, s], a[:, s], b[:, s], gdn.A_log, gdn.dt_bias, state)
        ys.append(y)
        states.append(state)
    return mx.concatenate(ys, axis=1), states
