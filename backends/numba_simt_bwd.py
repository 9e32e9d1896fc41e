"""FlashAttention backward pass, SIMT (CUDA cores, float32 arithmetic), as Numba kernels.

Nothing of the forward's score matrix is stored: each tile of P is recomputed from Q, K and the
saved row log-sum-exp, P = exp(S - lse). With D_i = rowsum(dO_i * O_i):

    dV = Pᵀ dO      dP = dO Vᵀ      dS = P * (dP - D)      dQ = scale·dS K      dK = scale·dSᵀ Q

Three launches, no floating-point atomics, so repeated runs are bitwise identical:
  1. `delta`: D_i for every query row.
  2. `dk_dv`: one block per key tile; loops over the query tiles that can see it (causal: it
     starts at the first query tile on or below the diagonal) and accumulates dK, dV in registers.
  3. `dq`: one block per query tile; loops over the key tiles it can see, accumulating dQ.
Scores are in log2 units (one operand pre-scaled by softmax_scale·log2(e), lse by log2(e)).
"""
import functools

import numpy as np
from numba import cuda, float32

from numba_flash.config import simt_backward_config
from numba_flash.intrinsics import SHARED_ALIGN, exp2

from .numba_bits16 import bf16_bits_to_float32
from .numba_constants import (LOG2E, ONE, POS_INF, ZERO, key_end, lse_log2, query_begin,
                              query_tile)
from .numba_launch import launch
from .numba_tiles import (make_load_tile, make_store_tile, make_tile_accumulate, make_tile_dot,
                          row_stride)

DELTA_THREADS = 128


@functools.lru_cache(maxsize=None)
def delta_kernel_function(head_dim, to_float32=float32):
    """delta[b, h, i] = sum_d dout[b, i, h, d] * out[b, i, h, d], one thread per row.
    `to_float32` turns one array element into float32: a decoder from numba_bits16 for arrays
    of 16-bit patterns."""
    convert = to_float32

    def flash_bwd_delta(dout, out, delta):
        row = cuda.blockIdx.x * DELTA_THREADS + cuda.threadIdx.x
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        if row < out.shape[1]:
            total = ZERO
            for d in range(head_dim):
                total += convert(dout[b, row, h, d]) * convert(out[b, row, h, d])
            delta[b, h, row] = total

    return flash_bwd_delta


