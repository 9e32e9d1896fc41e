"""Device functions for kernels that take 16-bit data as uint16 bit patterns.

bfloat16 reaches the kernels only as bit patterns (torch exports no bfloat16 through the array
interfaces), and the tensor-core kernels take float16 that way too, so that one kernel source
serves both types.
"""
from numba import cuda, uint16, uint32

from .intrinsics import float32_from_bits, pack_bf16x2, unpack_f16x2


@cuda.jit(device=True, inline="always")
def f16_bits_to_float32(bits):
    return unpack_f16x2(uint32(bits))[0]


@cuda.jit(device=True, inline="always")
def bf16_bits_to_float32(bits):
    return float32_from_bits(uint32(bits) << 16)  # (bfloat16 is a float32's top half)


@cuda.jit(device=True, inline="always")
def float32_to_bf16_bits(x):
    """x rounded to the nearest bfloat16 (ties to even), as its bit pattern."""
    return uint16(pack_bf16x2(x, x) & 0xFFFF)


@cuda.jit(device=True, inline="always")
def unchanged(x):
    """The encoder of arrays that hold floats: the store converts to the array's type."""
    return x
