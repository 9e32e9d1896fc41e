"""FlashAttention backward on tensor cores (mma.sync m16n8k16), deterministic, in Numba.

Used by the "numba" backend for float16/bfloat16 on sm_80+ and by "numba-mma"
(backends/numba_backend.py). Checked against float64 under the simulator and on an H200
(tests/test_mma_backward.py, tests/test_gpu.py, scripts/verify.py), the ldmatrix addressing
(intrinsics.ldmatrix_x4_at) included.

Same math and the same three launches as the SIMT backward (backends/numba_simt_bwd.py), with
P = exp2(S·scale·log2(e) − lse·log2(e)) recomputed from Q, K and the saved lse, and no atomics:
  1. `delta`: D_i = rowsum(dO_i ∘ O_i), one thread per row.
  2. `dk_dv`: one block per key tile, warp w owning 16 keys. For each query tile that can see
     the keys: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (tensor cores, B fragments by ldmatrix), Pᵀ and
     dSᵀ = Pᵀ ∘ (dPᵀ − D) in registers, then dV += Pᵀ dO and dK += dSᵀ Q with Pᵀ / dSᵀ packed
     straight into A fragments (dO and Q read with ldmatrix.trans).
  3. `dq`: one block per query tile, warp w owning 16 queries: S = Q Kᵀ, dP = dO Vᵀ,
     dS = P ∘ (dP − D), dQ += dS K.
With MmaBackwardConfig.d_split = 2 (head dim 256, whose dK and dV accumulators would not fit
in a warp's registers) each (key or query tile, head) gets two blocks, each accumulating and
writing one half of the head dim's columns; both compute the whole Sᵀ and dPᵀ (or S and dP).
Tiles live in dynamic shared memory. With MmaBackwardConfig.stages = 2 the loops of 2 and 3
keep two buffers of the tile they stream (Q/dO with lse/D, or K/V) and load the next tile with
cp.async while the current one is computed; with 1 stage they load, wait, then compute.
Inputs and outputs are 16-bit patterns (uint16 views of float16 or bfloat16 data).
"""
import functools

import numpy as np
from numba import cuda, float32, uint16

from numba_flash.config import ROW_PAD, mma_backward_config, mma_backward_shared_bytes
from numba_flash.intrinsics import (SHARED_ALIGN, cp_async_commit, cp_async_wait, exp2,
                                    opaque, shared_tile)

from .numba_bits16 import bf16_bits_to_float32, f16_bits_to_float32
from .numba_constants import (LOG2E, ONE, POS_INF, ZERO, key_end, lse_log2, query_begin,
                              query_tile)
from .numba_simt_bwd import DELTA_THREADS, delta_kernel_function
from .numba_launch import launch
from .numba_mma_tiles import (WARP, b_address, check_rows_contiguous, check_shared_bytes,
                              make_cp_async_loader, make_warp_accumulate, make_warp_scores,
                              make_warp_store, x4_address)


def mma_delta_kernel_function(head_dim, bf16):
    """The delta kernel of the SIMT backward, reading 16-bit patterns."""
    return delta_kernel_function(head_dim,
                                 bf16_bits_to_float32 if bf16 else f16_bits_to_float32)


def _check_split(stages, head_dim, d_split):
    if stages not in (1, 2):
        raise ValueError(f"stages must be 1 or 2; got {stages}")
    if d_split < 1 or head_dim % (16 * d_split):
        raise ValueError(f"d_split must be >= 1 and divide head_dim into multiples of 16; got "
                         f"{d_split} for head_dim {head_dim}")


