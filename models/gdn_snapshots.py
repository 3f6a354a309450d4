"""GatedDeltaNet forward that keeps the layer's state after every position.

A verify forward feeds [y, d1..dK] in one pass. To roll back to "after position n" without a second
forward we need the recurrent state after each position and the conv window ending at each position.
The projections run batched over all positions (one weight read); only the recurrence is stepped,
which is what mlx-lm's own decode does one token at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import compute_g, gated_delta_ops, gated_delta_update, normalize_qk
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


def gdn_forward_with_snapshots(
    gdn: GatedDeltaNet, x: mx.array, cache: ArraysCache
) -> tuple[mx.array, GDNSnapshots]:
    B, S, _ = x.shape
    qkv = gdn.in_proj_qkv(x)
    z = gdn.in_proj_z(x).reshape(B, S, gdn.num_v_heads, gdn.head_v_dim)
    b = gdn.in_proj_b(x)
    a = gdn.in_proj_a(x)

    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((B, gdn.conv_kernel_size - 1, gdn.conv_dim), dtype=x.dtype)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    conv_out = nn.silu(gdn.conv1d(conv_input))

    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [gdn.key_dim, 2 * gdn.key_dim], -1),
            [gdn.num_k_heads, gdn.num_k_heads, gdn.num_v_heads],
            [gdn.head_k_dim, gdn.head_k_dim, gdn.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=gdn.head_k_dim**-0.5, eps=1e-6)

    state = cache[1]
    if state is None:
        state = mx.zeros((B, gdn.num_v_heads, gdn.head_v_dim, gdn.head_k_dim), dtype=mx.float32)
    if mx.default_device() == mx.gpu and mx.metal.is_available():
        y, states = _stepped_kernel(gdn, q, k, v, a, b, state)
    else:
        y, stacked = _stepped_ops(q, k, v, compute_g(gdn.A_log, a, gdn.dt_bias), mx.sigmoid(b), state)
        states = [stacked[t] for t in range(S)]

    snaps = GDNSnapshots(conv_input=conv_input, states=states, kernel=gdn.conv_kernel_size)
    snaps.restore(cache, S - 1)
    cache.advance(S)
    out = gdn.norm(y, z)
    return gdn.out_proj(out.reshape(B, S, -1)), snaps


@mx.compile
def _stepped_ops(q, k, v, g, beta, state):
    """The CPU recurrence one position at a time (as decode runs it), compiled per verify length."""
    ys, states = [], []
    for t in range(q.shape[1]):
        s = slice(t, t + 1)
        y, state = gated_delta_ops(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], state)
        ys.append(y)
        states.append(state)
    return mx.concatenate(ys, axis=1), mx.stack(states)


def _stepped_kernel(gdn, q, k, v, a, b, state):
    """On Metal: mlx-lm's recurrence kernel, one position per call."""
    ys, states = [], []
    for t in range(q.shape[1]):
        s = slice(t, t + 1)
        y, state = gated_delta_update(q[:, s], k[:, s], v[:, s], a[:, s], b[:, s], gdn.A_log, gdn.dt_bias, state)
        ys.append(y)
        states.append(state)
    return mx.concatenate(ys, axis=1), states
