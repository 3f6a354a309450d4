"""Diagnostic, not a benchmark: what MLX's float32 products cost on the BLAS this process binds.

The demo model's weight shapes ([rows, K] x [K, N]: the tied lm_head, a GatedDeltaNet input
projection, an MLP down projection) at 1 to 2,048 rows, milliseconds per evaluated product (the
median of repeated timings). One BLAS per process, as MLX binds `cblas_sgemm` once, so run it once
per library and compare:

    python benchmarks/blas_matmul.py
    MTPIPE_BLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python benchmarks/blas_matmul.py
"""

from __future__ import annotations

import statistics
import time

import mtpipe  # noqa: F401  (loads the optimized BLAS before mlx.core)
import mlx.core as mx
from mtpipe.models import blas

SHAPES = ((256, 4096), (256, 768), (384, 256))
ROWS = (1, 2, 4, 8, 16, 32, 128, 512, 2048)


def cost_ms(x: mx.array, w: mx.array, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        mx.eval(x @ w.T)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    print(f"BLAS: {blas.info()}")
    print("K x N".ljust(12) + "".join(f"M={m}".rjust(9) for m in ROWS))
    for k, n in SHAPES:
        w = mx.random.normal((n, k))
        mx.eval(w)
        row = []
        for m in ROWS:
            x = mx.random.normal((m, k))
            mx.eval(x)
            cost_ms(x, w, 3)  # (warm-up)
            row.append(cost_ms(x, w, max(15, 1500 // m)))
        print(f"{k} x {n}".ljust(12) + "".join(f"{t:9.3f}" for t in row))


if __name__ == "__main__":
    main()
