"""mtpipe: Qwen3.5/3.6 across a pipeline of Macs with native MTP speculative decoding."""

from .models.blas import preload as _preload_blas

_preload_blas()  # before anything imports mlx.core: on Linux, MLX's matmuls then use an optimized BLAS

__version__ = "0.1.0"
