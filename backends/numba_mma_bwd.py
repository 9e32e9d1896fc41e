"""FlashAttention backward on tensor cores (mma.sync m16n8k16), deterministic, in Numba.

Used by the "numba" backend for float16/bfloat16 on sm_80+ and by "numba-mma"
(backends/numba_backend.py). Checked against float64 under the simulator and on an H200
(tests/test_mma_backward.py, tests/test_gpu.py, scripts/verify.py).

Same math and the same three launches as the SIMT backward (backends/numba_simt_bwd.py), with
P = exp2(S·scale·log2(e) − lse·log2(e)) recomputed from Q, K and the saved lse, and no atomics:
  1. `delta`: D_i = rowsum(dO_i ∘ O_i), one thread per row.
  2. `dk_dv`: one block per key tile, warp w owning 16 keys. For each query tile that can see
     the keys: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (tensor cores, B fragments by ldmatrix), Pᵀ and
     dSᵀ = Pᵀ ∘ (dPᵀ − D) in registers, then dV += Pᵀ dO and dK += dSᵀ Q with Pᵀ / dSᵀ packed
     straight into A fragments (dO and Q read with ldmatrix.trans).
  3. `dq`: one block per query tile, warp w owning 16 queries: S = Q Kᵀ, dP = dO Vᵀ,
     dS = P ∘ (dP − D), dQ += dS K.
Inputs and outputs are 16-bit patterns (uint16 views of float16 or bfloat16 data).
"""
import functools

import numpy as np
from numba import cuda, float32, uint16

from numba_flash.config import ROW_PAD, mma_backward_config, mma_backward_shared_bytes
from numba_flash.intrinsics import (SHARED_ALIGN, cp_async_commit, cp_async_wait, exp2,
                                    shared_tile)

from .numba_bits16 import bf16_bits_to_float32, f16_bits_to_float32
from .numba_constants import LOG2E, ONE, POS_INF, ZERO, key_end, lse_log2, query_begin
from .numba_simt_bwd import DELTA_THREADS, delta_kernel_function
from .numba_mma_tiles import (WARP, check_rows_contiguous, check_shared_bytes, launch_with_shared,
                              make_cp_async_loader,
                              make_warp_accumulate, make_warp_scores, make_warp_store)


def mma_delta_kernel_function(head_dim, bf16):
    """The delta kernel of the SIMT backward, reading 16-bit patterns."""
    return delta_kernel_function(head_dim,
                                 bf16_bits_to_float32 if bf16 else f16_bits_to_float32)


