"""Which keys a query sees: the element predicate every kernel applies to its partial tiles.

Windows are bottom-right aligned (causal is the window (-1, 0)): with offset = seqlen_k -
seqlen_q, query row i sees key col j iff i + offset - window_left <= j <= i + offset +
window_right, a side of -1 unbounded. Keys at or past seqlen_k (the zero-filled tail of the
last key tile) are never seen.
"""
import functools

from numba import cuda


@functools.lru_cache(maxsize=None)
def make_mask(spec, key_bound=True):
    """visible(row, col, seqlen_k, offset) -> bool for the call's spec (for_kernels()).

    key_bound=False leaves out the test against seqlen_k, for kernels whose rows past seqlen_k
    are never stored (dK/dV, with block_range's key_bound=False); there it would cost
    registers for nothing (two more took the d64 dK/dV kernel from three blocks per
    multiprocessor to two)."""
    left, right = spec.window_left, spec.window_right

    @cuda.jit(device=True, inline="always")
    def visible(row, col, seqlen_k, offset):
        if key_bound and col >= seqlen_k:
            return False
        if right >= 0 and col > row + offset + right:
            return False
        return left < 0 or col >= row + offset - left

    return visible
