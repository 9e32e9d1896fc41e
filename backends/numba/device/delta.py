"""The backward's first launch, shared by every kernel family: D_i = rowsum(dO_i ∘ O_i)."""
import functools

from numba import cuda, float32

from ..launch import launch
from .bits16 import bf16_bits_to_float32, f16_bits_to_float32
from .constants import ZERO

DELTA_THREADS = 128


@functools.lru_cache(maxsize=None)
def delta_kernel_function(head_dim, element="float"):
    """delta[b, h, i] = sum_d dout[b, i, h, d] * out[b, i, h, d], one thread per row. element:
    "float" for arrays of floats, "f16" / "bf16" for arrays of 16-bit patterns."""
    convert = {"float": float32, "f16": f16_bits_to_float32, "bf16": bf16_bits_to_float32}[element]

    def flash_bwd_delta(dout, out, delta):
        row = cuda.blockIdx.x * DELTA_THREADS + cuda.threadIdx.x
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        if row < out.shape[1]:
            total = ZERO
            for d in range(head_dim):
                total += convert(dout[b, row, h, d]) * convert(out[b, row, h, d])
            delta[b, h, row] = total

    return flash_bwd_delta


@functools.lru_cache(maxsize=None)
def delta_kernel(head_dim, element="float"):
    return cuda.jit(delta_kernel_function(head_dim, element), cache=True)


def launch_delta(dout, out, delta, element, stream):
    """D for every row of (batch, seqlen_q, nheads, head_dim) dout and out into delta."""
    batch, seqlen_q, nheads, head_dim = out.shape
    grid = (-(-seqlen_q // DELTA_THREADS), nheads, batch)
    launch(delta_kernel(head_dim, element), grid, DELTA_THREADS, stream, 0, dout, out, delta)