@functools.lru_cache(maxsize=None)
def mma_dk_dv_kernel_function(block_m, warps, head_dim, causal, bf16):
    BLOCK_N, BLOCK_M, D = 16 * warps, block_m, head_dim
    THREADS = WARP * warps
    NQ = BLOCK_M // 8  # 8-query blocks of Sᵀ
    DB = D // 8
    ROW = D + ROW_PAD  # halves per shared-memory row
    V_START = 2 * BLOCK_N * ROW  # where each tile starts in shared memory (bytes)
    Q_START = 2 * V_START
    DO_START = Q_START + 2 * BLOCK_M * ROW
    STATS_START = DO_START + 2 * BLOCK_M * ROW
    load_tile = make_cp_async_loader(D, THREADS)
    scores = make_warp_scores(bf16, NQ, D // 16)
    accumulate = make_warp_accumulate(bf16, BLOCK_M // 16, DB)
    store = make_warp_store(bf16, DB)

    def flash_bwd_dk_dv_mma(q, k, v, dout, lse, delta, dk, dv, scale_log2, softmax_scale):
        tid = cuda.threadIdx.x
        warp = tid // WARP
        lane = tid % WARP
        g = lane // 4
        t = lane % 4
        n0 = cuda.blockIdx.x * BLOCK_N
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        offset = seqlen_k - seqlen_q  # causal: query i sees key j iff j <= i + offset
        key_lo = n0 + 16 * warp + g  # this lane's two keys (rows of Sᵀ)

        smem = cuda.shared.array(0, uint16, SHARED_ALIGN)  # dynamic: K, V, Q, dO tiles
        k_tile = shared_tile(smem, 0, BLOCK_N, ROW, uint16)
        v_tile = shared_tile(smem, V_START, BLOCK_N, ROW, uint16)
        q_tile = shared_tile(smem, Q_START, BLOCK_M, ROW, uint16)
        do_tile = shared_tile(smem, DO_START, BLOCK_M, ROW, uint16)
        stats = shared_tile(smem, STATS_START, 2, BLOCK_M, float32)
        lse_tile = stats[0]
        delta_tile = stats[1]

        s = cuda.local.array((NQ, 4), float32)  # Sᵀ, then Pᵀ
        dp = cuda.local.array((NQ, 4), float32)  # dPᵀ, then dSᵀ
        dk_acc = cuda.local.array((DB, 4), float32)
        dv_acc = cuda.local.array((DB, 4), float32)
        for db in range(DB):
            for r in range(4):
                dk_acc[db, r] = ZERO
                dv_acc[db, r] = ZERO

        # Load: K and V of this key tile, once.
        load_tile(k_tile, k, b, n0, h, seqlen_k, BLOCK_N)
        load_tile(v_tile, v, b, n0, h, seqlen_k, BLOCK_N)
        cp_async_commit()

        m_begin = query_begin(causal, n0, offset, BLOCK_M)
        for m0 in range(m_begin, seqlen_q, BLOCK_M):
            # Load: Q, dO (cp.async), lse and D for this query tile.
            load_tile(q_tile, q, b, m0, h, seqlen_q, BLOCK_M)
            load_tile(do_tile, dout, b, m0, h, seqlen_q, BLOCK_M)
            cp_async_commit()
            for r in range(tid, BLOCK_M, THREADS):
                in_range = m0 + r < seqlen_q
                lse_tile[r] = lse_log2(lse[b, h, m0 + r]) if in_range else POS_INF
                delta_tile[r] = delta[b, h, m0 + r] if in_range else ZERO
            cp_async_wait(0)
            cuda.syncthreads()  # why: K, V, Q, dO, lse, D tiles complete before any warp reads

            # Scores: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for the warp's 16 keys.
            scores(s, k_tile, 16 * warp, q_tile, 0)
            scores(dp, v_tile, 16 * warp, do_tile, 0)
            needs_mask = causal and n0 + BLOCK_N - 1 > m0 + offset
            for nq in range(NQ):
                for r in range(4):
                    c = 8 * nq + 2 * t + r % 2  # the query within the tile
                    p = exp2(s[nq, r] * scale_log2 - lse_tile[c])
                    if needs_mask and key_lo + 8 * (r // 2) > m0 + c + offset:
                        p = ZERO
                    s[nq, r] = p
                    dp[nq, r] = p * (dp[nq, r] - delta_tile[c])

            # Accumulate: dV += Pᵀ dO, dK += dSᵀ Q (scaled at the end).
            accumulate(dv_acc, s, do_tile, 0)
            accumulate(dk_acc, dp, q_tile, 0)
            cuda.syncthreads()  # why: all warps are done with Q, dO before the next tile lands

        # Epilogue: one write of dK and dV.
        store(dk, dk_acc, b, key_lo, h, seqlen_k, softmax_scale, softmax_scale)
        store(dv, dv_acc, b, key_lo, h, seqlen_k, ONE, ONE)

    return flash_bwd_dk_dv_mma


@functools.lru_cache(maxsize=None)
def mma_dq_kernel_function(block_n, warps, head_dim, causal, bf16):
    BLOCK_M, BLOCK_N, D = 16 * warps, block_n, head_dim
    THREADS = WARP * warps
    NB = BLOCK_N // 8
    DB = D // 8
    ROW = D + ROW_PAD
    DO_START = 2 * BLOCK_M * ROW  # bytes
    K_START = 2 * DO_START
    V_START = K_START + 2 * BLOCK_N * ROW
    load_tile = make_cp_async_loader(D, THREADS)
    scores = make_warp_scores(bf16, NB, D // 16)
    accumulate = make_warp_accumulate(bf16, BLOCK_N // 16, DB)
    store = make_warp_store(bf16, DB)

    def flash_bwd_dq_mma(q, k, v, dout, lse, delta, dq, scale_log2, softmax_scale):
        tid = cuda.threadIdx.x
        warp = tid // WARP
        lane = tid % WARP
        g = lane // 4
        t = lane % 4
        m0 = cuda.blockIdx.x * BLOCK_M
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        offset = seqlen_k - seqlen_q
        row_lo = m0 + 16 * warp + g
        row_hi = row_lo + 8
        lse_lo = lse_log2(lse[b, h, row_lo]) if row_lo < seqlen_q else POS_INF
        lse_hi = lse_log2(lse[b, h, row_hi]) if row_hi < seqlen_q else POS_INF
        delta_lo = delta[b, h, row_lo] if row_lo < seqlen_q else ZERO
        delta_hi = delta[b, h, row_hi] if row_hi < seqlen_q else ZERO

        smem = cuda.shared.array(0, uint16, SHARED_ALIGN)  # dynamic: Q, dO, K, V tiles
        q_tile = shared_tile(smem, 0, BLOCK_M, ROW, uint16)
        do_tile = shared_tile(smem, DO_START, BLOCK_M, ROW, uint16)
        k_tile = shared_tile(smem, K_START, BLOCK_N, ROW, uint16)
        v_tile = shared_tile(smem, V_START, BLOCK_N, ROW, uint16)

        s = cuda.local.array((NB, 4), float32)  # S, then P
        dp = cuda.local.array((NB, 4), float32)  # dP, then dS
        dq_acc = cuda.local.array((DB, 4), float32)
        for db in range(DB):
            for r in range(4):
                dq_acc[db, r] = ZERO

        # Load: Q and dO of this query tile, once.
        load_tile(q_tile, q, b, m0, h, seqlen_q, BLOCK_M)
        load_tile(do_tile, dout, b, m0, h, seqlen_q, BLOCK_M)
        cp_async_commit()

        n_end = key_end(causal, seqlen_k, m0, BLOCK_M, offset)
        for n0 in range(0, n_end, BLOCK_N):
            # Load: K, V tiles.
            load_tile(k_tile, k, b, n0, h, seqlen_k, BLOCK_N)
            load_tile(v_tile, v, b, n0, h, seqlen_k, BLOCK_N)
            cp_async_commit()
            cp_async_wait(0)
            cuda.syncthreads()  # why: Q, dO (first time), K, V tiles complete before reads

            # Scores: S = Q Kᵀ, dP = dO Vᵀ; P = exp2(S - lse), dS = P (dP - D).
            scores(s, q_tile, 16 * warp, k_tile, 0)
            scores(dp, do_tile, 16 * warp, v_tile, 0)
            needs_mask = n0 + BLOCK_N > seqlen_k or (causal and n0 + BLOCK_N - 1 > m0 + offset)
            for nb in range(NB):
                for r in range(4):
                    hi = r >= 2
                    col = n0 + 8 * nb + 2 * t + r % 2
                    p = exp2(s[nb, r] * scale_log2 - (lse_hi if hi else lse_lo))
                    if needs_mask and (col >= seqlen_k or
                                       (causal and col > (row_hi if hi else row_lo) + offset)):
                        p = ZERO
                    s[nb, r] = p
                    dp[nb, r] = p * (dp[nb, r] - (delta_hi if hi else delta_lo))

            # Accumulate: dQ += dS K (scaled at the end).
            accumulate(dq_acc, dp, k_tile, 0)
            cuda.syncthreads()  # why: all warps are done with K before the next tile lands

        # Epilogue: one write of dQ.
        store(dq, dq_acc, b, row_lo, h, seqlen_q, softmax_scale, softmax_scale)

    return flash_bwd_dq_mma


@functools.lru_cache(maxsize=None)
def mma_backward_kernels(block_m, block_n, warps, head_dim, causal, bf16):
    functions = (mma_delta_kernel_function(head_dim, bf16),
                 mma_dk_dv_kernel_function(block_m, warps, head_dim, causal, bf16),
                 mma_dq_kernel_function(block_n, warps, head_dim, causal, bf16))
    return tuple(cuda.jit(fn, cache=True) for fn in functions)


def launch_mma_backward(dout, q, k, v, out, lse, delta, dq, dk, dv, causal, softmax_scale,
                        bf16, stream=0, config=None):
    """All 16-bit arrays are uint16 views (batch, seqlen, nheads, headdim) with contiguous,
    16-byte aligned rows; lse, delta (scratch): float32 (batch, nheads, seqlen_q).
    `config` overrides numba_flash.config.mma_backward_config (tests, tuning)."""
    check_rows_contiguous(dout=dout, q=q, k=k, v=v)
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = k.shape[1]
    config = config or mma_backward_config(head_dim)
    delta_kernel, dk_dv_kernel, dq_kernel = mma_backward_kernels(
        config.block_m, config.block_n, config.warps, head_dim, causal, bf16)
    scale = np.float32(softmax_scale)
    scale_log2 = np.float32(softmax_scale * float(LOG2E))
    rows, threads = 16 * config.warps, WARP * config.warps
    dk_dv_bytes, dq_bytes = mma_backward_shared_bytes(config, head_dim)
    check_shared_bytes(max(dk_dv_bytes, dq_bytes), f"{config} at head_dim {head_dim}")
    delta_kernel[(-(-seqlen_q // DELTA_THREADS), nheads, batch), DELTA_THREADS, stream](
        dout, out, delta)
    launch_with_shared(dk_dv_kernel, (-(-seqlen_k // rows), nheads, batch), threads, stream,
                       dk_dv_bytes, q, k, v, dout, lse, delta, dk, dv, scale_log2, scale)
    launch_with_shared(dq_kernel, (-(-seqlen_q // rows), nheads, batch), threads, stream,
                       dq_bytes, q, k, v, dout, lse, delta, dq, scale_log2, scale)
