"""Which keys a query sees: the element predicate every kernel applies to its partial tiles.

Windows are bottom-right aligned (causal is the window (-1, 0)): with offset = seqlen_k -
seqlen_q, query row i sees key col j iff i + offset - window_left <= j <= i + offset +
window_right, a side of -1 unbounded. Keys at or past seqlen_k (the zero-filled tail of the
last key tile) are never seen. A boolean attn_mask (device/attn_mask.py) hides the keys it
says False for, a mask_mod (device/mask_mod.py) those it returns False for.
"""
import functools

from numba import cuda

from .attn_mask import make_mask_readers
from .mask_mod import make_mask_mod_reader


@functools.lru_cache(maxsize=None)
def make_mask(spec, key_bound=True):
    """visible(row, col, seqlen_k, offset, mask_at) -> bool for the call's spec
    (for_kernels()); mask_at: the block's (attn_mask, b, h) (device/attn_mask.py; b the
    sequence, blockIdx.z).

    key_bound=False leaves out the test against seqlen_k, for kernels whose rows past seqlen_k
    are never stored (dK/dV, with block_range's key_bound=False); there it would cost
    registers for nothing (two more took the d64 dK/dV kernel from three blocks per
    multiprocessor to two)."""
    left, right = spec.window_left, spec.window_right
    allows = make_mask_readers(spec)[0]
    mod_allows = make_mask_mod_reader(spec)

    @cuda.jit(device=True, inline="always")
    def visible(row, col, seqlen_k, offset, mask_at):
        if key_bound and col >= seqlen_k:
            return False
        if right >= 0 and col > row + offset + right:
            return False
        if left >= 0 and col < row + offset - left:
            return False
        return (allows(mask_at, row, col, seqlen_k - offset, seqlen_k)
                and mod_allows(mask_at, row, col, seqlen_k - offset, seqlen_k))

    return visible
