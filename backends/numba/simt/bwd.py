"""FlashAttention backward pass, SIMT (CUDA cores, float32 arithmetic), as Numba kernels.

Nothing of the forward's score matrix is stored: each tile of P is recomputed from Q, K and the
saved row log-sum-exp, P = exp(S - lse). With D_i = rowsum(dO_i * O_i):

    dV = Pᵀ dO      dP = dO Vᵀ      dS = P * (dP - D)      dQ = scale·dS K      dK = scale·dSᵀ Q

Three launches, no floating-point atomics, so repeated runs are bitwise identical:
  1. `delta`: D_i for every query row (device/delta.py).
  2. `dk_dv`: one block per key tile and key/value head; loops over the query tiles that can
     see it (causal: from the first query tile on or below the diagonal; windows: to the last
     whose window reaches it), for each query head of its GQA group in turn, and accumulates
     dK, dV in registers.
  3. `dq`: one block per query tile; loops over the key tiles it can see, accumulating dQ.

Both loops are laid out as the forward (fwd.py): warps own bands of rows
(keys in dk/dv, queries in dq), lanes are 4 row groups x 8 column groups, tiles live in dynamic
shared memory. The tiles a loop streams (Q and dO in dk/dv, K and V in dq) are read by both of
its products, so with config.stages = 2 they are double-buffered: the copy of tile j+1 (cp.async
for aligned float32) runs while tile j is used, one block barrier per tile. P and dS rows are
written and read by the warp that owns them, so a warp barrier orders them. Scores are in log2
units (scaled by softmax_scale·log2(e) as they come out of the product, lse by log2(e));
the tile ranges, the mask, the score mods, the softmax rules and varlen's sequences are
device/'s.
"""
import functools

import numpy as np
from numba import cuda, float32

from ..device.block_range import make_block_range, make_group_walk
from ..device.constants import LOG2E, ONE, POS_INF, ZERO
from ..device.delta import launch_delta
from ..device.intrinsics import SHARED_ALIGN, shared_tile, syncwarp
from ..device.mask import MASK_ALL, make_mask, tile_mask
from ..device.mask_mod import make_tile_table
from ..device.score_mod import make_score_mod
from ..device.sequence import grid_extent, make_sequence
from ..device.softmax import grad_score, lse_log2, probability
from ..device.tile_copy import copy_fences
from ..gpu import SHARED_MEMORY_BYTES
from ..launch import kernel_extras_unused, launch
from ..tile_classes import tile_arguments
from .config import simt_backward_config, simt_backward_shared_bytes
from .tiles import (LANE_COLS, LANE_ROWS, make_chunked_accumulate,
                    make_chunked_store, make_tile_dot, make_tile_loader, tile_columns)


