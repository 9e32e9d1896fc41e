"""FlashAttention forward on tensor cores (mma.sync m16n8k16), FA2 work partition, in Numba.

Run by the tensor-core engine (engine.py) for float16/bfloat16 on sm_80+.

One block of WARPS warps per (query tile of BLOCK_M = 16·SLICES·WARPS rows, head, batch); warp
w owns the SLICES 16-row slices starting at row 16·SLICES·w of the tile (SLICES = 1 by default;
with more, every K/V fragment a warp reads feeds SLICES mma instructions). K and V tiles of
BLOCK_N keys are shared by the warps.
  - Q tile: cp.async into shared memory once, then ldmatrix into A fragments kept in registers.
  - S = Q Kᵀ per warp (fragments.make_warp_scores): mma with B fragments ldmatrix'ed from
    the K tile (stored [key][d], which is Kᵀ in the column-major layout mma wants for B).
  - GQA: the block of query head h reads key/value head h // group. A score mod
    (device/score_mod.py: softcap, ALiBi) replaces each score in registers before the mask.
    varlen: grid.z runs over the packed sequences (device/sequence.py).
  - Online softmax on the S accumulators in registers (device/fragments.py,
    device/softmax.py), log2 units, the row max/sum of a row combined over its 4 lanes with
    shuffles; the mask (device/mask.py) only on partial tiles (device/block_range.py). A
    mask_mod's tile table (device/mask_mod.py) narrows the key range and marks tiles no row
    sees, whose products and softmax are skipped (not their loads: a tile's copy is issued a
    tile ahead).
  - P stays in registers: the S accumulator layout of two adjacent 8-key blocks is exactly the
    A-fragment layout of a 16-key chunk, so P is packed to f16/bf16 and fed to the P·V mma
    (fragments.make_warp_accumulate).
  - V: B fragments with ldmatrix.trans (V is stored [key][d]).
  - K for the next tile is fetched with cp.async while softmax and P·V run, V for the next tile
    while the next S runs (separate K and V buffers, commit groups in issue order).
  - In the key-tile loop every ldmatrix reads at the lane's 32-bit shared address of its tile
    plus a constant offset (fragments.x4_address, b_address; intrinsics.opaque,
    ldmatrix_x4_at), so that the addresses cost one register per tile instead of one each.
Inputs and outputs are 16-bit patterns (uint16 views of float16 or bfloat16 data), so one
kernel source serves both types; lse is float32.
"""
import functools

import numpy as np
from numba import cuda, float32, uint16, uint32

from ..device.block_range import EMPTY, make_block_range
from ..device.constants import LOG2E, NEG_INF, ZERO
from ..device.fragments import make_fragment_store, make_tile_softmax
from ..device.intrinsics import (SHARED_ALIGN, cp_async_commit, cp_async_wait, ldmatrix_x4,
                                 opaque, shared_tile, shfl_xor)
from ..device.mask import tile_mask
from ..device.mask_mod import make_tile_table
from ..device.score_mod import make_score_mod
from ..device.sequence import grid_extent, make_sequence
from ..device.softmax import finalize
from ..device.tile_copy import make_cp_async_loader
from ..launch import kernel_extras_unused, launch
from ..tile_classes import tile_arguments
from .config import ROW_PAD, mma_forward_config, mma_forward_shared_bytes
from .fragments import (WARP, b_address, check_rows_contiguous, check_shared_bytes,
                        make_q_scores, make_warp_accumulate, x4_address)