def _dk_dv_kernel_function(config, head_dim, causal, bf16):
    BLOCK_M, BLOCK_N = config.block_m, config.block_n
    TX, TY = config.threads_x, config.threads_y
    D_PAD = config.padded_head_dim(head_dim)
    TK = BLOCK_N // TY  # key rows per thread
    TQ = BLOCK_M // TX  # query columns of the transposed score tile per thread
    TD = D_PAD // TX  # dK / dV columns per thread
    load_k_tile = make_load_tile(BLOCK_N, head_dim, D_PAD, config.threads, bf16)
    load_q_tile = make_load_tile(BLOCK_M, head_dim, D_PAD, config.threads, bf16)
    tile_scores = make_tile_dot(TK, TQ, TY, TX, D_PAD)
    accumulate = make_tile_accumulate(TK, TD, TY, BLOCK_M)
    store_tile = make_store_tile(TK, TD, TY, head_dim, bf16)
    K_SHAPE = (BLOCK_N, row_stride(D_PAD))
    Q_SHAPE = (BLOCK_M, row_stride(D_PAD))
    P_SHAPE = (BLOCK_N, BLOCK_M + TX)  # +TX: the threads' scalar stores avoid bank conflicts
    REG_S = (TK, TQ)
    REG_D = (TK, TD)

    def flash_bwd_dk_dv(q, k, v, dout, lse, delta, dk, dv, scale_log2, softmax_scale):
        tx = cuda.threadIdx.x % TX
        ty = cuda.threadIdx.x // TX
        n0 = cuda.blockIdx.x * BLOCK_N
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        offset = seqlen_k - seqlen_q  # causal: query i sees key j iff j <= i + offset

        k_tile = cuda.shared.array(K_SHAPE, float32, SHARED_ALIGN)
        v_tile = cuda.shared.array(K_SHAPE, float32, SHARED_ALIGN)
        q_tile = cuda.shared.array(Q_SHAPE, float32, SHARED_ALIGN)
        do_tile = cuda.shared.array(Q_SHAPE, float32, SHARED_ALIGN)
        p_tile = cuda.shared.array(P_SHAPE, float32, SHARED_ALIGN)
        ds_tile = cuda.shared.array(P_SHAPE, float32, SHARED_ALIGN)
        lse_tile = cuda.shared.array(BLOCK_M, float32)
        delta_tile = cuda.shared.array(BLOCK_M, float32)

        s = cuda.local.array(REG_S, float32)  # Sᵀ: key rows x query columns
        dp = cuda.local.array(REG_S, float32)  # dPᵀ
        dk_acc = cuda.local.array(REG_D, float32)
        dv_acc = cuda.local.array(REG_D, float32)
        for i in range(TK):
            for jd in range(TD):
                dk_acc[i, jd] = ZERO
                dv_acc[i, jd] = ZERO

        # Load: K (pre-scaled, it only enters the scores) and V, once.
        load_k_tile(k_tile, k, b, n0, h, seqlen_k, scale_log2)
        load_k_tile(v_tile, v, b, n0, h, seqlen_k, ONE)

        m_begin = query_begin(causal, n0, offset, BLOCK_M)
        for m0 in range(m_begin, seqlen_q, BLOCK_M):
            # Load: Q, dO, lse, D for this query tile (rows past seqlen_q: zeros and lse = +inf).
            load_q_tile(q_tile, q, b, m0, h, seqlen_q, ONE)
            load_q_tile(do_tile, dout, b, m0, h, seqlen_q, ONE)
            for r in range(cuda.threadIdx.x, BLOCK_M, TX * TY):
                in_range = m0 + r < seqlen_q
                lse_tile[r] = lse_log2(lse[b, h, m0 + r]) if in_range else POS_INF
                delta_tile[r] = delta[b, h, m0 + r] if in_range else ZERO
            cuda.syncthreads()  # why: Q, dO, lse, D tiles (and K, V the first time) complete

            # Scores: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ; then P = exp2(S - lse), dS = P (dP - D).
            tile_scores(s, k_tile, q_tile, ty, tx)
            tile_scores(dp, v_tile, do_tile, ty, tx)
            needs_mask = causal and n0 + BLOCK_N - 1 > m0 + offset
            for i in range(TK):
                r = ty + TY * i
                for j in range(TQ):
                    c = tx + TX * j
                    p = exp2(s[i, j] - lse_tile[c])
                    if needs_mask and n0 + r > m0 + c + offset:
                        p = ZERO
                    p_tile[r, c] = p
                    ds_tile[r, c] = p * (dp[i, j] - delta_tile[c])
            cuda.syncthreads()  # why: P and dS tiles complete before the products read them

            # Accumulate: dV += Pᵀ dO, dK += dSᵀ Q (scaled at the end).
            accumulate(dv_acc, p_tile, do_tile, ty, tx)
            accumulate(dk_acc, ds_tile, q_tile, ty, tx)
            cuda.syncthreads()  # why: all reads done before the next query tile overwrites them

        # Epilogue: one write of dK and dV.
        store_tile(dk, dk_acc, b, n0, h, seqlen_k, ty, tx, softmax_scale)
        store_tile(dv, dv_acc, b, n0, h, seqlen_k, ty, tx, ONE)

    return flash_bwd_dk_dv


