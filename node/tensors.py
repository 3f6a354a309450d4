"""mx.array <-> raw bytes + dtype + shape, for hidden states on the wire.

Bytes are the array's own memory (row-major, little-endian), so a [1, T, H] bfloat16 hidden state
costs exactly 2*T*H bytes. numpy has no bfloat16: those travel through a uint16 view.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

# wire name -> (mlx dtype, numpy dtype of the same width used to move the bytes)
DTYPES: dict[str, tuple[mx.Dtype, np.dtype]] = {
    "float32": (mx.float32, np.dtype("<f4")),
    "float16": (mx.float16, np.dtype("<f2")),
    "bfloat16": (mx.bfloat16, np.dtype("<u2")),
}
MAX_DIMS = 4


class TensorError(ValueError):
    """Bytes that do not make the tensor they claim to be."""


@dataclass(frozen=True)
class RawTensor:
    dtype: str
    shape: tuple[int, ...]
    data: bytes


def dtype_name(dtype: mx.Dtype) -> str:
    for name, (d, _) in DTYPES.items():
        if d == dtype:
            return name
    raise TensorError(f"unsupported dtype {dtype}; expected one of {', '.join(DTYPES)}")


def to_raw(a: mx.array) -> RawTensor:
    name = dtype_name(a.dtype)
    mdt, ndt = DTYPES[name]
    view = a.view(mx.uint16) if mdt == mx.bfloat16 else a
    return RawTensor(name, tuple(a.shape), np.asarray(view, dtype=ndt).tobytes())


def from_raw(dtype: str, shape: tuple[int, ...] | list[int], data: bytes) -> mx.array:
    """Validated decode: unknown dtype, bad shape or a byte count that does not match -> TensorError."""
    if dtype not in DTYPES:
        raise TensorError(f"unknown tensor dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    shape = tuple(int(s) for s in shape)
    if not 1 <= len(shape) <= MAX_DIMS or any(s <= 0 for s in shape):
        raise TensorError(f"bad tensor shape {shape}")
    mdt, ndt = DTYPES[dtype]
    expected = math.prod(shape) * ndt.itemsize
    if len(data) != expected:
        raise TensorError(f"tensor of shape {shape} and dtype {dtype} needs {expected} bytes, got {len(data)}")
    arr = mx.array(np.frombuffer(data, dtype=ndt).reshape(shape))
    return arr.view(mx.bfloat16) if mdt == mx.bfloat16 else arr
