"""The splits' merge of split-KV decoding: `combine_kernel`, one warp per (sequence, token,
head), combines the decode kernel's float32 partial outputs by log-sum-exp
(numba_flash/merge.py's rule; a split that saw no key has weight 0) into out and lse."""
import functools
import math

from numba import cuda, float32

from ..device.constants import NEG_INF, ZERO
from ..device.bits16 import float32_to_bf16_bits, unchanged
from .kernels import WARPS, warp_max, warp_sum

#: splits a lane reads per step of its loop: with every column of the lane in each step,
#: SPLITS_PER_STEP x ceil(head_dim / 32) loads in flight (one sequence's 30-100 splits would
#: otherwise be read one latency after the other)
SPLITS_PER_STEP = 2


@functools.lru_cache(maxsize=None)
def combine_kernel(bf16, head_dim):
    """out, lse from the splits' float32 outputs and lses: one warp per (b, t, h) row, the
    row's max and sum over the splits first (lanes over splits), then each lane's columns
    lane + 32·c over every split."""
    encode = float32_to_bf16_bits if bf16 else unchanged
    OUT_COLS = -(-head_dim // 32)

    def combine(out_part, lse_part, out, lse):
        splits, batch, seqlen_q, nheads, D = out_part.shape
        row = cuda.blockIdx.x * WARPS + cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        if row >= batch * seqlen_q * nheads:
            return
        h, t, b = row % nheads, row // nheads % seqlen_q, row // (nheads * seqlen_q)
        top = NEG_INF
        for s in range(lane, splits, 32):
            top = max(top, lse_part[s, b, h, t])
        top = warp_max(top)
        ref = top if top != NEG_INF else ZERO  # (no split saw a key: every weight 0)
        total = ZERO
        for s in range(lane, splits, 32):
            total += math.exp(lse_part[s, b, h, t] - ref)
        total = warp_sum(total)
        inv_total = ZERO if total == ZERO else float32(1.0) / total
        acc = cuda.local.array(OUT_COLS, float32)
        for c in range(OUT_COLS):
            acc[c] = ZERO
        for s0 in range(0, splits, SPLITS_PER_STEP):
            for u in range(SPLITS_PER_STEP):
                s = s0 + u
                if s < splits:
                    # (a split without keys: weight exp(-inf) = 0, its output rows zeros)
                    weight = math.exp(lse_part[s, b, h, t] - ref) * inv_total
                    for c in range(OUT_COLS):
                        col = lane + 32 * c
                        if col < D:
                            acc[c] += weight * out_part[s, b, t, h, col]
        for c in range(OUT_COLS):
            col = lane + 32 * c
            if col < D:
                out[b, t, h, col] = encode(acc[c])
        if lane == 0:
            lse[b, h, t] = top + math.log(total) if top != NEG_INF else NEG_INF

    return cuda.jit(combine, cache=True)