def _dk_dv_kernel_function(config, spec, async_copy):
    head_dim, bf16 = spec.head_dim, spec.bf16
    TK, TQ, STAGES, THREADS = config.key_rows, config.query_cols, config.stages, config.threads
    BLOCK_N, BLOCK_M = config.dk_dv_tiles  # keys per block, queries per streamed tile
    D4, CHUNKS, ROW = tile_columns(config.padded_head_dim(head_dim), head_dim)
    P_ROW = BLOCK_M + 8  # floats per P / dS row: the 4 row groups' stores hit 32 distinct
    #                     banks (for an even query_cols, as every config has)
    STAGED_ROWS = STAGES * BLOCK_M  # rows of the Q and dO buffers (shapes must be literals)
    V_START = 4 * BLOCK_N * ROW  # byte offsets in dynamic shared memory
    Q_START = V_START + 4 * BLOCK_N * ROW
    DO_START = Q_START + 4 * STAGES * BLOCK_M * ROW
    P_START = DO_START + 4 * STAGES * BLOCK_M * ROW
    DS_START = P_START + 4 * BLOCK_N * P_ROW
    LSE_START = DS_START + 4 * BLOCK_N * P_ROW
    D_START = LSE_START + 4 * STAGES * BLOCK_M
    load_k_tile = make_tile_loader(BLOCK_N, head_dim, D4, THREADS, bf16, async_copy)
    load_q_tile = make_tile_loader(BLOCK_M, head_dim, D4, THREADS, bf16, async_copy)
    commit_loads, wait_loads = copy_fences(async_copy)
    tile_scores = make_tile_dot(TK, TQ, LANE_ROWS, LANE_COLS, D4)
    accumulate = make_chunked_accumulate(TK, CHUNKS, LANE_ROWS, LANE_COLS, BLOCK_M)
    store_tile = make_chunked_store(TK, CHUNKS, LANE_ROWS, LANE_COLS, head_dim, bf16)
    REG_S = (TK, TQ)
    REG_D = (TK, 4 * CHUNKS)
    if BLOCK_M > THREADS:
        raise ValueError(f"{config}: a dk/dv query tile of {BLOCK_M} rows needs as many threads")
    visible = make_mask(spec, key_bound=False)
    # (dK, dV rows past seqlen_k are never stored: no mask there)
    _, query_range, _, is_partial, _ = make_block_range(spec, BLOCK_M, BLOCK_N, key_bound=False)
    group_walk, walk_position = make_group_walk(spec, BLOCK_M)
    narrow, mod_class = make_tile_table(spec, BLOCK_M, BLOCK_N)
    score_mod = make_score_mod(spec)
    score_and_grad, exponent_scales = score_mod.score_and_grad, score_mod.scales
    head_slope = score_mod.head_slope
    sequence = make_sequence(spec)
    GROUP, VARLEN = spec.group, spec.varlen

    def flash_bwd_dk_dv(q, k, v, dout, lse, delta, dk, dv, scale_log2, softmax_scale,
                        alibi_slopes, cu_seqlens_q, cu_seqlens_k, attn_mask, tile_classes,
                        tile_spans, mod_arrays):
        lane = cuda.threadIdx.x % 32
        tx = lane % LANE_COLS
        ty = cuda.threadIdx.x // 32 * LANE_ROWS * TK + lane // LANE_COLS  # key rows ty + 4·i
        n0 = cuda.blockIdx.x * BLOCK_N
        h_kv = cuda.blockIdx.y  # the key/value head; its GROUP query heads are summed over
        seq = cuda.blockIdx.z
        b, q_start, seqlen_q, k_start, seqlen_k = sequence(seq, q, k, cu_seqlens_q, cu_seqlens_k)
        if VARLEN and n0 >= seqlen_k:
            return  # (the grid is sized for the longest sequence)
        q_end, k_end = q_start + seqlen_q, k_start + seqlen_k  # the arrays' row bounds
        offset = seqlen_k - seqlen_q
        tile_scale, pre = exponent_scales(scale_log2)  # (device/score_mod.py)

        smem = cuda.shared.array(0, float32, SHARED_ALIGN)  # dynamic: every tile below
        k_tile = shared_tile(smem, 0, BLOCK_N, ROW, float32)
        v_tile = shared_tile(smem, V_START, BLOCK_N, ROW, float32)
        q_tiles = shared_tile(smem, Q_START, STAGED_ROWS, ROW, float32)
        do_tiles = shared_tile(smem, DO_START, STAGED_ROWS, ROW, float32)
        p_tile = shared_tile(smem, P_START, BLOCK_N, P_ROW, float32)
        ds_tile = shared_tile(smem, DS_START, BLOCK_N, P_ROW, float32)
        lse_tiles = shared_tile(smem, LSE_START, STAGES, BLOCK_M, float32)
        delta_tiles = shared_tile(smem, D_START, STAGES, BLOCK_M, float32)

        s = cuda.local.array(REG_S, float32)  # Sᵀ: key rows x query columns
        dp = cuda.local.array(REG_S, float32)  # dPᵀ
        dk_acc = cuda.local.array(REG_D, float32)
        dv_acc = cuda.local.array(REG_D, float32)
        for i in range(TK):
            for c in range(4 * CHUNKS):
                dk_acc[i, c] = ZERO
                dv_acc[i, c] = ZERO

        # Load: K and V, once; Q, dO, lse and D of the first query tile (of the group's first
        # query head) into stage 0. (Rows past seqlen_q, as when no query sees the keys, are
        # zeros with lse +inf.)
        tiles = (tile_classes, tile_spans)  # (device/mask_mod.py: a mask_mod's tile table)
        m_begin, m_end = query_range(n0, seqlen_q, seqlen_k)
        m_begin, m_end = narrow(tiles, seq, h_kv, cuda.blockIdx.x, m_begin, m_end, BLOCK_M)
        m_stop, span = group_walk(m_begin, m_end)
        h_first = h_kv if GROUP == 1 else h_kv * GROUP  # (so with GROUP = 1: blockIdx.y,
        #                                                  whose range spares index checks)
        load_k_tile(k_tile, 0, k, b, k_start + n0, h_kv, k_end)
        load_k_tile(v_tile, 0, v, b, k_start + n0, h_kv, k_end)
        load_q_tile(q_tiles, 0, q, b, q_start + m_begin, h_first, q_end)
        load_q_tile(do_tiles, 0, dout, b, q_start + m_begin, h_first, q_end)
        commit_loads()
        r = cuda.threadIdx.x  # this thread's row of the lse and D tiles, if < BLOCK_M
        if r < BLOCK_M:
            in_range = m_begin + r < seqlen_q
            row = q_start + m_begin + r
            lse_tiles[0, r] = lse_log2(lse[b, h_first, row]) if in_range else POS_INF
            delta_tiles[0, r] = delta[b, h_first, row] if in_range else ZERO

        stage = 0
        for step in range(m_begin, m_stop, BLOCK_M):  # (block_range.make_group_walk)
            head, m0 = walk_position(step, m_begin, span)  # (this tile's: loaded already)
            slope = head_slope(alibi_slopes, seq, h_first + head)
            mask_at = (attn_mask, seq, h_first + head, mod_arrays)  # (device/attn_mask.py)
            wait_loads()
            cuda.syncthreads()  # why: this stage's tiles complete; the last tile's reads done
            # Load: the next query tile (of this head or the next) into the other stage (two
            # stages), while this one is used; its lse and D go to registers now and to
            # shared memory at the end.
            has_next = step + BLOCK_M < m_stop
            next_head, m_next = walk_position(step + BLOCK_M, m_begin, span)
            h_next = h_first if GROUP == 1 else h_first + next_head
            nxt = 1 - stage if STAGES == 2 else 0
            if STAGES == 2 and has_next:
                load_q_tile(q_tiles, nxt * BLOCK_M, q, b, q_start + m_next, h_next, q_end)
                load_q_tile(do_tiles, nxt * BLOCK_M, dout, b, q_start + m_next, h_next, q_end)
            commit_loads()
            # (past the group's last tile, next_head is out of the group: nothing is read)
            next_in_range = (r < BLOCK_M and (GROUP == 1 or has_next)
                             and m_next + r < seqlen_q)
            next_row = q_start + m_next + r
            next_lse = lse[b, h_next, next_row] if next_in_range else ZERO
            next_delta = delta[b, h_next, next_row] if next_in_range else ZERO

            # Scores: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ; then P = exp2(S - lse), dS = P (dP - D)
            # (times the score mod's derivative).
            row0 = stage * BLOCK_M  # this stage's rows in q_tiles, do_tiles
            tile_scores(s, k_tile, q_tiles, ty, row0 + tx)
            tile_scores(dp, v_tile, do_tiles, ty, row0 + tx)
            mask = tile_mask(is_partial(m0, n0, seqlen_q, seqlen_k),
                             mod_class(tiles, seq, mask_at[2], m0, n0))
            for i in range(TK):
                key = ty + LANE_ROWS * i
                for j in range(TQ):
                    query = tx + LANE_COLS * j
                    # (query rows past seqlen_q or that see no key have lse = +inf: p = 0)
                    score, dscore = score_and_grad(s[i, j], pre, slope, m0 + query, n0 + key,
                                                   offset, seqlen_k, mask_at)
                    p = probability(score, tile_scale, lse_tiles[stage, query])
                    if mask and not visible(m0 + query, n0 + key, seqlen_k, offset, mask_at,
                                            mask == MASK_ALL):
                        p = ZERO
                    p_tile[key, query] = p
                    ds_tile[key, query] = grad_score(p, dp[i, j],
                                                     delta_tiles[stage, query]) * dscore
            syncwarp()  # why: the warp's P and dS rows complete before its lanes read them

            # Accumulate: dV += Pᵀ dO, dK += dSᵀ Q (scaled at the end).
            accumulate(dv_acc, p_tile, do_tiles, ty, tx, row0)
            accumulate(dk_acc, ds_tile, q_tiles, ty, tx, row0)
            if STAGES == 1:
                cuda.syncthreads()  # why: every read of the one stage done before reloading
                if has_next:
                    load_q_tile(q_tiles, 0, q, b, q_start + m_next, h_next, q_end)
                    load_q_tile(do_tiles, 0, dout, b, q_start + m_next, h_next, q_end)
                commit_loads()
            if r < BLOCK_M:
                lse_tiles[nxt, r] = lse_log2(next_lse) if next_in_range else POS_INF
                delta_tiles[nxt, r] = next_delta
            stage = nxt

        # Epilogue: one write of dK and dV (key rows past seqlen_k, whose zero K rows gave
        # them nonzero P, are not written).
        store_tile(dk, dk_acc, b, k_start + n0, h_kv, k_end, ty, tx, softmax_scale)
        store_tile(dv, dv_acc, b, k_start + n0, h_kv, k_end, ty, tx, ONE)

    return flash_bwd_dk_dv


