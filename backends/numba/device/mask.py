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
from .block_range import FULL
from .mask_mod import make_mask_mod_reader

#: what a visited tile's elements are tested against: nothing (MASK_NONE); the window,
#: causal, the sequence ends and an attn_mask (MASK_BOUNDS); those and mask_mod (MASK_ALL)
MASK_NONE, MASK_BOUNDS, MASK_ALL = 0, 1, 2


@cuda.jit(device=True, inline="always")
def tile_mask(bounds_partial, kind):
    """The mask a visited tile needs, from block_range's is_partial and mask_mod's class of
    the tile: a tile mask_mod sees whole (FULL) skips its predicate, which may read memory
    per element."""
    if kind != FULL:
        return MASK_ALL
    return MASK_BOUNDS if bounds_partial else MASK_NONE


@functools.lru_cache(maxsize=None)
def make_mask(spec, key_bound=True):
    """visible(row, col, seqlen_k, offset, mask_at, with_mod) -> bool for the call's spec
    (for_kernels()); mask_at: the block's (attn_mask, b, h) (device/attn_mask.py; b the
    sequence, blockIdx.z); with_mod: whether mask_mod is asked too (tile_mask's MASK_ALL).

    key_bound=False leaves out the test against seqlen_k, for kernels whose rows past seqlen_k
    are never stored (dK/dV, with block_range's key_bound=False); there it would cost
    registers for nothing (two more took the d64 dK/dV kernel from three blocks per
    multiprocessor to two)."""
    left, right = spec.window_left, spec.window_right
    allows = make_mask_readers(spec)[0]
    mod_allows = make_mask_mod_reader(spec)

    @cuda.jit(device=True, inline="always")
    def seen_with_mod(row, col, seqlen_k, offset, mask_at):
        # Every test evaluated and combined with &, mask_mod asked at indices inside the
        # bounds: no branch per element, so a lane's elements of one row or key share the
        # loads a mask_mod makes
        seen = mod_allows(mask_at, row, col, seqlen_k - offset, seqlen_k)
        if key_bound:
            seen = seen & (col < seqlen_k)
        if right >= 0:
            seen = seen & (col <= row + offset + right)
        if left >= 0:
            seen = seen & (col >= row + offset - left)
        return seen & allows(mask_at, row, col, seqlen_k - offset, seqlen_k)

    @cuda.jit(device=True, inline="always")
    def visible(row, col, seqlen_k, offset, mask_at, with_mod):
        if with_mod:
            return seen_with_mod(row, col, seqlen_k, offset, mask_at)
        if key_bound and col >= seqlen_k:
            return False
        if right >= 0 and col > row + offset + right:
            return False
        if left >= 0 and col < row + offset - left:
            return False
        # (the `or`, never taken here, stays: without it ptxas spilled 40 bytes in the d64
        # dK/dV kernel with a floating mask and every variant)
        return (allows(mask_at, row, col, seqlen_k - offset, seqlen_k)
                and (not with_mod or mod_allows(mask_at, row, col, seqlen_k - offset,
                                                seqlen_k)))

    return visible
