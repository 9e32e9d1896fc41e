"""float32 constants and tiny device helpers shared by the Numba kernels."""
import math

import numpy as np
from numba import cuda

LOG2E = np.float32(1.4426950408889634)  # scores are kept in log2 units: exp(x) = exp2(x·log2 e)
LN2 = np.float32(math.log(2.0))
NEG_INF = np.float32(-np.inf)
POS_INF = np.float32(np.inf)
ZERO = np.float32(0.0)
ONE = np.float32(1.0)


@cuda.jit(device=True, inline="always")
def lse_log2(value):
    """lse in log2 units; a row that saw no key (lse = -inf) gets +inf so that
    P = exp2(S - lse) = 0 there instead of NaN."""
    return value * LOG2E if value != NEG_INF else POS_INF


# Causal tile skipping (bottom-right aligned: query i sees key j iff j <= i + offset, with
# offset = seqlen_k - seqlen_q).

@cuda.jit(device=True, inline="always")
def key_end(causal, seqlen_k, m0, block_m, offset):
    """End of the keys that query rows [m0, m0 + block_m) can see: tiles past it are skipped."""
    return min(seqlen_k, m0 + block_m + offset) if causal else seqlen_k


@cuda.jit(device=True, inline="always")
def query_begin(causal, n0, offset, block_m):
    """Start of the first query tile that can see key n0: earlier tiles are skipped."""
    return max(0, n0 - offset) // block_m * block_m if causal else 0


@cuda.jit(device=True, inline="always")
def query_tile(causal):
    """The query tile of this block (blockIdx.x). Under causal masking the last tiles see the
    most keys; they are given the first block indices, which the GPU starts first, so that the
    grid ends on short blocks instead of waiting on a long one (longest job first)."""
    return cuda.gridDim.x - 1 - cuda.blockIdx.x if causal else cuda.blockIdx.x