@functools.lru_cache(maxsize=None)
def mma_dk_dv_kernel_function(block_m, warps, head_dim, causal, bf16, stages=1, d_split=1):
    """dK, dV for one tile of 16·warps keys, looping over query tiles of block_m. With stages
    = 2 the Q, dO, lse and D of the next query tile load while this one is computed; with
    d_split > 1 the block computes columns [part·D/d_split, (part + 1)·D/d_split) of dK, dV."""
    _check_split(stages, head_dim, d_split)
    BLOCK_N, BLOCK_M, D, STAGES = 16 * warps, block_m, head_dim, stages
    THREADS = WARP * warps
    NQ = BLOCK_M // 8  # 8-query blocks of Sᵀ
    DB = D // d_split // 8  # 8-column blocks of the dK, dV accumulators
    ROW = D + ROW_PAD  # halves per shared-memory row
    V_START = 2 * BLOCK_N * ROW  # where each tile starts in shared memory (bytes)
    Q_START = 2 * V_START
    QUERY_ROWS = STAGES * BLOCK_M  # the Q (and dO) buffers of all stages
    DO_START = Q_START + 2 * QUERY_ROWS * ROW
    STATS_START = DO_START + 2 * QUERY_ROWS * ROW
    STATS_ROWS = 2 * STAGES  # lse and D of each stage
    load_tile = make_cp_async_loader(D, THREADS)
    scores = make_warp_scores(bf16, NQ, D // 16, ROW)
    accumulate = make_warp_accumulate(bf16, BLOCK_M // 16, DB, ROW)
    store = make_warp_store(bf16, DB)

    @cuda.jit(device=True, inline="always")
    def load_queries(q_tiles, do_tiles, stats, q, dout, lse, delta, b, h, m0, seqlen_q, stage):
        """Q, dO (cp.async) and lse, D (plain stores) of query tile m0 into buffer `stage`."""
        load_tile(q_tiles, BLOCK_M * stage, q, b, m0, h, seqlen_q, BLOCK_M)
        load_tile(do_tiles, BLOCK_M * stage, dout, b, m0, h, seqlen_q, BLOCK_M)
        for r in range(cuda.threadIdx.x, BLOCK_M, THREADS):
            in_range = m0 + r < seqlen_q
            stats[2 * stage, r] = lse_log2(lse[b, h, m0 + r]) if in_range else POS_INF
            stats[2 * stage + 1, r] = delta[b, h, m0 + r] if in_range else ZERO

    def flash_bwd_dk_dv_mma(q, k, v, dout, lse, delta, dk, dv, scale_log2, softmax_scale):
        tid = cuda.threadIdx.x
        warp = tid // WARP
        lane = tid % WARP
        g = lane // 4
        t = lane % 4
        n0 = cuda.blockIdx.x * BLOCK_N
        h = cuda.blockIdx.y // d_split
        col0 = cuda.blockIdx.y % d_split * (8 * DB)  # the block's first dK, dV column
        b = cuda.blockIdx.z
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        offset = seqlen_k - seqlen_q  # causal: query i sees key j iff j <= i + offset
        key_lo = n0 + 16 * warp + g  # this lane's two keys (rows of Sᵀ)

        smem = cuda.shared.array(0, uint16, SHARED_ALIGN)  # dynamic: K, V, Q, dO tiles
        k_tile = shared_tile(smem, 0, BLOCK_N, ROW, uint16)
        v_tile = shared_tile(smem, V_START, BLOCK_N, ROW, uint16)
        q_tiles = shared_tile(smem, Q_START, QUERY_ROWS, ROW, uint16)
        do_tiles = shared_tile(smem, DO_START, QUERY_ROWS, ROW, uint16)
        stats = shared_tile(smem, STATS_START, STATS_ROWS, BLOCK_M, float32)

        s = cuda.local.array((NQ, 4), float32)  # Sᵀ, then Pᵀ
        dp = cuda.local.array((NQ, 4), float32)  # dPᵀ, then dSᵀ
        dk_acc = cuda.local.array((DB, 4), float32)
        dv_acc = cuda.local.array((DB, 4), float32)
        for db in range(DB):
            for r in range(4):
                dk_acc[db, r] = ZERO
                dv_acc[db, r] = ZERO

        # Load: K and V of this key tile, once (and with two stages the first query tile).
        load_tile(k_tile, 0, k, b, n0, h, seqlen_k, BLOCK_N)
        load_tile(v_tile, 0, v, b, n0, h, seqlen_k, BLOCK_N)
        cp_async_commit()
        m_begin = query_begin(causal, n0, offset, BLOCK_M)
        if STAGES == 2:
            if m_begin < seqlen_q:
                load_queries(q_tiles, do_tiles, stats, q, dout, lse, delta, b, h, m_begin,
                             seqlen_q, 0)
            cp_async_commit()

        # The lane's ldmatrix addresses (numba_mma_tiles): K and V (this warp's 16 keys) as A
        # of Sᵀ and dPᵀ; Q and dO (stage 0) as their B, and as B of dK and dV (.trans).
        k_a, v_a = x4_address(k_tile, 16 * warp), x4_address(v_tile, 16 * warp)
        q_b, do_b = b_address(q_tiles, 0), b_address(do_tiles, 0)
        q_t, do_t = x4_address(q_tiles, 0) + 2 * col0, x4_address(do_tiles, 0) + 2 * col0

        stage = 0
        for m0 in range(m_begin, seqlen_q, BLOCK_M):
            # Load: this query tile (one stage), or the next one behind this one (two stages).
            if STAGES == 2:
                if m0 + BLOCK_M < seqlen_q:
                    load_queries(q_tiles, do_tiles, stats, q, dout, lse, delta, b, h,
                                 m0 + BLOCK_M, seqlen_q, 1 - stage)
                cp_async_commit()  # (empty on the last tile: the counting stays uniform)
                cp_async_wait(1)  # everything but the next tile has landed
            else:
                load_queries(q_tiles, do_tiles, stats, q, dout, lse, delta, b, h, m0,
                             seqlen_q, 0)
                cp_async_commit()
                cp_async_wait(0)
            cuda.syncthreads()  # why: K, V, Q, dO, lse, D tiles complete before any warp reads
            stage_bytes = 2 * ROW * BLOCK_M * stage  # where this stage's Q and dO rows start
            # (the addresses go through `opaque` each tile: see intrinsics._LDMATRIX_AT's comment)

            # Scores: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for the warp's 16 keys.
            scores(s, opaque(k_a), opaque(q_b + stage_bytes))
            scores(dp, opaque(v_a), opaque(do_b + stage_bytes))
            needs_mask = causal and n0 + BLOCK_N - 1 > m0 + offset
            for nq in range(NQ):
                for r in range(4):
                    c = 8 * nq + 2 * t + r % 2  # the query within the tile
                    p = exp2(s[nq, r] * scale_log2 - stats[2 * stage, c])
                    if needs_mask and key_lo + 8 * (r // 2) > m0 + c + offset:
                        p = ZERO
                    s[nq, r] = p
                    dp[nq, r] = p * (dp[nq, r] - stats[2 * stage + 1, c])

            # Accumulate: dV += Pᵀ dO, dK += dSᵀ Q (scaled at the end).
            accumulate(dv_acc, s, opaque(do_t + stage_bytes))
            accumulate(dk_acc, dp, opaque(q_t + stage_bytes))
            cuda.syncthreads()  # why: all warps are done with this stage before it is refilled
            stage = (stage + 1) % STAGES

        cp_async_wait(0)  # nothing may be left in flight into shared memory at exit

        # Epilogue: one write of dK and dV.
        store(dk, dk_acc, b, key_lo, h, col0, seqlen_k, softmax_scale, softmax_scale)
        store(dv, dv_acc, b, key_lo, h, col0, seqlen_k, ONE, ONE)

    return flash_bwd_dk_dv_mma


@functools.lru_cache(maxsize=None)
def mma_dq_kernel_function(block_n, warps, head_dim, causal, bf16, stages=1, d_split=1):
    """dQ for one tile of 16·warps queries, looping over key tiles of block_n. With stages = 2
    the K and V of the next key tile load while this one is computed; with d_split > 1 the
    block computes columns [part·D/d_split, (part + 1)·D/d_split) of dQ."""
    _check_split(stages, head_dim, d_split)
    BLOCK_M, BLOCK_N, D, STAGES = 16 * warps, block_n, head_dim, stages
    THREADS = WARP * warps
    NB = BLOCK_N // 8
    DB = D // d_split // 8  # 8-column blocks of the dQ accumulator
    ROW = D + ROW_PAD
    DO_START = 2 * BLOCK_M * ROW  # bytes
    K_START = 2 * DO_START
    KEY_ROWS = STAGES * BLOCK_N  # the K (and V) buffers of all stages
    V_START = K_START + 2 * KEY_ROWS * ROW
    load_tile = make_cp_async_loader(D, THREADS)
    scores = make_warp_scores(bf16, NB, D // 16, ROW)
    accumulate = make_warp_accumulate(bf16, BLOCK_N // 16, DB, ROW)
    store = make_warp_store(bf16, DB)

    @cuda.jit(device=True, inline="always")
    def load_keys(k_tiles, v_tiles, k, v, b, h, n0, seqlen_k, stage):
        load_tile(k_tiles, BLOCK_N * stage, k, b, n0, h, seqlen_k, BLOCK_N)
        load_tile(v_tiles, BLOCK_N * stage, v, b, n0, h, seqlen_k, BLOCK_N)

    def flash_bwd_dq_mma(q, k, v, dout, lse, delta, dq, scale_log2, softmax_scale):
        tid = cuda.threadIdx.x
        warp = tid // WARP
        lane = tid % WARP
        g = lane // 4
        t = lane % 4
        m0 = query_tile(causal) * BLOCK_M
        h = cuda.blockIdx.y // d_split
        col0 = cuda.blockIdx.y % d_split * (8 * DB)  # the block's first dQ column
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
        k_tiles = shared_tile(smem, K_START, KEY_ROWS, ROW, uint16)
        v_tiles = shared_tile(smem, V_START, KEY_ROWS, ROW, uint16)

        s = cuda.local.array((NB, 4), float32)  # S, then P
        dp = cuda.local.array((NB, 4), float32)  # dP, then dS
        dq_acc = cuda.local.array((DB, 4), float32)
        for db in range(DB):
            for r in range(4):
                dq_acc[db, r] = ZERO

        # Load: Q and dO of this query tile, once (and with two stages the first key tile).
        load_tile(q_tile, 0, q, b, m0, h, seqlen_q, BLOCK_M)
        load_tile(do_tile, 0, dout, b, m0, h, seqlen_q, BLOCK_M)
        cp_async_commit()
        n_end = key_end(causal, seqlen_k, m0, BLOCK_M, offset)
        if STAGES == 2:
            if n_end > 0:
                load_keys(k_tiles, v_tiles, k, v, b, h, 0, seqlen_k, 0)
            cp_async_commit()

        # The lane's ldmatrix addresses (numba_mma_tiles): Q and dO (this warp's 16 queries) as
        # A of S and dP; K and V (stage 0) as their B, and K as B of dQ (.trans).
        q_a, do_a = x4_address(q_tile, 16 * warp), x4_address(do_tile, 16 * warp)
        k_b, v_b = b_address(k_tiles, 0), b_address(v_tiles, 0)
        k_t = x4_address(k_tiles, 0) + 2 * col0

        stage = 0
        for n0 in range(0, n_end, BLOCK_N):
            # Load: this key tile (one stage), or the next one behind this one (two stages).
            if STAGES == 2:
                if n0 + BLOCK_N < n_end:
                    load_keys(k_tiles, v_tiles, k, v, b, h, n0 + BLOCK_N, seqlen_k, 1 - stage)
                cp_async_commit()  # (empty on the last tile: the counting stays uniform)
                cp_async_wait(1)  # everything but the next tile has landed
            else:
                load_keys(k_tiles, v_tiles, k, v, b, h, n0, seqlen_k, 0)
                cp_async_commit()
                cp_async_wait(0)
            cuda.syncthreads()  # why: Q, dO (first time), K, V tiles complete before reads
            stage_bytes = 2 * ROW * BLOCK_N * stage  # where this stage's K and V rows start

            # Scores: S = Q Kᵀ, dP = dO Vᵀ; P = exp2(S - lse), dS = P (dP - D).
            scores(s, opaque(q_a), opaque(k_b + stage_bytes))
            scores(dp, opaque(do_a), opaque(v_b + stage_bytes))
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
            accumulate(dq_acc, dp, opaque(k_t + stage_bytes))
            cuda.syncthreads()  # why: all warps are done with this stage before it is refilled
            stage = (stage + 1) % STAGES

        cp_async_wait(0)  # nothing may be left in flight into shared memory at exit

        # Epilogue: one write of dQ.
        store(dq, dq_acc, b, row_lo, h, col0, seqlen_q, softmax_scale, softmax_scale)

    return flash_bwd_dq_mma


@functools.lru_cache(maxsize=None)
def mma_backward_kernels(block_m, block_n, warps, head_dim, causal, bf16, stages=1, d_split=1):
    functions = (mma_delta_kernel_function(head_dim, bf16),
                 mma_dk_dv_kernel_function(block_m, warps, head_dim, causal, bf16, stages,
                                           d_split),
                 mma_dq_kernel_function(block_n, warps, head_dim, causal, bf16, stages,
                                        d_split))
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
    if config is None:
        raise ValueError(f"no tensor-core backward config for head_dim {head_dim} (the backend "
                         f"pads it: numba_backend.mma_head_dim)")
    delta_kernel, dk_dv_kernel, dq_kernel = mma_backward_kernels(
        config.block_m, config.block_n, config.warps, head_dim, causal, bf16, config.stages,
        config.d_split)
    scale = np.float32(softmax_scale)
    scale_log2 = np.float32(softmax_scale * float(LOG2E))
    rows, threads = 16 * config.warps, WARP * config.warps
    dk_dv_bytes, dq_bytes = mma_backward_shared_bytes(config, head_dim)
    check_shared_bytes(max(dk_dv_bytes, dq_bytes), f"{config} at head_dim {head_dim}")
    launch(delta_kernel, (-(-seqlen_q // DELTA_THREADS), nheads, batch), DELTA_THREADS, stream,
           0, dout, out, delta)
    split_heads = nheads * config.d_split  # (head, part of the head dim) per blockIdx.y
    launch(dk_dv_kernel, (-(-seqlen_k // rows), split_heads, batch), threads, stream,
           dk_dv_bytes, q, k, v, dout, lse, delta, dk, dv, scale_log2, scale)
    launch(dq_kernel, (-(-seqlen_q // rows), split_heads, batch), threads, stream, dq_bytes,
           q, k, v, dout, lse, delta, dq, scale_log2, scale)
