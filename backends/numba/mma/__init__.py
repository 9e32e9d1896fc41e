"""The tensor-core kernel family: mma.sync kernels for 16-bit inputs (engine.py)."""
