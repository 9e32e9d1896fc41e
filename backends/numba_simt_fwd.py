"""FlashAttention forward pass, SIMT (CUDA cores, float32 arithmetic), as a Numba kernel.

One thread block per (query tile of BLOCK_M rows, head, batch). The Q tile stays in shared
memory; K and V tiles of BLOCK_N keys stream through one shared buffer. Each thread holds a
register tile of the scores S and of the output accumulator `acc`. Per query row the block keeps
the running max `m_i` and running sum `l_i` (online softmax); when the max grows, `acc` and `l_i`
are rescaled by exp(m_old - m_new). Scores are kept in log2 units (Q is pre-scaled by
softmax_scale·log2(e)) so that every exponential is one exp2. The output tile and the row
log-sum-exp are written once, at the end. Causal: key tiles wholly in the future are never
visited and only tiles that cross the diagonal (or the ragged end of K) are masked.
"""
import functools
import math

import numpy as np
from numba import cuda, float32

from numba_flash.config import simt_forward_config
from numba_flash.intrinsics import SHARED_ALIGN, exp2

from .numba_bits16 import float32_to_bf16_bits, unchanged
from .numba_constants import LN2, LOG2E, NEG_INF, ONE, ZERO, key_end, query_tile
from .numba_launch import launch
from .numba_tiles import make_load_tile, make_tile_accumulate, make_tile_dot, row_stride


