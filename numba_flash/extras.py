"""The arrays of a call besides q, k, v (and dout, out, lse): ALiBi's slopes, varlen's
cumulative sequence lengths and the attention mask (their checks are numba_flash._checks'),
and a mask_mod's block mask and captured arrays.

The spec says whether a call has them (spec.alibi, spec.varlen, spec.attn_mask); their values
travel beside the spec as one `Extras`, which every backend's forward and backward take. Their
values are read by the kernels, never compiled in: new slopes, sequence lengths, mask values
or arrays a mask_mod captures compile nothing.
"""
from typing import NamedTuple

import numpy as np

from . import _arrays


class Extras(NamedTuple):
    """alibi_slopes: float32 (nheads,) or (batch, nheads), or None. cu_seqlens_q,
    cu_seqlens_k: int32 (batch + 1,) offsets of the packed sequences (varlen), or None.
    attn_mask: boolean or floating, broadcastable to (batch, nheads, seqlen_q, seqlen_k), or
    None. block_mask: the numba_flash.block_mask.BlockMask of a call with mask_mod, or None
    (not an array: a call's replays are kept in it, numba_flash/call_cache.py);
    mask_mod_arrays: the arrays the call's mask_mod captures, in its MaskModProgram's
    parameter order (numba_flash.mask_mod)."""
    alibi_slopes: object = None
    cu_seqlens_q: object = None
    cu_seqlens_k: object = None
    attn_mask: object = None
    block_mask: object = None
    mask_mod_arrays: tuple = ()

    def arrays(self):
        """The arrays present, in field order, then mask_mod's (what a call's signature and
        replay take)."""
        if self is NO_EXTRAS:  # (every plain call: nothing to look at)
            return ()
        return tuple(x for x in self[:4] if x is not None) + self.mask_mod_arrays

    def with_arrays(self, arrays):
        """The same fields filled from `arrays` (as arrays() returned them) in order."""
        values = iter(arrays)
        fields = [None if x is None else next(values) for x in self[:4]]
        return Extras(*fields, self.block_mask, tuple(values))


NO_EXTRAS = Extras()


def host_values(x):
    """A small array's values on the host (a device array is copied: one synchronisation)."""
    kind = _arrays.array_kind(x)
    if kind == _arrays.HOST:
        return np.asarray(_arrays.as_numpy(x))
    if kind == _arrays.CUPY:
        return x.get()
    if kind == _arrays.TORCH:
        return x.detach().cpu().numpy()
    from numba import cuda
    return cuda.as_cuda_array(x).copy_to_host()
