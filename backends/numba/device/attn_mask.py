"""The call's attention mask (attn_mask), read element by element where a kernel needs it.

The kernels see the mask as a 4-D array (batch, nheads, seqlen_q, seqlen_k) whose broadcast
dimensions have stride 0 (marshal.kernel_extras), bfloat16 as its bit patterns. A block
passes `mask_at = (attn_mask, b, h, mask_mod_arrays)`, its batch entry and query head (and
device/mask_mod.py's captured arrays), to these readers, which read nothing outside
seqlen_q x seqlen_k: the rows and keys past the ends that a
kernel's last tiles compute (and never store) get "not seen" from a boolean mask, and a
float mask's bias of the nearest row or key inside (read without a branch; those scores are
masked or never stored).
"""
import functools

from numba import cuda, float32

from .bits16 import bf16_bits_to_float32
from .constants import LOG2E, ZERO


@functools.lru_cache(maxsize=None)
def make_mask_readers(spec):
    """(allows, bias) for the spec (for_kernels()):

    allows(mask_at, row, col, seqlen_q, seqlen_k) -> whether a boolean mask lets query row
        see key col (True without a boolean mask, inside the bounds);
    bias(mask_at, row, col, seqlen_q, seqlen_k) -> a floating mask's value there in log2
        units (0 without one)."""
    boolean, dtype = spec.bool_mask, spec.attn_mask

    @cuda.jit(device=True, inline="always")
    def value(mask_at, row, col):
        attn_mask, b, h, _ = mask_at
        x = attn_mask[b, h, row, col]
        if dtype == "bfloat16":
            return bf16_bits_to_float32(x)
        return float32(x)  # (float16: a conversion the compiler sees, not inline PTX, so that
        #                    the loops over a tile's scores still unroll)

    @cuda.jit(device=True, inline="always")
    def allows(mask_at, row, col, seqlen_q, seqlen_k):
        if not boolean:
            return True
        if row >= seqlen_q or col >= seqlen_k:
            return False
        attn_mask, b, h, _ = mask_at
        return bool(attn_mask[b, h, row, col])

    @cuda.jit(device=True, inline="always")
    def bias(mask_at, row, col, seqlen_q, seqlen_k):
        if boolean or dtype is None:
            return ZERO
        return value(mask_at, min(row, seqlen_q - 1), min(col, seqlen_k - 1)) * LOG2E

    return allows, bias
