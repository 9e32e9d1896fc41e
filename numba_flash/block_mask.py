"""Block masks: a mask_mod's tile classification, kept for reuse (FlexAttention's
create_block_mask).

A call with `mask_mod` first classifies every (query tile, key tile) of its kernels as empty
(no query sees a key: skipped), full (every query sees every key: the predicate is not
called) or partial (the predicate decides element by element). That costs one evaluation of
mask_mod per (query, key) pair; a BlockMask keeps the classification, so that the layers and
steps that share a mask pay it once:

    document_mask = numba_flash.block_mask(mask_mod, None, None, seqlen_q, seqlen_k)
    out, lse = numba_flash.forward(q, k, v, block_mask=document_mask)

The classification is built on first use for each tile shape a kernel runs (the forward and
the two backward kernels may differ), GQA group and window on the call's GPU, by the Numba
backend, and reused after; the other backends evaluate mask_mod densely and ignore it.
batch or nheads None: the mask does not depend on b (or h); the classification for b = 0
(h = 0) serves them all.
The classification is of the values mask_mod's captured arrays had when it was made: new
values (the next batch's document ids) need a new BlockMask, whose kernels are the ones
already compiled (the arrays are arguments of the kernels: numba_flash/mask_mod.py).
"""
import numbers
import threading
from collections import OrderedDict

from .spec import check_mask_mod


class BlockMask:
    """What numba_flash.block_mask returns: mask_mod, the sizes it was built for, and the
    classifications made so far (one per device, tile shape, GQA group and window)."""

    def __init__(self, mask_mod, batch, nheads, seqlen_q, seqlen_k):
        self.mask_mod = mask_mod
        self.batch, self.nheads = batch, nheads
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self._tables = {}
        self._lock = threading.Lock()
        #: replays of the calls made with it, by signature (numba_flash/call_cache.py)
        self.replays = OrderedDict()

    def tables(self, key, build):
        """The classification under `key` (the backend's: device, tile shape, GQA group and
        window), made by build() the first time."""
        with self._lock:
            if key not in self._tables:
                self._tables[key] = build()
            return self._tables[key]

    def check_call(self, batch, nheads, seqlen_q, seqlen_k):
        """ValueError unless this block mask was built for this call's sizes (its mask_mod is
        the call's: _checks.mask_mod_of)."""
        for name, built, called in (("batch", self.batch, batch), ("nheads", self.nheads, nheads),
                                    ("seqlen_q", self.seqlen_q, seqlen_q),
                                    ("seqlen_k", self.seqlen_k, seqlen_k)):
            if built is not None and built != called:
                raise ValueError(f"block_mask was built for {name} = {built}; the call has "
                                 f"{name} = {called}")

    def __repr__(self):
        return (f"BlockMask({self.mask_mod.__name__}, batch={self.batch}, nheads={self.nheads}, "
                f"seqlen_q={self.seqlen_q}, seqlen_k={self.seqlen_k})")


def _size(name, value, optional):
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        allowed = "an int >= 1 or None (the mask does not depend on it)" if optional else (
            "an int >= 1")
        raise (ValueError if isinstance(value, numbers.Integral) and not isinstance(value, bool)
               else TypeError)(f"{name} must be {allowed}; got {value!r}")
    return int(value)


def block_mask(mask_mod, batch, nheads, seqlen_q, seqlen_k):
    """A BlockMask for mask_mod(b, h, q_idx, kv_idx) -> bool over (batch, nheads, seqlen_q,
    seqlen_k), to pass as forward's and backward's `block_mask` (the call's mask_mod may
    then be left out). batch or nheads None: mask_mod does not depend on that index."""
    return BlockMask(check_mask_mod(mask_mod) if mask_mod is not None else _no_mask_mod(),
                     _size("batch", batch, True), _size("nheads", nheads, True),
                     _size("seqlen_q", seqlen_q, False), _size("seqlen_k", seqlen_k, False))


def _no_mask_mod():
    raise TypeError("mask_mod must be a Python function mask_mod(b, h, q_idx, kv_idx) -> bool; "
                    "got None")
