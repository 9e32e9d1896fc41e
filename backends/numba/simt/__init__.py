"""The SIMT kernel family: CUDA-core kernels in float32 arithmetic (engine.py)."""