@functools.lru_cache(maxsize=None)
def forward_kernel_function(config, head_dim, causal, bf16=False):
    """The plain Python kernel for one (tile config, head_dim, causal, dtype); see
    forward_kernel. With bf16, q, k, v and out hold bfloat16 bit patterns."""
    BLOCK_M, BLOCK_N = config.block_m, config.block_n
    TX, TY = config.threads_x, config.threads_y
    D_PAD = config.padded_head_dim(head_dim)
    TM = BLOCK_M // TY  # query rows per thread
    TN = BLOCK_N // TX  # score columns per thread
    TD = D_PAD // TX  # output columns per thread (contiguous)
    load_q_tile = make_load_tile(BLOCK_M, head_dim, D_PAD, config.threads, bf16)
    load_kv_tile = make_load_tile(BLOCK_N, head_dim, D_PAD, config.threads, bf16)
    encode = float32_to_bf16_bits if bf16 else unchanged
    tile_scores = make_tile_dot(TM, TN, TY, TX, D_PAD)
    accumulate_pv = make_tile_accumulate(TM, TD, TY, BLOCK_N)
    # Shared-array shapes must be compile-time tuples.
    Q_SHAPE = (BLOCK_M, row_stride(D_PAD))
    KV_SHAPE = (BLOCK_N, row_stride(D_PAD))
    P_SHAPE = (BLOCK_M, BLOCK_N + TX)  # +TX: the threads' scalar stores of P avoid bank conflicts
    PARTIAL_SHAPE = (BLOCK_M, TX)
    S_SHAPE = (TM, TN)
    ACC_SHAPE = (TM, TD)

    def flash_forward(q, k, v, out, lse, scale_log2):
        tx = cuda.threadIdx.x % TX
        ty = cuda.threadIdx.x // TX
        m0 = query_tile(causal) * BLOCK_M
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        offset = seqlen_k - seqlen_q  # causal: query i sees key j iff j <= i + offset

        q_tile = cuda.shared.array(Q_SHAPE, float32, SHARED_ALIGN)
        kv_tile = cuda.shared.array(KV_SHAPE, float32, SHARED_ALIGN)
        p_tile = cuda.shared.array(P_SHAPE, float32, SHARED_ALIGN)
        row_partial = cuda.shared.array(PARTIAL_SHAPE, float32)

        s = cuda.local.array(S_SHAPE, float32)
        acc = cuda.local.array(ACC_SHAPE, float32)
        m_i = cuda.local.array(TM, float32)
        l_i = cuda.local.array(TM, float32)  # this thread's share of the row sum
        for i in range(TM):
            m_i[i] = NEG_INF
            l_i[i] = ZERO
            for jd in range(TD):
                acc[i, jd] = ZERO

        # Load: the Q tile, once, pre-scaled so that scores come out in log2 units.
        load_q_tile(q_tile, q, b, m0, h, seqlen_q, scale_log2)

        n_end = key_end(causal, seqlen_k, m0, BLOCK_M, offset)
        for n0 in range(0, n_end, BLOCK_N):
            # Load: the K tile.
            load_kv_tile(kv_tile, k, b, n0, h, seqlen_k, ONE)
            cuda.syncthreads()  # why: K tile (and, first time, Q tile) fully written before reads

            # Scores: S = Q K^T for this thread's register tile.
            tile_scores(s, q_tile, kv_tile, ty, tx)
            if n0 + BLOCK_N > seqlen_k or (causal and n0 + BLOCK_N - 1 > m0 + offset):
                for i in range(TM):
                    row = m0 + ty + TY * i
                    for j in range(TN):
                        col = n0 + tx + TX * j
                        if col >= seqlen_k or (causal and col > row + offset):
                            s[i, j] = NEG_INF

            # Row max: a partial over this thread's columns, combined through shared memory.
            for i in range(TM):
                partial = s[i, 0]
                for j in range(1, TN):
                    partial = max(partial, s[i, j])
                row_partial[ty + TY * i, tx] = partial
            cuda.syncthreads()  # why: partial maxima visible; all reads of the K tile are done

            # Rescale: m_new, alpha = exp2(m_old - m_new); P = exp2(S - m_new) into shared memory.
            for i in range(TM):
                r = ty + TY * i
                m_new = m_i[i]
                for t in range(TX):
                    m_new = max(m_new, row_partial[r, t])
                m_ref = m_new if m_new != NEG_INF else ZERO  # row has seen no key yet
                alpha = exp2(m_i[i] - m_ref)
                m_i[i] = m_new
                l_new = ZERO
                for j in range(TN):
                    p = exp2(s[i, j] - m_ref)
                    p_tile[r, tx + TX * j] = p
                    l_new += p
                l_i[i] = l_i[i] * alpha + l_new
                for jd in range(TD):
                    acc[i, jd] *= alpha

            # Load: the V tile, into the buffer the K tile used.
            load_kv_tile(kv_tile, v, b, n0, h, seqlen_k, ONE)
            cuda.syncthreads()  # why: P tile and V tile fully written before P·V reads them

            # Accumulate: acc += P V.
            accumulate_pv(acc, p_tile, kv_tile, ty, tx)
            cuda.syncthreads()  # why: P and V reads done before the next tile overwrites them

        # Epilogue: l = sum of the threads' partial row sums; out = acc / l; lse = m + log(l).
        for i in range(TM):
            row_partial[ty + TY * i, tx] = l_i[i]
        cuda.syncthreads()  # why: every partial row sum written before the row totals are read
        for i in range(TM):
            r = ty + TY * i
            row = m0 + r
            l_row = ZERO
            for t in range(TX):
                l_row += row_partial[r, t]
            if row < seqlen_q:
                no_key = l_row == ZERO  # (a NaN input leaves l NaN, and NaN propagates)
                inv_l = ZERO if no_key else ONE / l_row
                for jd in range(TD):
                    col = tx * TD + jd
                    if col < head_dim:
                        out[b, row, h, col] = encode(acc[i, jd] * inv_l)
                if tx == 0:
                    if no_key:
                        lse[b, h, row] = NEG_INF
                    else:
                        lse[b, h, row] = (m_i[i] + math.log2(l_row)) * LN2

    return flash_forward


@functools.lru_cache(maxsize=None)
def forward_kernel(config, head_dim, causal, bf16=False):
    """The compiled (lazily specialised on argument types) forward kernel."""
    return cuda.jit(forward_kernel_function(config, head_dim, causal, bf16), cache=True)


def launch_forward(q, k, v, out, lse, causal, softmax_scale, stream=0, config=None, bf16=False):
    """Launch the SIMT forward on device (or, under the simulator, host) arrays; with bf16,
    q, k, v, out are uint16 views of bfloat16 data. `config` overrides the heuristic's tile
    shape (for tuning)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    config = config or simt_forward_config(head_dim)
    grid = (-(-seqlen_q // config.block_m), nheads, batch)
    kernel = forward_kernel(config, head_dim, causal, bf16)
    scale_log2 = np.float32(softmax_scale * float(LOG2E))
    launch(kernel, grid, config.threads, stream, 0, q, k, v, out, lse, scale_log2)
