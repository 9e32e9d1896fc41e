"""numba_flash: exact FlashAttention written in Python as Numba CUDA kernels.

    out, lse = numba_flash.forward(q, k, v, causal=True)
    dq, dk, dv = numba_flash.backward(dout, q, k, v, out, lse, causal=True)

Importing this package imports neither Numba's CUDA target, CuPy nor torch; backends are
loaded the first time they are used.
"""
from numba_flash.api import attention, backward, backward_varlen, forward, forward_varlen
from numba_flash.block_mask import BlockMask, block_mask
from numba_flash.kvcache import forward_kvcache
from numba_flash.merge import merge
from numba_flash.registry import (
    available_backends,
    get_backend,
    list_backends,
    select_backend,
    use_backend,
)

__version__ = "0.1.0"

__all__ = [
    "forward",
    "backward",
    "attention",
    "forward_varlen",
    "backward_varlen",
    "forward_kvcache",
    "block_mask",
    "BlockMask",
    "merge",
    "list_backends",
    "available_backends",
    "get_backend",
    "select_backend",
    "use_backend",
]