@functools.lru_cache(maxsize=None)
def mma_forward_kernel_function(config, spec):
    """The plain Python kernel for one MmaConfig and kernel spec (AttentionSpec.for_kernels(),
    head_dim the padded head dim, a multiple of 16)."""
    if spec.head_dim % 16 or config.block_n % 16:
        raise ValueError("head_dim and block_n must be multiples of 16")
    if config.slices < 1 or config.warps < 1:
        raise ValueError(f"slices and warps must be >= 1; got {config}")
    check_shared_bytes(mma_forward_shared_bytes(config, spec.head_dim),
                       f"{config} at head_dim {spec.head_dim}")
    SL = config.slices
    WARP_ROWS = 16 * SL
    BLOCK_M, BLOCK_N, D = config.block_m, config.block_n, spec.head_dim
    THREADS = WARP * config.warps
    NB = BLOCK_N // 8  # 8-key blocks of the S accumulator
    DB = D // 8  # 8-column blocks of the O accumulator
    KD = D // 16  # 16-wide chunks of the head dim (k-steps of S = Q Kᵀ)
    ROW = D + ROW_PAD  # halves per shared-memory row
    K_START = 2 * BLOCK_M * ROW  # where the K and V tiles start in shared memory (bytes)
    V_START = K_START + 2 * BLOCK_N * ROW
    # Q's A fragments stay in registers for small head dims; for larger ones they are re-read
    # from shared memory at every key tile (their D/4 registers would push the kernel to spill).
    Q_IN_REGISTERS = D <= 64
    Q_FRAG_SHAPE = (SL, KD, 4) if Q_IN_REGISTERS else (1, 1, 4)
    ACC_SHAPE, S_SHAPE = (SL, DB, 4), (SL, NB, 4)

    load_tile = make_cp_async_loader(D, THREADS)
    q_scores = make_q_scores(spec.bf16, SL, NB, KD, ROW, Q_IN_REGISTERS)
    accumulate_pv = make_warp_accumulate(spec.bf16, SL, NB // 2, DB, ROW)
    store = make_fragment_store(spec.bf16, DB)

    softmax_step = make_tile_softmax(spec, NB, DB)
    key_range, _, _, is_partial, query_tile_index = make_block_range(spec, BLOCK_M, BLOCK_N)
    narrow, mod_class = make_tile_table(spec, BLOCK_M, BLOCK_N)
    score_mod = make_score_mod(spec)
    exponent_scales, head_slope = score_mod.scales, score_mod.head_slope
    sequence = make_sequence(spec)
    GROUP, VARLEN = spec.group, spec.varlen

    def flash_forward_mma(q, k, v, out, lse, scale_log2, alibi_slopes, cu_seqlens_q,
                          cu_seqlens_k, attn_mask, tile_classes, tile_spans, mod_arrays):
        lane = cuda.threadIdx.x % WARP
        g = lane // 4  # the lane's row within an 8-row group
        t = lane % 4  # the lane's column pair
        m0 = query_tile_index() * BLOCK_M
        h = cuda.blockIdx.y
        h_kv = h // GROUP  # the key/value head of this query head (GQA)
        seq = cuda.blockIdx.z
        b, q_start, seqlen_q, k_start, seqlen_k = sequence(seq, q, k, cu_seqlens_q, cu_seqlens_k)
        if VARLEN and m0 >= seqlen_q:
            return  # (the grid is sized for the longest sequence)
        q_end, k_end = q_start + seqlen_q, k_start + seqlen_k  # the arrays' row bounds
        offset = seqlen_k - seqlen_q
        tile_scale, pre = exponent_scales(scale_log2)  # (device/score_mod.py)
        slope = head_slope(alibi_slopes, seq, h)
        mask_at = (attn_mask, seq, h, mod_arrays)  # (device/attn_mask.py)
        tiles = (tile_classes, tile_spans)  # (device/mask_mod.py)
        warp_row0 = WARP_ROWS * (cuda.threadIdx.x // WARP)  # the warp's first row in the tile
        # This lane's rows: m0 + warp_row0 + 16 * sl + g + 8 * half, for slice sl, half 0/1
        # (the lo / hi rows of the mma fragments: accumulator entries r < 2 and r >= 2).

        smem = cuda.shared.array(0, uint16, SHARED_ALIGN)  # dynamic: Q, K, V tiles
        q_tile = shared_tile(smem, 0, BLOCK_M, ROW, uint16)
        k_tile = shared_tile(smem, K_START, BLOCK_N, ROW, uint16)
        v_tile = shared_tile(smem, V_START, BLOCK_N, ROW, uint16)

        q_frag = cuda.local.array(Q_FRAG_SHAPE, uint32)
        s = cuda.local.array(S_SHAPE, float32)
        acc = cuda.local.array(ACC_SHAPE, float32)
        m_i = cuda.local.array((SL, 2), float32)  # running row max (log2 units)
        l_i = cuda.local.array((SL, 2), float32)  # this lane's share of the running row sum
        inv_l = cuda.local.array(2, float32)
        for sl in range(SL):
            for db in range(DB):
                for r in range(4):
                    acc[sl, db, r] = ZERO
            for half in range(2):
                m_i[sl, half] = NEG_INF
                l_i[sl, half] = ZERO

        n_begin, n_end = key_range(m0, seqlen_q, seqlen_k)
        n_begin, n_end = narrow(tiles, seq, h, m0 // BLOCK_M, n_begin, n_end, BLOCK_N)

        # Load: Q, then the first K and V tiles, as three commit groups.
        load_tile(q_tile, 0, q, b, q_start + m0, h, q_end, BLOCK_M)
        cp_async_commit()
        load_tile(k_tile, 0, k, b, k_start + n_begin, h_kv, k_end, BLOCK_N)
        cp_async_commit()
        load_tile(v_tile, 0, v, b, k_start + n_begin, h_kv, k_end, BLOCK_N)
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

        for n0 in range(n_begin, n_end, BLOCK_N):
            # why: rebuilt each tile, so that each read's offset folds into its instruction
            # instead of every address holding a register across the loop (intrinsics.opaque)
            k_at, v_at = opaque(k_lane), opaque(v_lane)
            cp_async_wait(1)  # the K tile of n0 has landed (the V tile may still be in flight)
            cuda.syncthreads()  # why: every thread's part of the K tile is visible

            kind = mod_class(tiles, seq, h, m0, n0)
            seen = kind != EMPTY  # (False: no row sees a key of this tile; mask_mod only)
            # Scores: S = Q Kᵀ, 16·SL x BLOCK_N per warp, in registers.
            if seen:
                q_scores(s, q_frag, q_lane, k_at)
            cuda.syncthreads()  # why: all warps are done reading the K tile before it is reused

            # Load: the next K tile, behind the softmax and P·V of this one.
            if n0 + BLOCK_N < n_end:
                load_tile(k_tile, 0, k, b, k_start + n0 + BLOCK_N, h_kv, k_end, BLOCK_N)
            cp_async_commit()  # (an empty group on the last tile keeps the counting uniform)

            mask = tile_mask(is_partial(m0, n0, seqlen_q, seqlen_k), kind)
            if seen:  # score mod, mask, online softmax: P in place of S, O rescaled
                for sl in range(SL):
                    softmax_step(s, acc, sl, m_i, l_i, m0 + warp_row0 + 16 * sl + g, n0,
                                 mask, tile_scale, pre, slope, offset, seqlen_k, mask_at)

            cp_async_wait(1)  # the V tile of n0 has landed (the next K tile may be in flight)
            cuda.syncthreads()  # why: every thread's part of the V tile is visible

            # Accumulate: O += P V, with P packed from the S registers into A fragments.
            if seen:
                accumulate_pv(acc, s, v_at)
            cuda.syncthreads()  # why: all warps are done reading the V tile before it is reused

            # Load: the next V tile, behind the next S = Q Kᵀ.
            if n0 + BLOCK_N < n_end:
                load_tile(v_tile, 0, v, b, k_start + n0 + BLOCK_N, h_kv, k_end, BLOCK_N)
            cp_async_commit()
        cp_async_wait(0)  # nothing may be left in flight into shared memory at exit

        # Epilogue: row sums over the 4 lanes; out = acc / l; lse = m + log(l).
        for sl in range(SL):
            row_lo = m0 + warp_row0 + 16 * sl + g
            for half in range(2):
                l_row = l_i[sl, half]
                for mask in (1, 2):
                    l_row += shfl_xor(l_row, mask)
                inv_l[half], lse_row = finalize(l_row, m_i[sl, half])
                if t == 0 and row_lo + 8 * half < seqlen_q:
                    lse[b, h, q_start + row_lo + 8 * half] = lse_row
            store(out, acc, sl, b, q_start + row_lo, h, 0, q_end, inv_l[0], inv_l[1])

    return flash_forward_mma


@functools.lru_cache(maxsize=None)
def mma_forward_kernel(config, spec):
    return cuda.jit(mma_forward_kernel_function(config, spec), cache=spec.mask_mod is None)


def launch_mma_forward(spec, q, k, v, out, lse, stream=0, config=None, extras=None, tiles=None):
    """q, k, v, out: uint16 views (batch, seqlen, nheads, headdim) of f16/bf16 data, last dim
    contiguous and rows 16-byte aligned, headdim the padded head dim the spec's kernels run at;
    lse: float32 (batch, nheads, seqlen_q). `extras`: the kernels' (alibi_slopes,
    cu_seqlens_q, cu_seqlens_k, attn_mask) (marshal.kernel_extras), for a spec that has them;
    `tiles`: a mask_mod's tile tables (tile_classes.py). `config` overrides
    mma_forward_config (tests, tuning)."""
    check_rows_contiguous(q=q, k=k, v=v)
    _, _, nheads, head_dim = q.shape
    extras = extras or kernel_extras_unused(lse)
    seqlen_q, batch = grid_extent(spec, q, extras[1], 0)
    config = config or mma_forward_config(head_dim, spec)
    if config is None:
        raise ValueError(f"no tensor-core forward config for head_dim {head_dim} (the engine "
                         f"pads it: config.mma_head_dim)")
    kernel = mma_forward_kernel(config, spec.for_kernels(head_dim=head_dim))
    grid = (-(-seqlen_q // config.block_m), nheads, batch)
    tile_args = tile_arguments(tiles, lse, config.block_m, config.block_n)
    launch(kernel, grid, WARP * config.warps, stream, mma_forward_shared_bytes(config, head_dim),
           q, k, v, out, lse, np.float32(spec.softmax_scale * float(LOG2E)), *extras,
           *tile_args)
