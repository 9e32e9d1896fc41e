"""The last launch of a backward whose GQA group was split over blocks (hopper/grids.py):
each key/value head's dK and dV from its float32 parts, added in a fixed order (part 0, 1,
...) and rounded once to 16 bits, so that the result does not depend on the blocks' order."""
import functools

from numba import cuda, float32

from numba_flash.spec import AttentionSpec

from ..launch import launch
from .fragments import make_pair_store
from .sequence import grid_extent, make_sequence

GROUP_SUM_THREADS = 128
#: key rows a block adds (its threads' column pairs, row after row)
GROUP_SUM_ROWS = 16


@functools.lru_cache(maxsize=None)
def group_sums_kernel_function(spec, split, head_dim):
    """dk[b, row, h] = sum over p < split of dk_parts[b, row, h · split + p] (dv likewise),
    16-bit patterns out, head_dim columns (even, at most 2 · GROUP_SUM_THREADS)."""
    PAIRS = head_dim // 2
    store_pair = make_pair_store(spec.bf16)
    sequence = make_sequence(spec)

    @cuda.jit(device=True, inline="always")
    def add_parts(parts, dst, b, row, h, col):
        low, high = float32(0.0), float32(0.0)
        for p in range(split):
            low += parts[b, row, h * split + p, col]
            high += parts[b, row, h * split + p, col + 1]
        store_pair(dst, b, row, h, col, low, high)

    def flash_bwd_group_sums(dk_parts, dv_parts, dk, dv, cu_seqlens_q, cu_seqlens_k):
        h = cuda.blockIdx.y
        b, _, _, k_start, seqlen_k = sequence(cuda.blockIdx.z, dk, dk, cu_seqlens_q,
                                              cu_seqlens_k)
        col = 2 * (cuda.threadIdx.x % PAIRS)
        for r in range(cuda.threadIdx.x // PAIRS, GROUP_SUM_ROWS, GROUP_SUM_THREADS // PAIRS):
            n = cuda.blockIdx.x * GROUP_SUM_ROWS + r
            if n < seqlen_k:
                add_parts(dk_parts, dk, b, k_start + n, h, col)
                add_parts(dv_parts, dv, b, k_start + n, h, col)

    return flash_bwd_group_sums


@functools.lru_cache(maxsize=None)
def group_sums_kernel(spec, split, head_dim):
    return cuda.jit(group_sums_kernel_function(spec, split, head_dim), cache=True)


def launch_group_sums(spec, split, dk_parts, dv_parts, dk, dv, cu_seqlens_q, cu_seqlens_k,
                      stream):
    """dK and dV (batch, seqlen_k, kv_heads, head_dim: 16-bit patterns) from their parts
    (batch, seqlen_k, kv_heads · split, head_dim: float32), on `stream`; varlen's sequences
    from cu_seqlens_k (cu_seqlens_q: the kernels' placeholder where not varlen)."""
    _, _, kv_heads, head_dim = dk.shape
    seqlen_k, sequences = grid_extent(spec, dk, cu_seqlens_k, 1)
    grid = (-(-seqlen_k // GROUP_SUM_ROWS), kv_heads, sequences)
    # (keyed on what the sums depend on: the 16-bit type and varlen, not the call's variants)
    plain = AttentionSpec(head_dim, spec.dtype, varlen=spec.varlen)
    launch(group_sums_kernel(plain, split, head_dim), grid,
           GROUP_SUM_THREADS, stream, 0, dk_parts, dv_parts, dk, dv, cu_seqlens_q, cu_seqlens_k)
