"""FlashAttention forward pass, SIMT (CUDA cores, float32 arithmetic), as a Numba kernel.

One block of `warps` warps per (query tile of BLOCK_M rows, head, batch). Each warp owns
4·TM rows of the tile; its lanes form 4 row groups x 8 column groups, so thread (ty, tx) holds
a TM x TN register tile of the scores S (rows ty + 4·i, keys tx + 8·j) and a TM x D/8 tile of
the output accumulator `acc` (columns in 4-wide chunks (8·c + tx)·4 + e). A row's 8 lanes are
in one warp: the row max and row sum are combined with shuffles, not through shared memory.

The Q tile, one K tile, one V tile and the P tile live in dynamic shared memory (so that the
tiles can be larger than 48 KiB allows). Per key tile of BLOCK_N keys the block meets twice:
  - barrier 1: K_j is complete; everyone has finished P·V of the previous tile, so V_j's
    load starts now and runs while the scores S = Q K_jᵀ and the softmax are computed;
  - barrier 2: V_j and P are complete; everyone has finished reading K_j, so K_{j+1}'s load
    starts now and runs while acc += P V_j is computed.
With async_copy (the backend's choice for float32 with head dims that are a multiple of 4 on
sm_80 and newer, after copying views whose rows are not 16-byte aligned) the loads are cp.async
copies; otherwise each thread loads, converts (float16, bfloat16) and stores elements, which
then complete before the barrier that follows.

Online softmax (device/softmax.py): per query row the running max `m_i` and running sum `l_i`;
when the max grows, `acc` and `l_i` are rescaled by exp(m_old - m_new). Scores are scaled by
softmax_scale·log2(e) so that every exponential is one exp2. The output tile and the row
log-sum-exp are written once, at the end. Key tiles wholly masked are never visited, and only
partial tiles (device/block_range.py) apply the mask (device/mask.py). A score mod
(device/score_mod.py: softcap, ALiBi) replaces each score before the mask. With GQA the block
reads the K and V of its query head's key/value head, h // group; with varlen, grid.z runs over
the packed sequences (device/sequence.py).
"""
import functools

import numpy as np
from numba import cuda, float32

from ..device.block_range import make_block_range
from ..device.constants import LOG2E, NEG_INF, ZERO
from ..device.intrinsics import SHARED_ALIGN, shared_tile, shfl_xor
from ..device.mask import MASK_ALL, make_mask, tile_mask
from ..device.mask_mod import make_tile_table
from ..device.score_mod import make_score_mod
from ..device.sequence import grid_extent, make_sequence
from ..device.softmax import finalize, online_update, probability
from ..device.tile_copy import copy_fences
from ..gpu import SHARED_MEMORY_BYTES
from ..launch import kernel_extras_unused, launch
from ..tile_classes import tile_arguments
from .config import simt_forward_config, simt_forward_shared_bytes
from .tiles import (LANE_COLS, LANE_ROWS, make_chunked_accumulate,
                    make_chunked_store, make_tile_dot, make_tile_loader, tile_columns)


