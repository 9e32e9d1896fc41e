"""FlashAttention forward on tensor cores (mma.sync m16n8k16), FA2 work partition, in Numba.

Used by the "numba" backend for float16/bfloat16 on sm_80+ and by "numba-mma"
(backends/numba_backend.py). Checked against float64 under the simulator and on an H200
(tests/test_mma_forward.py, tests/test_gpu.py, scripts/verify.py), the ldmatrix addressing
(intrinsics.ldmatrix_x4_at) included.

One block of WARPS warps per (query tile of BLOCK_M = 16·SLICES·WARPS rows, head, batch); warp
w owns the SLICES 16-row slices starting at row 16·SLICES·w of the tile (SLICES = 1 by default;
with more, every K/V fragment a warp reads feeds SLICES mma instructions). K and V tiles of
BLOCK_N keys are shared by the warps.
  - Q tile: cp.async into shared memory once, then ldmatrix into A fragments kept in registers.
  - S = Q Kᵀ per warp: mma with B fragments ldmatrix'ed from the K tile (stored [key][d], which
    is Kᵀ in the column-major layout mma wants for B).
  - Online softmax on the S accumulators in registers, log2 units (scale·log2(e) folded into
    one fused multiply-add before each ex2), the row max/sum of a row combined over its 4 lanes
    with shuffles.
  - P stays in registers: the S accumulator layout of two adjacent 8-key blocks is exactly the
    A-fragment layout of a 16-key chunk, so P is packed to f16/bf16 and fed to the P·V mma.
  - V: B fragments with ldmatrix.trans (V is stored [key][d]).
  - K for the next tile is fetched with cp.async while softmax and P·V run, V for the next tile
    while the next S runs (separate K and V buffers, commit groups in issue order).
  - In the key-tile loop every ldmatrix reads at the lane's 32-bit shared address of its tile
    plus a constant offset (numba_mma_tiles.x4_address, b_address; intrinsics.opaque,
    ldmatrix_x4_at), so that the addresses cost one register per tile instead of one each.
Inputs and outputs are 16-bit patterns (uint16 views of float16 or bfloat16 data), so one
kernel source serves both types; lse is float32.
"""
import functools
import math

import numpy as np
from numba import cuda, float32, uint16, uint32

from numba_flash.config import (ROW_PAD, MmaConfig, mma_forward_config,
                                mma_forward_shared_bytes)

from numba_flash.intrinsics import (SHARED_ALIGN, cp_async_commit, cp_async_wait, exp2,
                                    ldmatrix_x4, ldmatrix_x4_at, ldmatrix_x4_trans_at, mma_bf16,
                                    mma_f16, opaque, pack_bf16x2, pack_f16x2, shared_tile,
                                    shfl_xor)

from .numba_constants import LN2, LOG2E, NEG_INF, ONE, ZERO, key_end, query_tile
from .numba_launch import launch
from .numba_mma_tiles import (WARP, b_address, check_rows_contiguous, check_shared_bytes,
                              make_cp_async_loader, x4_address)


