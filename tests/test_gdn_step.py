"""The stepped GatedDeltaNet recurrence (decode and verify) computes mlx-lm's recurrence, and a row's
result does not depend on the rows beside it."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops

from mtpipe.models.gdn_snapshots import _stepped_ops


def inputs(rows: int, tokens: int, vector_gate: bool, dtype: mx.Dtype, seed: int = 0) -> tuple[mx.array, ...]:
    Hk, Hv, Dk, Dv = 2, 4, 16, 8
    ks = mx.random.split(mx.random.key(seed), 6)
    q = (0.3 * mx.random.normal((rows, tokens, Hk, Dk), key=ks[0])).astype(dtype)
    k = (0.3 * mx.random.normal((rows, tokens, Hk, Dk), key=ks[1])).astype(dtype)
    v = mx.random.normal((rows, tokens, Hv, Dv), key=ks[2]).astype(dtype)
    g = mx.random.uniform(0.5, 1.0, (rows, tokens, Hv, Dk) if vector_gate else (rows, tokens, Hv), key=ks[3])
    beta = mx.random.uniform(0.0, 1.0, (rows, tokens, Hv), key=ks[4]).astype(dtype)  # (sigmoid of a projection)
    state = 0.1 * mx.random.normal((rows, Hv, Dv, Dk), key=ks[5])
    return q, k, v, g, beta, state


@pytest.mark.parametrize("vector_gate", [False, True], ids=["head_gate", "key_gate"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 2, 4])
def test_steps_match_mlx_lm_recurrence(tokens: int, dtype: mx.Dtype, vector_gate: bool) -> None:
    q, k, v, g, beta, state = inputs(3, tokens, vector_gate, dtype)
    y, states = _stepped_ops(q, k, v, g, beta, state)
    assert y.shape == v.shape and y.dtype == dtype and len(states) == tokens
    want_state = state
    for t in range(tokens):  # mlx-lm's reference, one position at a time: every intermediate state too
        s = slice(t, t + 1)
        want_y, want_state = gated_delta_ops(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], want_state)
        assert states[t].dtype == mx.float32
        assert mx.allclose(states[t], want_state, rtol=1e-5, atol=1e-6).item()
        rtol = 1e-5 if dtype == mx.float32 else 2**-8  # (bfloat16 outputs: within one rounding)
        assert mx.allclose(y[:, s].astype(mx.float32), want_y.astype(mx.float32), rtol=rtol, atol=1e-5).item()


@pytest.mark.parametrize("vector_gate", [False, True], ids=["head_gate", "key_gate"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_a_row_steps_alike_alone_and_in_a_batch(dtype: mx.Dtype, vector_gate: bool) -> None:
    """Batch identity needs each row's arithmetic to be the same whatever the batch around it."""
    batch = inputs(5, 3, vector_gate, dtype, seed=1)
    y, states = _stepped_ops(*batch)
    for i in range(5):
        y_i, states_i = _stepped_ops(*(a[i : i + 1] for a in batch))
        assert mx.array_equal(y[i : i + 1], y_i).item()
        assert all(mx.array_equal(s[i : i + 1], s_i).item() for s, s_i in zip(states, states_i))


@pytest.mark.parametrize("vector_gate", [False, True], ids=["head_gate", "key_gate"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_a_decode_step_equals_the_same_position_of_a_verify(dtype: mx.Dtype, vector_gate: bool) -> None:
    """Decode (one token) and verify (several) must agree bit for bit at every position."""
    q, k, v, g, beta, state = inputs(2, 4, vector_gate, dtype, seed=2)
    y, states = _stepped_ops(q, k, v, g, beta, state)
    s = state
    for t in range(4):
        one = slice(t, t + 1)
        y_t, (s,) = _stepped_ops(q[:, one], k[:, one], v[:, one], g[:, one], beta[:, one], s)
        assert mx.array_equal(y_t, y[:, one]).item() and mx.array_equal(s, states[t]).item()