def _dq_kernel_function(config, head_dim, causal, bf16):
    BLOCK_M, BLOCK_N = config.block_m, config.block_n
    TX, TY = config.threads_x, config.threads_y
    D_PAD = config.padded_head_dim(head_dim)
    TM = BLOCK_M // TY  # query rows per thread
    TN = BLOCK_N // TX  # key columns per thread
    TD = D_PAD // TX  # dQ columns per thread
    load_q_tile = make_load_tile(BLOCK_M, head_dim, D_PAD, config.threads, bf16)
    load_k_tile = make_load_tile(BLOCK_N, head_dim, D_PAD, config.threads, bf16)
    tile_scores = make_tile_dot(TM, TN, TY, TX, D_PAD)
    accumulate = make_tile_accumulate(TM, TD, TY, BLOCK_N)
    store_tile = make_store_tile(TM, TD, TY, head_dim, bf16)
    Q_SHAPE = (BLOCK_M, row_stride(D_PAD))
    K_SHAPE = (BLOCK_N, row_stride(D_PAD))
    DS_SHAPE = (BLOCK_M, BLOCK_N + TX)
    REG_S = (TM, TN)
    REG_D = (TM, TD)

    def flash_bwd_dq(q, k, v, dout, lse, delta, dq, scale_log2, softmax_scale):
        tx = cuda.threadIdx.x % TX
        ty = cuda.threadIdx.x // TX
        m0 = query_tile(causal) * BLOCK_M
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        offset = seqlen_k - seqlen_q

        q_tile = cuda.shared.array(Q_SHAPE, float32, SHARED_ALIGN)
        do_tile = cuda.shared.array(Q_SHAPE, float32, SHARED_ALIGN)
        k_tile = cuda.shared.array(K_SHAPE, float32, SHARED_ALIGN)
        v_tile = cuda.shared.array(K_SHAPE, float32, SHARED_ALIGN)
        ds_tile = cuda.shared.array(DS_SHAPE, float32, SHARED_ALIGN)

        s = cuda.local.array(REG_S, float32)
        dp = cuda.local.array(REG_S, float32)
        dq_acc = cuda.local.array(REG_D, float32)
        lse_i = cuda.local.array(TM, float32)
        delta_i = cuda.local.array(TM, float32)
        for i in range(TM):
            row = m0 + ty + TY * i
            lse_i[i] = lse_log2(lse[b, h, row]) if row < seqlen_q else POS_INF
            delta_i[i] = delta[b, h, row] if row < seqlen_q else ZERO
            for jd in range(TD):
                dq_acc[i, jd] = ZERO

        # Load: Q (pre-scaled, it only enters the scores) and dO, once.
        load_q_tile(q_tile, q, b, m0, h, seqlen_q, scale_log2)
        load_q_tile(do_tile, dout, b, m0, h, seqlen_q, ONE)

        n_end = key_end(causal, seqlen_k, m0, BLOCK_M, offset)
        for n0 in range(0, n_end, BLOCK_N):
            # Load: K, V tiles.
            load_k_tile(k_tile, k, b, n0, h, seqlen_k, ONE)
            load_k_tile(v_tile, v, b, n0, h, seqlen_k, ONE)
            cuda.syncthreads()  # why: K, V (and, first time, Q, dO) tiles complete before reads

            # Scores: S = Q Kᵀ, dP = dO Vᵀ; P = exp2(S - lse); dS = P (dP - D).
            tile_scores(s, q_tile, k_tile, ty, tx)
            tile_scores(dp, do_tile, v_tile, ty, tx)
            needs_mask = n0 + BLOCK_N > seqlen_k or (causal and n0 + BLOCK_N - 1 > m0 + offset)
            for i in range(TM):
                r = ty + TY * i
                for j in range(TN):
                    c = tx + TX * j
                    p = exp2(s[i, j] - lse_i[i])
                    if needs_mask and (n0 + c >= seqlen_k or
                                       (causal and n0 + c > m0 + r + offset)):
                        p = ZERO
                    ds_tile[r, c] = p * (dp[i, j] - delta_i[i])
            cuda.syncthreads()  # why: dS tile complete before dS K reads it

            # Accumulate: dQ += dS K (scaled at the end).
            accumulate(dq_acc, ds_tile, k_tile, ty, tx)
            cuda.syncthreads()  # why: reads of dS, K done before the next tiles overwrite them

        # Epilogue: one write of dQ.
        store_tile(dq, dq_acc, b, m0, h, seqlen_q, ty, tx, softmax_scale)

    return flash_bwd_dq


@functools.lru_cache(maxsize=None)
def backward_kernel_functions(config, head_dim, causal, bf16=False):
    """The plain Python kernels (delta, dk_dv, dq) for one (config, head_dim, causal, dtype)."""
    return (delta_kernel_function(head_dim, bf16_bits_to_float32 if bf16 else float32),
            _dk_dv_kernel_function(config, head_dim, causal, bf16),
            _dq_kernel_function(config, head_dim, causal, bf16))


@functools.lru_cache(maxsize=None)
def backward_kernels(config, head_dim, causal, bf16=False):
    functions = backward_kernel_functions(config, head_dim, causal, bf16)
    return tuple(cuda.jit(fn, cache=True) for fn in functions)


def launch_backward(dout, q, k, v, out, lse, delta, dq, dk, dv, causal, softmax_scale,
                    stream=0, bf16=False):
    """Launch the three SIMT backward kernels; delta is float32 (batch, nheads, seqlen_q)
    scratch. With bf16 the arrays of q's shape and k's are uint16 views of bfloat16 data."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = k.shape[1]
    config = simt_backward_config(head_dim)
    delta_kernel, dk_dv_kernel, dq_kernel = backward_kernels(config, head_dim, causal, bf16)
    scale = np.float32(softmax_scale)
    scale_log2 = np.float32(softmax_scale * float(LOG2E))
    delta_grid = (-(-seqlen_q // DELTA_THREADS), nheads, batch)
    launch(delta_kernel, delta_grid, DELTA_THREADS, stream, 0, dout, out, delta)
    dk_dv_grid = (-(-seqlen_k // config.block_n), nheads, batch)
    launch(dk_dv_kernel, dk_dv_grid, config.threads, stream, 0,
           q, k, v, dout, lse, delta, dk, dv, scale_log2, scale)
    dq_grid = (-(-seqlen_q // config.block_m), nheads, batch)
    launch(dq_kernel, dq_grid, config.threads, stream, 0,
           q, k, v, dout, lse, delta, dq, scale_log2, scale)