@functools.lru_cache(maxsize=None)
def mma_forward_kernel_function(block_n, warps, head_dim, causal, bf16, slices=1):
    """The plain Python kernel for one (BLOCK_N, warps, head_dim, causal, dtype, slices): each
    warp owns `slices` consecutive 16-row slices of the query tile, so every K/V fragment read
    from shared memory feeds `slices` mma instructions."""
    if head_dim % 16 or block_n % 16:
        raise ValueError("head_dim and block_n must be multiples of 16")
    if slices < 1 or warps < 1:
        raise ValueError(f"slices and warps must be >= 1; got {slices}, {warps}")
    check_shared_bytes(mma_forward_shared_bytes(MmaConfig(block_n, warps, slices), head_dim),
                       f"(block_n={block_n}, warps={warps}, slices={slices}) at head_dim "
                       f"{head_dim}")
    SL = slices
    WARP_ROWS = 16 * SL
    BLOCK_M, BLOCK_N, D = WARP_ROWS * warps, block_n, head_dim
    THREADS = WARP * warps
    NB = BLOCK_N // 8  # 8-key blocks of the S accumulator
    DB = D // 8  # 8-column blocks of the O accumulator
    KD = D // 16  # 16-wide chunks of the head dim (k-steps of S = Q Kᵀ)
    ROW = D + ROW_PAD  # halves per shared-memory row
    K_START = 2 * BLOCK_M * ROW  # where the K and V tiles start in shared memory (bytes)
    V_START = K_START + 2 * BLOCK_N * ROW
    # Q's A fragments stay in registers for small head dims; for larger ones they are re-read
    # from shared memory at every key tile (their D/4 registers would push the kernel to spill).
    Q_IN_REGISTERS = D <= 64
    Q_FRAG_SHAPE = (SL, KD if Q_IN_REGISTERS else 1, 4)
    mma = mma_bf16 if bf16 else mma_f16
    pack = pack_bf16x2 if bf16 else pack_f16x2

    load_tile = make_cp_async_loader(D, THREADS)

    def flash_forward_mma(q, k, v, out, lse, scale_log2):
        tid = cuda.threadIdx.x
        warp = tid // WARP
        lane = tid % WARP
        g = lane // 4  # the lane's row within an 8-row group
        t = lane % 4  # the lane's column pair
        m0 = query_tile(causal) * BLOCK_M
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        offset = seqlen_k - seqlen_q  # causal: query i sees key j iff j <= i + offset
        warp_row0 = WARP_ROWS * warp  # the warp's first row in the tile
        # This lane's rows: m0 + warp_row0 + 16 * sl + g + 8 * half, for slice sl, half 0/1
        # (the lo / hi rows of the mma fragments: accumulator entries r < 2 and r >= 2).

        smem = cuda.shared.array(0, uint16, SHARED_ALIGN)  # dynamic: Q, K, V tiles
        q_tile = shared_tile(smem, 0, BLOCK_M, ROW, uint16)
        k_tile = shared_tile(smem, K_START, BLOCK_N, ROW, uint16)
        v_tile = shared_tile(smem, V_START, BLOCK_N, ROW, uint16)

        q_frag = cuda.local.array(Q_FRAG_SHAPE, uint32)
        s = cuda.local.array((SL, NB, 4), float32)
        acc = cuda.local.array((SL, DB, 4), float32)
        m_i = cuda.local.array((SL, 2), float32)  # running row max (log2 units)
        l_i = cuda.local.array((SL, 2), float32)  # this lane's share of the running row sum
        alpha = cuda.local.array(2, float32)
        ref = cuda.local.array(2, float32)
        for sl in range(SL):
            for db in range(DB):
                for r in range(4):
                    acc[sl, db, r] = ZERO
            for half in range(2):
                m_i[sl, half] = NEG_INF
                l_i[sl, half] = ZERO

        n_end = key_end(causal, seqlen_k, m0, BLOCK_M, offset)

        # Load: Q, then the first K and V tiles, as three commit groups.
        load_tile(q_tile, 0, q, b, m0, h, seqlen_q, BLOCK_M)
        cp_async_commit()
        load_tile(k_tile, 0, k, b, 0, h, seqlen_k, BLOCK_N)
        cp_async_commit()
        load_tile(v_tile, 0, v, b, 0, h, seqlen_k, BLOCK_N)
        cp_async_commit()
        cp_async_wait(2)
        cuda.syncthreads()  # why: the Q tile is complete before ldmatrix reads it
        if Q_IN_REGISTERS:
            for sl in range(SL):
                for kd in range(KD):
                    f = ldmatrix_x4(q_tile, warp_row0 + 16 * sl + lane % 16,
                                    16 * kd + 8 * (lane // 16))
                    for r in range(4):
                        q_frag[sl, kd, r] = f[r]
        # The lane's ldmatrix addresses (the row and column it points at in each 8x8 matrix);
        # in the loop, reads are at these plus constant byte offsets (2 bytes per half).
        q_lane = x4_address(q_tile, warp_row0)
        k_lane = b_address(k_tile, 0)
        v_lane = x4_address(v_tile, 0)

        for n0 in range(0, n_end, BLOCK_N):
            # why: rebuilt each tile, so that each read's offset folds into its instruction
            # instead of every address holding a register across the loop (intrinsics.opaque)
            q_at, k_at, v_at = opaque(q_lane), opaque(k_lane), opaque(v_lane)
            cp_async_wait(1)  # the K tile of n0 has landed (the V tile may still be in flight)
            cuda.syncthreads()  # why: every thread's part of the K tile is visible

            # Scores: S = Q Kᵀ, 16·SL x BLOCK_N per warp, in registers.
            for sl in range(SL):
                for nb in range(NB):
                    for r in range(4):
                        s[sl, nb, r] = ZERO
            for kd in range(KD):
                slot = kd if Q_IN_REGISTERS else 0
                if not Q_IN_REGISTERS:
                    for sl in range(SL):
                        f = ldmatrix_x4_at(q_at, 2 * (16 * sl * ROW + 16 * kd))
                        for r in range(4):
                            q_frag[sl, 0, r] = f[r]
                for nb in range(0, NB, 2):  # one ldmatrix.x4 gives B for two 8-key blocks
                    f = ldmatrix_x4_at(k_at, 2 * (8 * nb * ROW + 16 * kd))
                    for sl in range(SL):  # each K fragment feeds every slice of the warp
                        for half in range(2):
                            d = mma(q_frag[sl, slot, 0], q_frag[sl, slot, 1],
                                    q_frag[sl, slot, 2], q_frag[sl, slot, 3], f[2 * half],
                                    f[2 * half + 1], s[sl, nb + half, 0], s[sl, nb + half, 1],
                                    s[sl, nb + half, 2], s[sl, nb + half, 3])
                            for r in range(4):
                                s[sl, nb + half, r] = d[r]
            cuda.syncthreads()  # why: all warps are done reading the K tile before it is reused

            # Load: the next K tile, behind the softmax and P·V of this one.
            if n0 + BLOCK_N < n_end:
                load_tile(k_tile, 0, k, b, n0 + BLOCK_N, h, seqlen_k, BLOCK_N)
            cp_async_commit()  # (an empty group on the last tile keeps the counting uniform)

            needs_mask = n0 + BLOCK_N > seqlen_k or (causal and n0 + BLOCK_N - 1 > m0 + offset)
            for sl in range(SL):
                row_lo = m0 + warp_row0 + 16 * sl + g
                # Mask: -inf past seqlen_k and in each row's future (diagonal and tail tiles).
                if needs_mask:
                    for nb in range(NB):
                        for r in range(4):
                            col = n0 + 8 * nb + 2 * t + r % 2
                            row = row_lo + 8 if r >= 2 else row_lo
                            if col >= seqlen_k or (causal and col > row + offset):
                                s[sl, nb, r] = NEG_INF

                # Rescale: row max over the lane's columns, then over the row's 4 lanes, taken
                # on the unscaled scores (the scale is positive) and kept in log2 units.
                for half in range(2):
                    tile_max = NEG_INF
                    for nb in range(NB):
                        tile_max = max(tile_max, max(s[sl, nb, 2 * half], s[sl, nb, 2 * half + 1]))
                    for mask in (1, 2):
                        tile_max = max(tile_max, shfl_xor(tile_max, mask))
                    new_max = max(m_i[sl, half], tile_max * scale_log2)
                    ref[half] = new_max if new_max != NEG_INF else ZERO  # no key seen yet
                    alpha[half] = exp2(m_i[sl, half] - ref[half])
                    m_i[sl, half] = new_max
                for db in range(DB):
                    for r in range(4):
                        acc[sl, db, r] *= alpha[r // 2]
                # P = exp2(S·scale·log2(e) - m): one fused multiply-add and one ex2 per score.
                for half in range(2):
                    row_sum = ZERO
                    for nb in range(NB):
                        for c in range(2):
                            s[sl, nb, 2 * half + c] = exp2(s[sl, nb, 2 * half + c] * scale_log2
                                                           - ref[half])
                        row_sum += s[sl, nb, 2 * half] + s[sl, nb, 2 * half + 1]
                    l_i[sl, half] = l_i[sl, half] * alpha[half] + row_sum

            cp_async_wait(1)  # the V tile of n0 has landed (the next K tile may be in flight)
            cuda.syncthreads()  # why: every thread's part of the V tile is visible

            # Accumulate: O += P V, with P packed from the S registers into A fragments.
            for kc in range(NB // 2):
                for db in range(0, DB, 2):  # one ldmatrix.x4.trans gives B for two d-blocks
                    f = ldmatrix_x4_trans_at(v_at, 2 * (16 * kc * ROW + 8 * db))
                    for sl in range(SL):  # each V fragment feeds every slice of the warp
                        a0 = pack(s[sl, 2 * kc, 0], s[sl, 2 * kc, 1])
                        a1 = pack(s[sl, 2 * kc, 2], s[sl, 2 * kc, 3])
                        a2 = pack(s[sl, 2 * kc + 1, 0], s[sl, 2 * kc + 1, 1])
                        a3 = pack(s[sl, 2 * kc + 1, 2], s[sl, 2 * kc + 1, 3])
                        for half in range(2):
                            d = mma(a0, a1, a2, a3, f[2 * half], f[2 * half + 1],
                                    acc[sl, db + half, 0], acc[sl, db + half, 1],
                                    acc[sl, db + half, 2], acc[sl, db + half, 3])
                            for r in range(4):
                                acc[sl, db + half, r] = d[r]
            cuda.syncthreads()  # why: all warps are done reading the V tile before it is reused

            # Load: the next V tile, behind the next S = Q Kᵀ.
            if n0 + BLOCK_N < n_end:
                load_tile(v_tile, 0, v, b, n0 + BLOCK_N, h, seqlen_k, BLOCK_N)
            cp_async_commit()
        cp_async_wait(0)  # nothing may be left in flight into shared memory at exit

        # Epilogue: row sums over the 4 lanes; out = acc / l; lse = m + log(l).
        for sl in range(SL):
            for half in range(2):
                l_row = l_i[sl, half]
                for mask in (1, 2):
                    l_row += shfl_xor(l_row, mask)
                row = m0 + warp_row0 + 16 * sl + g + 8 * half
                if row < seqlen_q:
                    no_key = l_row == ZERO  # (a NaN input leaves l NaN, and NaN propagates)
                    inv_l = ZERO if no_key else ONE / l_row
                    for db in range(DB):
                        word = pack(acc[sl, db, 2 * half] * inv_l,
                                    acc[sl, db, 2 * half + 1] * inv_l)
                        out[b, row, h, 8 * db + 2 * t] = uint16(word & 0xFFFF)
                        out[b, row, h, 8 * db + 2 * t + 1] = uint16(word >> 16)
                    if t == 0:
                        lse[b, h, row] = (NEG_INF if no_key else
                                          (m_i[sl, half] + math.log2(l_row)) * LN2)

    return flash_forward_mma


@functools.lru_cache(maxsize=None)
def mma_forward_kernel(block_n, warps, head_dim, causal, bf16, slices=1):
    function = mma_forward_kernel_function(block_n, warps, head_dim, causal, bf16, slices)
    return cuda.jit(function, cache=True)


def launch_mma_forward(q, k, v, out, lse, causal, softmax_scale, bf16, stream=0, config=None):
    """q, k, v, out: uint16 views (batch, seqlen, nheads, headdim) of f16/bf16 data, last dim
    contiguous and rows 16-byte aligned; lse: float32 (batch, nheads, seqlen_q).
    `config` overrides numba_flash.config.mma_forward_config (tests, tuning)."""
    check_rows_contiguous(q=q, k=k, v=v)
    batch, seqlen_q, nheads, head_dim = q.shape
    config = config or mma_forward_config(head_dim)
    if config is None:
        raise ValueError(f"no tensor-core forward config for head_dim {head_dim} (the backend "
                         f"pads it: numba_backend.mma_head_dim)")
    kernel = mma_forward_kernel(config.block_n, config.warps, head_dim, causal, bf16,
                                config.slices)
    grid = (-(-seqlen_q // config.block_m), nheads, batch)
    launch(kernel, grid, WARP * config.warps, stream, mma_forward_shared_bytes(config, head_dim),
           q, k, v, out, lse, np.float32(softmax_scale * float(LOG2E)))
