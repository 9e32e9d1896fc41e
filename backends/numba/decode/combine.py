"""The splits' merge of split-KV decoding: `combine_kernel`, one warp per (sequence, token,
head), combines the decode kernel's float32 partial outputs by log-sum-exp
(numba_flash/merge.py's rule; a split that saw no key has weight 0) into out and lse."""
import functools
import math

from numba import cuda

from ..device.bits16 import float32_to_bf16_bits, unchanged
from ..device.constants import NEG_INF, ZERO
from .kernels import WARPS


@functools.lru_cache(maxsize=None)
def combine_kernel(bf16):
    """out, lse from the splits' float32 outputs and lses: one warp per (b, t, h) row."""
    encode = float32_to_bf16_bits if bf16 else unchanged

    def combine(out_part, lse_part, out, lse):
        splits, batch, seqlen_q, nheads, D = out_part.shape
        row = cuda.blockIdx.x * WARPS + cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        if row >= batch * seqlen_q * nheads:
            return
        h, t, b = row % nheads, row // nheads % seqlen_q, row // (nheads * seqlen_q)
        top = NEG_INF
        for s in range(splits):
            top = max(top, lse_part[s, b, h, t])
        total = ZERO
        if top != NEG_INF:
            for s in range(splits):
                total += math.exp(lse_part[s, b, h, t] - top)
        for col in range(lane, D, 32):
            value = ZERO
            if top != NEG_INF:
                for s in range(splits):
                    part = lse_part[s, b, h, t]
                    if part != NEG_INF:  # (a split without keys: weight 0, output unread)
                        value += math.exp(part - top) / total * out_part[
                            s, b, t, h, col]
            out[b, t, h, col] = encode(value)
        if lane == 0:
            lse[b, h, t] = top + math.log(total) if top != NEG_INF else NEG_INF

    return cuda.jit(combine, cache=True)
