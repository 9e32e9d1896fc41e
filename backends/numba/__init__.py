"""The Numba backends: FlashAttention kernels written as Numba CUDA kernels (backend.py)."""