@functools.lru_cache(maxsize=None)
def forward_kernel_function(config, spec, async_copy=False):
    """The plain Python kernel for one tile config, kernel spec (AttentionSpec.for_kernels())
    and load kind. For bfloat16, q, k, v and out hold bfloat16 bit patterns. With async_copy,
    q, k and v must be float32 with rows of head_dim (a multiple of 4) contiguous, 16-byte
    aligned floats."""
    head_dim, bf16 = spec.head_dim, spec.bf16
    TM, TN = config.rows_per_thread, config.keys_per_thread
    BLOCK_M, BLOCK_N, THREADS = config.block_m, config.block_n, config.threads
    D4, CHUNKS, ROW = tile_columns(config.padded_head_dim(head_dim), head_dim)
    P_ROW = BLOCK_N + 8  # floats per P row: the 4 row groups' stores hit 32 distinct banks
    #                      (for an even keys_per_thread, as every config has)
    K_START = 4 * BLOCK_M * ROW  # byte offsets of the tiles in dynamic shared memory
    V_START = K_START + 4 * BLOCK_N * ROW
    P_START = V_START + 4 * BLOCK_N * ROW
    load_q_tile = make_tile_loader(BLOCK_M, head_dim, D4, THREADS, bf16, async_copy)
    load_kv_tile = make_tile_loader(BLOCK_N, head_dim, D4, THREADS, bf16, async_copy)
    commit_loads, wait_loads = copy_fences(async_copy)
    tile_scores = make_tile_dot(TM, TN, LANE_ROWS, LANE_COLS, D4)
    accumulate_pv = make_chunked_accumulate(TM, CHUNKS, LANE_ROWS, LANE_COLS, BLOCK_N)
    store = make_chunked_store(TM, CHUNKS, LANE_ROWS, LANE_COLS, head_dim, bf16,
                               per_row_scale=True)
    visible = make_mask(spec)
    key_range, _, _, is_partial, query_tile_index = make_block_range(spec, BLOCK_M, BLOCK_N)
    narrow, mod_class = make_tile_table(spec, BLOCK_M, BLOCK_N)
    score_mod = make_score_mod(spec)
    SCORE_MOD, modified_score, exponent_scales = (score_mod.active, score_mod.score,
                                                  score_mod.scales)
    head_slope = score_mod.head_slope
    sequence = make_sequence(spec)
    GROUP, VARLEN = spec.group, spec.varlen
    S_SHAPE = (TM, TN)
    ACC_SHAPE = (TM, 4 * CHUNKS)

    def flash_forward(q, k, v, out, lse, scale_log2, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                      attn_mask, tile_classes, tile_spans, mod_arrays):
        lane = cuda.threadIdx.x % 32
        tx = lane % LANE_COLS
        ty = cuda.threadIdx.x // 32 * LANE_ROWS * TM + lane // LANE_COLS  # rows ty + 4·i
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
        tiles = (tile_classes, tile_spans)  # (device/mask_mod.py: a mask_mod's tile table)

        smem = cuda.shared.array(0, float32, SHARED_ALIGN)  # dynamic: Q, K, V, P tiles
        q_tile = shared_tile(smem, 0, BLOCK_M, ROW, float32)
        k_tile = shared_tile(smem, K_START, BLOCK_N, ROW, float32)
        v_tile = shared_tile(smem, V_START, BLOCK_N, ROW, float32)
        p_tile = shared_tile(smem, P_START, BLOCK_M, P_ROW, float32)

        s = cuda.local.array(S_SHAPE, float32)
        acc = cuda.local.array(ACC_SHAPE, float32)
        m_i = cuda.local.array(TM, float32)  # running row max (log2 units)
        l_i = cuda.local.array(TM, float32)  # this thread's share of the running row sum
        inv_l = cuda.local.array(TM, float32)
        for i in range(TM):
            m_i[i] = NEG_INF
            l_i[i] = ZERO
            for c in range(4 * CHUNKS):
                acc[i, c] = ZERO

        # Load: the Q tile and the first K tile.
        n_begin, n_end = key_range(m0, seqlen_q, seqlen_k)
        n_begin, n_end = narrow(tiles, seq, h, m0 // BLOCK_M, n_begin, n_end, BLOCK_N)
        load_q_tile(q_tile, 0, q, b, q_start + m0, h, q_end)
        if n_begin < n_end:
            load_kv_tile(k_tile, 0, k, b, k_start + n_begin, h_kv, k_end)
        commit_loads()

        for n0 in range(n_begin, n_end, BLOCK_N):
            wait_loads()
            cuda.syncthreads()  # why: K tile (and Q) complete; P·V of the last tile is done
            # Load: this tile's V, in flight while the scores and the softmax run.
            load_kv_tile(v_tile, 0, v, b, k_start + n0, h_kv, k_end)
            commit_loads()

            # Scores: S = Q Kᵀ for this thread's register tile (through the score mod); -inf
            # where the row does not see the key (partial tiles only).
            tile_scores(s, q_tile, k_tile, ty, tx)
            if SCORE_MOD:
                for i in range(TM):
                    for j in range(TN):
                        s[i, j] = modified_score(s[i, j], pre, slope, m0 + ty + LANE_ROWS * i,
                                                 n0 + tx + LANE_COLS * j, offset, seqlen_k,
                                                 mask_at)
            mask = tile_mask(is_partial(m0, n0, seqlen_q, seqlen_k),
                             mod_class(tiles, seq, h, m0, n0))
            if mask:
                for i in range(TM):
                    for j in range(TN):
                        if not visible(m0 + ty + LANE_ROWS * i, n0 + tx + LANE_COLS * j,
                                       seqlen_k, offset, mask_at, mask == MASK_ALL):
                            s[i, j] = NEG_INF

            # Rescale: m_new = max(m_old, row max over the row's 8 lanes · scale), alpha =
            # exp2(m_old - m_new); P = exp2(S · scale - m_new) into the P tile.
            for i in range(TM):
                row_max = s[i, 0]
                for j in range(1, TN):
                    row_max = max(row_max, s[i, j])
                row_max = max(row_max, shfl_xor(row_max, 1))
                row_max = max(row_max, shfl_xor(row_max, 2))
                row_max = max(row_max, shfl_xor(row_max, 4))
                m_i[i], m_ref, alpha = online_update(m_i[i], row_max * tile_scale)
                l_new = ZERO
                for j in range(TN):
                    p = probability(s[i, j], tile_scale, m_ref)
                    p_tile[ty + LANE_ROWS * i, tx + LANE_COLS * j] = p
                    l_new += p
                l_i[i] = l_i[i] * alpha + l_new
                for c in range(4 * CHUNKS):
                    acc[i, c] *= alpha

            wait_loads()
            cuda.syncthreads()  # why: V tile complete, P tile written; K tile reads are done
            # Load: the next K tile, in flight while P·V runs.
            if n0 + BLOCK_N < n_end:
                load_kv_tile(k_tile, 0, k, b, k_start + n0 + BLOCK_N, h_kv, k_end)
            commit_loads()

            # Accumulate: acc += P V.
            accumulate_pv(acc, p_tile, v_tile, ty, tx, 0)
        wait_loads()  # (with no key tile, the Q copies are still in flight)

        # Epilogue: l = the row's 8 lanes' shares; out = acc / l; lse = m + log(l).
        for i in range(TM):
            l_row = l_i[i]
            l_row += shfl_xor(l_row, 1)
            l_row += shfl_xor(l_row, 2)
            l_row += shfl_xor(l_row, 4)
            inv_l[i], lse_row = finalize(l_row, m_i[i])
            row = m0 + ty + LANE_ROWS * i
            if tx == 0 and row < seqlen_q:
                lse[b, h, q_start + row] = lse_row
        store(out, acc, b, q_start + m0, h, q_end, ty, tx, inv_l)

    return flash_forward


@functools.lru_cache(maxsize=None)
def forward_kernel(config, spec, async_copy=False):
    """The compiled (lazily specialised on argument types) forward kernel (cached on disk
    but with a mask_mod, whose kernels may hold a captured array's address)."""
    return cuda.jit(forward_kernel_function(config, spec, async_copy),
                    cache=spec.mask_mod is None)


def launch_forward(spec, q, k, v, out, lse, stream=0, config=None, async_copy=False,
                   shared_limit=SHARED_MEMORY_BYTES, extras=None, tiles=None):
    """Launch the SIMT forward on device (or, under the simulator, host) arrays; for bfloat16,
    q, k, v, out are uint16 views of bfloat16 data; with async_copy, q, k, v are read by
    cp.async (see forward_kernel_function). `extras`: the kernels' (alibi_slopes,
    cu_seqlens_q, cu_seqlens_k, attn_mask) (marshal.kernel_extras), for a spec that has them;
    `tiles`: a mask_mod's tile tables (tile_classes.py). The config
    is the first for the head dim that fits `shared_limit` bytes of shared memory, unless
    `config` names one (for tuning)."""
    _, _, nheads, head_dim = q.shape
    extras = extras or kernel_extras_unused(lse)
    seqlen_q, batch = grid_extent(spec, q, extras[1], 0)
    config = config or simt_forward_config(head_dim, shared_limit)
    grid = (-(-seqlen_q // config.block_m), nheads, batch)
    kernel = forward_kernel(config, spec.for_kernels(), async_copy)
    scale_log2 = np.float32(spec.softmax_scale * float(LOG2E))
    launch(kernel, grid, config.threads, stream, simt_forward_shared_bytes(config, head_dim),
           q, k, v, out, lse, scale_log2, *extras,
           *tile_arguments(tiles, lse, config.block_m, config.block_n))
