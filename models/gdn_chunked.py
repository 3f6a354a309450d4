"""GatedDeltaNet prefill on the CPU, a chunk of positions at a time.

mlx-lm runs the gated delta recurrence with a Metal kernel; elsewhere it loops over the positions in
Python, a dozen small ops each, so a long prompt builds a graph of tens of thousands of tiny kernels.
The chunked form (Yang et al., "Gated Delta Networks", as flash-linear-attention computes it) does the
same arithmetic with matrix products over chunks of positions; only the state passes from one chunk
to the next.

With S the state [Dv, Dk], g the decay and b the write strength at each position, the recurrence is
S_t = g_t S_{t-1} + u_t k_t^T, u_t = b_t (v_t - g_t S_{t-1} k_t), y_t = S_t q_t. Inside a chunk that
starts from S0, with G_t the product of the decays up to t and D_ts = G_t / G_s (s <= t):
  (I + A) U = b * (V - G * K S0^T), A_ts = b_t D_ts k_t.k_s (s < t)
  Y = G * Q S0^T + ((Q K^T) * D) U
  S_C = G_C S0 + U^T (D_Cs K)
A is strictly lower triangular, so I + A is inverted (`tri_inv`, a triangular solve) once per chunk,
from the inputs alone. Each D_ts is the exponential of a sum of the log decays between s and t, never
a difference of two running sums (which loses the small ones after a large one). Positions masked out (padding of shorter rows) take b = 0 and g = 1: the state passes
them unchanged, as mlx-lm's masked step leaves it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .gdn_snapshots import on_cpu, qkv_heads

CHUNK = 64


def log_decay(A_log: mx.array, a: mx.array, dt_bias: mx.array) -> mx.array:
    """log g, for mlx-lm's g = exp(-exp(A_log) softplus(a + dt_bias)) (float32)."""
    return -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias).astype(mx.float32)


def chunked_delta_rule(
    q: mx.array, k: mx.array, v: mx.array, log_g: mx.array, beta: mx.array, state: mx.array, chunk: int = CHUNK
) -> tuple[mx.array, mx.array]:
    """Outputs [B, T, Hv, Dv] in q's dtype and the state after the last position [B, Hv, Dv, Dk] in
    float32, as mlx-lm's steps give them. q, k [B, T, Hk, Dk] normalized; v [B, T, Hv, Dv]; log_g,
    beta [B, T, Hv]."""
    B, T, Hk, _ = q.shape
    assert T > 0, "an empty input has no recurrence to run"
    dtype = q.dtype
    Hv, Dv = v.shape[-2:]
    if (repeat := Hv // Hk) > 1:
        q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
    C = min(chunk, T)
    N = -(-T // C)
    pad = N * C - T

    def blocks(x: mx.array) -> mx.array:
        """[B, T, H, ...] -> [B, H, N, C, ...] in float32, padded with zeros (b = 0, log g = 0)."""
        x = x.astype(mx.float32)
        if pad:
            x = mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, N, C, *x.shape[2:])
        return mx.moveaxis(x, 3, 1)

    q, k, v, log_g, beta = blocks(q), blocks(k), blocks(v), blocks(log_g), blocks(beta)
    cum = mx.cumsum(log_g, axis=-1)  # [B, H, N, C]: log G_t
    lower = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    strict = mx.tril(lower, -1)
    between = mx.cumsum(mx.where(strict, log_g[..., :, None], 0.0), axis=-2)  # [t, s]: log g over s < r <= t
    decay = mx.exp(mx.where(lower, between, -mx.inf))  # D_ts, 0 above the diagonal
    kk = k @ mx.swapaxes(k, -1, -2)
    a = mx.where(strict, beta[..., None] * decay * kk, 0.0)
    inv = mx.linalg.tri_inv(a + mx.eye(C), upper=False, stream=mx.cpu)
    w = inv @ (beta[..., None] * v)  # U = w - kg S0^T
    kg = inv @ ((beta * mx.exp(cum))[..., None] * k)
    qk = (q @ mx.swapaxes(k, -1, -2)) * decay
    qg = mx.exp(cum)[..., None] * q
    k_end = mx.exp(between[..., -1, :])[..., None] * k  # D_Cs k_s
    g_end = mx.exp(cum[..., -1])[..., None, None]  # [B, H, N, 1, 1]

    s = state.astype(mx.float32)
    ys = []
    for n in range(N):
        s_t = mx.swapaxes(s, -1, -2)  # [B, H, Dk, Dv]
        u = w[:, :, n] - kg[:, :, n] @ s_t
        ys.append(qg[:, :, n] @ s_t + qk[:, :, n] @ u)
        s = g_end[:, :, n] * s + mx.swapaxes(u, -1, -2) @ k_end[:, :, n]
    y = mx.stack(ys, axis=2).reshape(B, Hv, N * C, Dv)[:, :, :T]
    return mx.moveaxis(y, 1, 2).astype(dtype), s


def prefill_mixer(gdn: Any, x: mx.array, mask: mx.array | None, cache: Any) -> mx.array:
    """mlx-lm's GatedDeltaNet forward over a prefill input `x` [B, S, hidden], its recurrence chunked:
    the same projections, conv window and cache updates (`cache.lengths` ends each row's window)."""
    B, S, _ = x.shape
    qkv = gdn.in_proj_qkv(x)
    z = gdn.in_proj_z(x).reshape(B, S, gdn.num_v_heads, gdn.head_v_dim)
    b = gdn.in_proj_b(x)
    a = gdn.in_proj_a(x)
    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((B, gdn.conv_kernel_size - 1, gdn.conv_dim), dtype=x.dtype)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    keep = gdn.conv_kernel_size - 1
    if cache.lengths is not None:
        ends = mx.clip(cache.lengths, 0, S)
        cache[0] = mx.take_along_axis(conv_input, (ends[:, None] + mx.arange(keep))[..., None], axis=1)
    else:
        cache[0] = mx.contiguous(conv_input[:, -keep:, :])
    q, k, v = qkv_heads(gdn, nn.silu(gdn.conv1d(conv_input)))
    beta = mx.sigmoid(b)
    log_g = log_decay(gdn.A_log, a, gdn.dt_bias)
    if mask is not None:
        beta, log_g = mx.where(mask[..., None], beta, 0), mx.where(mask[..., None], log_g, 0)
    state = cache[1]
    if state is None:
        state = mx.zeros((B, gdn.num_v_heads, gdn.head_v_dim, gdn.head_k_dim), dtype=mx.float32)
    y, cache[1] = chunked_delta_rule(q, k, v, log_g, beta, state)
    cache.advance(S)
    return gdn.out_proj(gdn.norm(y, z).reshape(B, S, -1))


def prefill_layer(layer: Any, h: mx.array, cache: Any, mask: mx.array | None = None) -> mx.array:
    """A GatedDeltaNet decoder layer (input norm, mixer, residual, MLP) over a prefill input: its
    recurrence chunked on the CPU, mlx-lm's mixer (its kernel) on Metal."""
    x = layer.input_layernorm(h)
    h = h + (prefill_mixer(layer.linear_attn, x, mask, cache) if on_cpu() else layer.linear_attn(x, mask, cache))
    return h + layer.mlp(layer.post_attention_layernorm(h))