def _dq_kernel_function(config, spec, async_copy):
    head_dim, bf16 = spec.head_dim, spec.bf16
    TM, TN, STAGES, THREADS = config.query_rows, config.key_cols, config.stages, config.threads
    BLOCK_M, BLOCK_N = config.dq_tiles  # queries per block, keys per streamed tile
    D4, CHUNKS, ROW = tile_columns(config.padded_head_dim(head_dim), head_dim)
    DS_ROW = BLOCK_N + 8  # (as P_ROW in dk/dv, for an even key_cols)
    STAGED_ROWS = STAGES * BLOCK_N  # rows of the K and V buffers (shapes must be literals)
    DO_START = 4 * BLOCK_M * ROW  # byte offsets in dynamic shared memory
    K_START = DO_START + 4 * BLOCK_M * ROW
    V_START = K_START + 4 * STAGES * BLOCK_N * ROW
    DS_START = V_START + 4 * STAGES * BLOCK_N * ROW
    load_q_tile = make_tile_loader(BLOCK_M, head_dim, D4, THREADS, bf16, async_copy)
    load_k_tile = make_tile_loader(BLOCK_N, head_dim, D4, THREADS, bf16, async_copy)
    commit_loads, wait_loads = copy_fences(async_copy)
    tile_scores = make_tile_dot(TM, TN, LANE_ROWS, LANE_COLS, D4)
    accumulate = make_chunked_accumulate(TM, CHUNKS, LANE_ROWS, LANE_COLS, BLOCK_N)
    store_tile = make_chunked_store(TM, CHUNKS, LANE_ROWS, LANE_COLS, head_dim, bf16)
    REG_S = (TM, TN)
    REG_D = (TM, 4 * CHUNKS)
    visible = make_mask(spec)
    key_range, _, _, is_partial, query_tile_index = make_block_range(spec, BLOCK_M, BLOCK_N)
    narrow, mod_class = make_tile_table(spec, BLOCK_M, BLOCK_N)
    score_mod = make_score_mod(spec)
    score_and_grad, exponent_scales = score_mod.score_and_grad, score_mod.scales
    head_slope = score_mod.head_slope
    sequence = make_sequence(spec)
    GROUP, VARLEN = spec.group, spec.varlen

    def flash_bwd_dq(q, k, v, dout, lse, delta, dq, scale_log2, softmax_scale, alibi_slopes,
                     cu_seqlens_q, cu_seqlens_k, attn_mask, tile_classes, tile_spans, mod_arrays):
        lane = cuda.threadIdx.x % 32
        tx = lane % LANE_COLS
        ty = cuda.threadIdx.x // 32 * LANE_ROWS * TM + lane // LANE_COLS  # query rows ty + 4·i
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

        smem = cuda.shared.array(0, float32, SHARED_ALIGN)  # dynamic: every tile below
        q_tile = shared_tile(smem, 0, BLOCK_M, ROW, float32)
        do_tile = shared_tile(smem, DO_START, BLOCK_M, ROW, float32)
        k_tiles = shared_tile(smem, K_START, STAGED_ROWS, ROW, float32)
        v_tiles = shared_tile(smem, V_START, STAGED_ROWS, ROW, float32)
        ds_tile = shared_tile(smem, DS_START, BLOCK_M, DS_ROW, float32)

        s = cuda.local.array(REG_S, float32)
        dp = cuda.local.array(REG_S, float32)
        dq_acc = cuda.local.array(REG_D, float32)
        lse_i = cuda.local.array(TM, float32)
        delta_i = cuda.local.array(TM, float32)
        for i in range(TM):
            row = m0 + ty + LANE_ROWS * i
            lse_i[i] = lse_log2(lse[b, h, q_start + row]) if row < seqlen_q else POS_INF
            delta_i[i] = delta[b, h, q_start + row] if row < seqlen_q else ZERO
            for c in range(4 * CHUNKS):
                dq_acc[i, c] = ZERO

        # Load: Q and dO, once; K and V of the first key tile into stage 0.
        n_begin, n_end = key_range(m0, seqlen_q, seqlen_k)
        n_begin, n_end = narrow(tiles, seq, h, m0 // BLOCK_M, n_begin, n_end, BLOCK_N)
        load_q_tile(q_tile, 0, q, b, q_start + m0, h, q_end)
        load_q_tile(do_tile, 0, dout, b, q_start + m0, h, q_end)
        if n_begin < n_end:
            load_k_tile(k_tiles, 0, k, b, k_start + n_begin, h_kv, k_end)
            load_k_tile(v_tiles, 0, v, b, k_start + n_begin, h_kv, k_end)
        commit_loads()

        stage = 0
        for n0 in range(n_begin, n_end, BLOCK_N):
            wait_loads()
            cuda.syncthreads()  # why: this stage's K, V complete; the last tile's reads done
            # Load: the next key tile into the other stage (two stages), while this one is used.
            n_next = n0 + BLOCK_N
            nxt = 1 - stage if STAGES == 2 else 0
            if STAGES == 2 and n_next < n_end:
                load_k_tile(k_tiles, nxt * BLOCK_N, k, b, k_start + n_next, h_kv, k_end)
                load_k_tile(v_tiles, nxt * BLOCK_N, v, b, k_start + n_next, h_kv, k_end)
            commit_loads()

            # Scores: S = Q Kᵀ, dP = dO Vᵀ; P = exp2(S - lse); dS = P (dP - D).
            row0 = stage * BLOCK_N  # this stage's rows in k_tiles, v_tiles
            tile_scores(s, q_tile, k_tiles, ty, row0 + tx)
            tile_scores(dp, do_tile, v_tiles, ty, row0 + tx)
            mask = tile_mask(is_partial(m0, n0, seqlen_q, seqlen_k),
                             mod_class(tiles, seq, mask_at[2], m0, n0))
            for i in range(TM):
                query = ty + LANE_ROWS * i
                for j in range(TN):
                    key = tx + LANE_COLS * j
                    score, dscore = score_and_grad(s[i, j], pre, slope, m0 + query, n0 + key,
                                                   offset, seqlen_k, mask_at)
                    p = probability(score, tile_scale, lse_i[i])
                    if mask and not visible(m0 + query, n0 + key, seqlen_k, offset, mask_at,
                                            mask == MASK_ALL):
                        p = ZERO
                    ds_tile[query, key] = grad_score(p, dp[i, j], delta_i[i]) * dscore
            syncwarp()  # why: the warp's dS rows complete before its lanes read them

            # Accumulate: dQ += dS K (scaled at the end).
            accumulate(dq_acc, ds_tile, k_tiles, ty, tx, row0)
            if STAGES == 1:
                cuda.syncthreads()  # why: every read of the one stage done before reloading
                if n_next < n_end:
                    load_k_tile(k_tiles, 0, k, b, k_start + n_next, h_kv, k_end)
                    load_k_tile(v_tiles, 0, v, b, k_start + n_next, h_kv, k_end)
                commit_loads()
            stage = nxt
        wait_loads()  # (with no key tile, the copies of Q and dO are still in flight)

        # Epilogue: one write of dQ.
        store_tile(dq, dq_acc, b, q_start + m0, h, q_end, ty, tx, softmax_scale)

    return flash_bwd_dq


@functools.lru_cache(maxsize=None)
def backward_kernel_functions(config, spec, async_copy=False):
    """The plain Python kernels (dk_dv, dq) for one config, kernel spec
    (AttentionSpec.for_kernels()) and load kind; with async_copy, the float32 inputs are read
    by cp.async (rows of head_dim, a multiple of 4, 16-byte aligned)."""
    return (_dk_dv_kernel_function(config, spec, async_copy),
            _dq_kernel_function(config, spec, async_copy))


@functools.lru_cache(maxsize=None)
def backward_kernels(config, spec, async_copy=False):
    return tuple(cuda.jit(fn, cache=spec.mask_mod is None)
                 for fn in backward_kernel_functions(config, spec, async_copy))


def launch_backward(spec, dout, q, k, v, out, lse, delta, dq, dk, dv, stream=0,
                    async_copy=False, shared_limit=SHARED_MEMORY_BYTES, config=None,
                    extras=None, tiles=None):
    """Launch the three SIMT backward kernels; delta is float32 (batch, nheads, seqlen_q)
    scratch. For bfloat16 the arrays of q's shape and k's are uint16 views of bfloat16 data;
    with async_copy, q, k, v and dout are read by cp.async; `extras` and `tiles` as
    launch_forward's. The
    config is the first for the head dim that fits `shared_limit` bytes of shared memory,
    unless `config` names one."""
    _, _, nheads, head_dim = q.shape
    extras = extras or kernel_extras_unused(lse)
    seqlen_q, batch = grid_extent(spec, q, extras[1], 0)
    seqlen_k, _ = grid_extent(spec, k, extras[2], 1)
    config = config or simt_backward_config(head_dim, shared_limit)
    dk_dv_kernel, dq_kernel = backward_kernels(config, spec.for_kernels(), async_copy)
    dk_dv_bytes, dq_bytes = simt_backward_shared_bytes(config, head_dim)
    scale = np.float32(spec.softmax_scale)
    scale_log2 = np.float32(spec.softmax_scale * float(LOG2E))
    launch_delta(dout, out, delta, "bf16" if spec.bf16 else "float", stream)
    dk_dv_grid = (-(-seqlen_k // config.dk_dv_tiles[0]), k.shape[2], batch)  # per k/v head
    launch(dk_dv_kernel, dk_dv_grid, config.threads, stream, dk_dv_bytes,
           q, k, v, dout, lse, delta, dk, dv, scale_log2, scale, *extras,
           *tile_arguments(tiles, lse, *config.dk_dv_tiles[::-1], along_keys=True))
    dq_grid = (-(-seqlen_q // config.dq_tiles[0]), nheads, batch)
    launch(dq_kernel, dq_grid, config.threads, stream, dq_bytes,
           q, k, v, dout, lse, delta, dq, scale_log2, scale, *extras,
           *tile_arguments(tiles, lse, *config.dq_tiles))
