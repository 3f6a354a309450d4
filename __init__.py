"""mtpipe: Qwen3.5/3.6 across a pipeline of Macs with native MTP speculative decoding."""

from .models.blas import preload as _preload_blas
from .models.cpu_jit import setup as _setup_cpu_jit

_preload_blas()  # before anything imports mlx.core: on Linux, MLX's matmuls then use an optimized BLAS
_setup_cpu_jit()  # and the kernels MLX builds for compiled functions use this CPU's vector units

__version__ = "0.1.0"
