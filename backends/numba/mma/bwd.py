"""FlashAttention backward on tensor cores (mma.sync m16n8k16), deterministic, in Numba.

Run by the tensor-core engine (engine.py) for float16/bfloat16 on sm_80+.

Same math and the same three launches as the SIMT backward (simt/bwd.py), with
P = exp2(S·scale·log2(e) − lse·log2(e)) recomputed from Q, K and the saved lse
(device/softmax.py), and no atomics:
  1. `delta`: D_i = rowsum(dO_i ∘ O_i), one thread per row (device/delta.py).
  2. `dk_dv`: one block per key tile and key/value head, warp w owning 16 keys. For each
     query head of the GQA group, for each of its query tiles that can see the keys:
     Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (tensor cores, B fragments by ldmatrix), Pᵀ and
     dSᵀ = Pᵀ ∘ (dPᵀ − D) in registers, then dV += Pᵀ dO and dK += dSᵀ Q with Pᵀ / dSᵀ packed
     straight into A fragments (dO and Q read with ldmatrix.trans).
  3. `dq`: one block per query tile, warp w owning 16 queries: S = Q Kᵀ, dP = dO Vᵀ,
     dS = P ∘ (dP − D), dQ += dS K.
The score mods (softcap, ALiBi), varlen's sequences and a mask_mod's tile table (ranges cut to
its spans; the products of tiles no query sees skipped) are device/'s, as in the forward.
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

from ..device.block_range import EMPTY, make_block_range, make_group_walk
from ..device.constants import LOG2E, ONE, POS_INF, ZERO
from ..device.delta import launch_delta
from ..device.fragments import make_fragment_store, make_tile_gradients
from ..device.intrinsics import SHARED_ALIGN, cp_async_commit, cp_async_wait, opaque, shared_tile
from ..device.mask import tile_mask
from ..device.mask_mod import make_tile_table
from ..device.score_mod import make_score_mod
from ..device.sequence import grid_extent, make_sequence
from ..device.softmax import lse_log2
from ..device.tile_copy import make_cp_async_loader
from ..launch import kernel_extras_unused, launch
from ..tile_classes import tile_arguments
from .config import ROW_PAD, mma_backward_config, mma_backward_shared_bytes
from .fragments import (WARP, b_address, check_rows_contiguous, check_shared_bytes,
                        make_warp_accumulate, make_warp_scores, x4_address)


def _check_split(stages, head_dim, d_split):
    if stages not in (1, 2):
        raise ValueError(f"stages must be 1 or 2; got {stages}")
    if d_split < 1 or head_dim % (16 * d_split):
        raise ValueError(f"d_split must be >= 1 and divide head_dim into multiples of 16; got "
                         f"{d_split} for head_dim {head_dim}")


@functools.lru_cache(maxsize=None)
def mma_dk_dv_kernel_function(config, spec):
    """dK, dV for one tile of 16·warps keys, looping over query tiles of block_m (an
    MmaBackwardConfig; spec: AttentionSpec.for_kernels() at the padded head dim). With stages
    = 2 the Q, dO, lse and D of the next query tile load while this one is computed; with
    d_split > 1 the block computes columns [part·D/d_split, (part + 1)·D/d_split) of dK, dV."""
    stages, d_split = config.stages, config.d_split
    _check_split(stages, spec.head_dim, d_split)
    BLOCK_N, BLOCK_M, D, STAGES = 16 * config.warps, config.block_m, spec.head_dim, stages
    THREADS = WARP * config.warps
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
    scores = make_warp_scores(spec.bf16, 1, NQ, D // 16, ROW)
    accumulate = make_warp_accumulate(spec.bf16, 1, BLOCK_M // 16, DB, ROW)
    store = make_fragment_store(spec.bf16, DB)
    # (dK, dV rows past seqlen_k are never stored: no mask there)
    column_gradients = make_tile_gradients(spec, NQ, key_bound=False)[1]
    _, query_range, _, is_partial, _ = make_block_range(spec, BLOCK_M, BLOCK_N, key_bound=False)
    group_walk, walk_position = make_group_walk(spec, BLOCK_M)
    narrow, mod_class = make_tile_table(spec, BLOCK_M, BLOCK_N)
    score_mod = make_score_mod(spec)
    exponent_scales, head_slope = score_mod.scales, score_mod.head_slope
    sequence = make_sequence(spec)
    GROUP, VARLEN = spec.group, spec.varlen

    @cuda.jit(device=True, inline="always")
    def load_queries(q_tiles, do_tiles, stats, q, dout, lse, delta, b, h, m0, q_end, stage):
        """Q, dO (cp.async) and lse, D (plain stores) of the query tile at array row m0 into
        buffer `stage` (rows at or past q_end: zeros, lse +inf)."""
        load_tile(q_tiles, BLOCK_M * stage, q, b, m0, h, q_end, BLOCK_M)
        load_tile(do_tiles, BLOCK_M * stage, dout, b, m0, h, q_end, BLOCK_M)
        for r in range(cuda.threadIdx.x, BLOCK_M, THREADS):
            in_range = m0 + r < q_end
            stats[2 * stage, r] = lse_log2(lse[b, h, m0 + r]) if in_range else POS_INF
            stats[2 * stage + 1, r] = delta[b, h, m0 + r] if in_range else ZERO

    def flash_bwd_dk_dv_mma(q, k, v, dout, lse, delta, dk, dv, scale_log2, softmax_scale,
                            alibi_slopes, cu_seqlens_q, cu_seqlens_k, attn_mask, tile_classes,
                            tile_spans, mod_arrays):
        tid = cuda.threadIdx.x
        warp = tid // WARP
        lane = tid % WARP
        g = lane // 4
        n0 = cuda.blockIdx.x * BLOCK_N
        h_kv = cuda.blockIdx.y // d_split  # the key/value head; its GROUP query heads summed
        col0 = cuda.blockIdx.y % d_split * (8 * DB)  # the block's first dK, dV column
        seq = cuda.blockIdx.z
        b, q_start, seqlen_q, k_start, seqlen_k = sequence(seq, q, k, cu_seqlens_q, cu_seqlens_k)
        if VARLEN and n0 >= seqlen_k:
            return  # (the grid is sized for the longest sequence)
        q_end, k_end = q_start + seqlen_q, k_start + seqlen_k  # the arrays' row bounds
        offset = seqlen_k - seqlen_q
        tile_scale, pre = exponent_scales(scale_log2)  # (device/score_mod.py)
        key_lo = n0 + 16 * warp + g  # this lane's two keys (rows of Sᵀ)

        smem = cuda.shared.array(0, uint16, SHARED_ALIGN)  # dynamic: K, V, Q, dO tiles
        k_tile = shared_tile(smem, 0, BLOCK_N, ROW, uint16)
        v_tile = shared_tile(smem, V_START, BLOCK_N, ROW, uint16)
        q_tiles = shared_tile(smem, Q_START, QUERY_ROWS, ROW, uint16)
        do_tiles = shared_tile(smem, DO_START, QUERY_ROWS, ROW, uint16)
        stats = shared_tile(smem, STATS_START, STATS_ROWS, BLOCK_M, float32)

        s = cuda.local.array((1, NQ, 4), float32)  # Sᵀ, then Pᵀ (one 16-row slice)
        dp = cuda.local.array((1, NQ, 4), float32)  # dPᵀ, then dSᵀ
        dk_acc = cuda.local.array((1, DB, 4), float32)
        dv_acc = cuda.local.array((1, DB, 4), float32)
        for db in range(DB):
            for r in range(4):
                dk_acc[0, db, r] = ZERO
                dv_acc[0, db, r] = ZERO

        # Load: K and V of this key tile, once (and with two stages the first query tile, of
        # the group's first query head).
        load_tile(k_tile, 0, k, b, k_start + n0, h_kv, k_end, BLOCK_N)
        load_tile(v_tile, 0, v, b, k_start + n0, h_kv, k_end, BLOCK_N)
        cp_async_commit()
        tiles = (tile_classes, tile_spans)  # (device/mask_mod.py)
        m_begin, m_end = query_range(n0, seqlen_q, seqlen_k)
        m_begin, m_end = narrow(tiles, seq, h_kv, cuda.blockIdx.x, m_begin, m_end, BLOCK_M)
        m_stop, span = group_walk(m_begin, m_end)
        h_first = h_kv * GROUP
        if STAGES == 2:
            if m_begin < m_end:
                load_queries(q_tiles, do_tiles, stats, q, dout, lse, delta, b, h_first,
                             q_start + m_begin, q_end, 0)
            cp_async_commit()

        # The lane's ldmatrix addresses (fragments.py): K and V (this warp's 16 keys) as A
        # of Sᵀ and dPᵀ; Q and dO (stage 0) as their B, and as B of dK and dV (.trans).
        k_a, v_a = x4_address(k_tile, 16 * warp), x4_address(v_tile, 16 * warp)
        q_b, do_b = b_address(q_tiles, 0), b_address(do_tiles, 0)
        q_t, do_t = x4_address(q_tiles, 0) + 2 * col0, x4_address(do_tiles, 0) + 2 * col0

        stage = 0
        for step in range(m_begin, m_stop, BLOCK_M):  # (block_range.make_group_walk)
            head, m0 = walk_position(step, m_begin, span)
            slope = head_slope(alibi_slopes, seq, h_first + head)
            mask_at = (attn_mask, seq, h_first + head, mod_arrays)  # (device/attn_mask.py)
            kind = mod_class(tiles, seq, h_first + head, m0, n0)
            # Load: this query tile (one stage), or the next one, of this head or the next,
            # behind this one (two stages).
            if STAGES == 2:
                if step + BLOCK_M < m_stop:
                    next_head, m_next = walk_position(step + BLOCK_M, m_begin, span)
                    load_queries(q_tiles, do_tiles, stats, q, dout, lse, delta, b,
                                 h_first + next_head, q_start + m_next, q_end, 1 - stage)
                cp_async_commit()  # (empty on the last tile: the counting stays uniform)
                cp_async_wait(1)  # everything but the next tile has landed
            else:
                load_queries(q_tiles, do_tiles, stats, q, dout, lse, delta, b, h_first + head,
                             q_start + m0, q_end, 0)
                cp_async_commit()
                cp_async_wait(0)
            cuda.syncthreads()  # why: K, V, Q, dO, lse, D tiles complete before any warp reads
            stage_bytes = 2 * ROW * BLOCK_M * stage  # where this stage's Q and dO rows start
            # (the addresses go through `opaque` each tile: see ldmatrix._LDMATRIX_AT's comment)

            # Scores: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for the warp's 16 keys (not for a tile no
            # query sees: mask_mod's EMPTY).
            mask = tile_mask(is_partial(m0, n0, seqlen_q, seqlen_k), kind)
            if kind != EMPTY:
                scores(s, opaque(k_a), opaque(q_b + stage_bytes))
                scores(dp, opaque(v_a), opaque(do_b + stage_bytes))
                column_gradients(s, dp, key_lo, m0, mask, stats, 2 * stage, 2 * stage + 1,
                                 tile_scale, pre, slope, offset, seqlen_k, mask_at)

            # Accumulate: dV += Pᵀ dO, dK += dSᵀ Q (scaled at the end).
            if kind != EMPTY:
                accumulate(dv_acc, s, opaque(do_t + stage_bytes))
                accumulate(dk_acc, dp, opaque(q_t + stage_bytes))
            cuda.syncthreads()  # why: all warps are done with this stage before it is refilled
            stage = (stage + 1) % STAGES

        cp_async_wait(0)  # nothing may be left in flight into shared memory at exit

        # Epilogue: one write of dK and dV.
        store(dk, dk_acc, 0, b, k_start + key_lo, h_kv, col0, k_end, softmax_scale,
              softmax_scale)
        store(dv, dv_acc, 0, b, k_start + key_lo, h_kv, col0, k_end, ONE, ONE)

    return flash_bwd_dk_dv_mma


@functools.lru_cache(maxsize=None)
def mma_dq_kernel_function(config, spec):
    """dQ for one tile of 16·warps queries, looping over key tiles of block_n (as
    mma_dk_dv_kernel_function). With stages = 2 the K and V of the next key tile load while
    this one is computed; with d_split > 1 the block computes columns [part·D/d_split,
    (part + 1)·D/d_split) of dQ."""
    stages, d_split = config.stages, config.d_split
    _check_split(stages, spec.head_dim, d_split)
    BLOCK_M, BLOCK_N, D, STAGES = 16 * config.warps, config.block_n, spec.head_dim, stages
    THREADS = WARP * config.warps
    NB = BLOCK_N // 8
    DB = D // d_split // 8  # 8-column blocks of the dQ accumulator
    ROW = D + ROW_PAD
    DO_START = 2 * BLOCK_M * ROW  # bytes
    K_START = 2 * DO_START
    KEY_ROWS = STAGES * BLOCK_N  # the K (and V) buffers of all stages
    V_START = K_START + 2 * KEY_ROWS * ROW
    load_tile = make_cp_async_loader(D, THREADS)
    scores = make_warp_scores(spec.bf16, 1, NB, D // 16, ROW)
    accumulate = make_warp_accumulate(spec.bf16, 1, BLOCK_N // 16, DB, ROW)
    store = make_fragment_store(spec.bf16, DB)
    row_gradients = make_tile_gradients(spec, NB)[0]
    key_range, _, _, is_partial, query_tile_index = make_block_range(spec, BLOCK_M, BLOCK_N)
    narrow, mod_class = make_tile_table(spec, BLOCK_M, BLOCK_N)
    score_mod = make_score_mod(spec)
    exponent_scales, head_slope = score_mod.scales, score_mod.head_slope
    sequence = make_sequence(spec)
    GROUP, VARLEN = spec.group, spec.varlen

    @cuda.jit(device=True, inline="always")
    def load_keys(k_tiles, v_tiles, k, v, b, h, n0, k_end, stage):
        load_tile(k_tiles, BLOCK_N * stage, k, b, n0, h, k_end, BLOCK_N)
        load_tile(v_tiles, BLOCK_N * stage, v, b, n0, h, k_end, BLOCK_N)

    def flash_bwd_dq_mma(q, k, v, dout, lse, delta, dq, scale_log2, softmax_scale, alibi_slopes,
                         cu_seqlens_q, cu_seqlens_k, attn_mask, tile_classes, tile_spans,
                         mod_arrays):
        tid = cuda.threadIdx.x
        warp = tid // WARP
        lane = tid % WARP
        g = lane // 4
        m0 = query_tile_index() * BLOCK_M
        h = cuda.blockIdx.y // d_split
        h_kv = h // GROUP  # the key/value head of this query head (GQA)
        col0 = cuda.blockIdx.y % d_split * (8 * DB)  # the block's first dQ column
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
        row_lo = m0 + 16 * warp + g
        row_hi = row_lo + 8
        lse_lo = lse_log2(lse[b, h, q_start + row_lo]) if row_lo < seqlen_q else POS_INF
        lse_hi = lse_log2(lse[b, h, q_start + row_hi]) if row_hi < seqlen_q else POS_INF
        delta_lo = delta[b, h, q_start + row_lo] if row_lo < seqlen_q else ZERO
        delta_hi = delta[b, h, q_start + row_hi] if row_hi < seqlen_q else ZERO

        smem = cuda.shared.array(0, uint16, SHARED_ALIGN)  # dynamic: Q, dO, K, V tiles
        q_tile = shared_tile(smem, 0, BLOCK_M, ROW, uint16)
        do_tile = shared_tile(smem, DO_START, BLOCK_M, ROW, uint16)
        k_tiles = shared_tile(smem, K_START, KEY_ROWS, ROW, uint16)
        v_tiles = shared_tile(smem, V_START, KEY_ROWS, ROW, uint16)

        s = cuda.local.array((1, NB, 4), float32)  # S, then P (one 16-row slice)
        dp = cuda.local.array((1, NB, 4), float32)  # dP, then dS
        dq_acc = cuda.local.array((1, DB, 4), float32)
        for db in range(DB):
            for r in range(4):
                dq_acc[0, db, r] = ZERO

        # Load: Q and dO of this query tile, once (and with two stages the first key tile).
        load_tile(q_tile, 0, q, b, q_start + m0, h, q_end, BLOCK_M)
        load_tile(do_tile, 0, dout, b, q_start + m0, h, q_end, BLOCK_M)
        cp_async_commit()
        n_begin, n_end = key_range(m0, seqlen_q, seqlen_k)
        n_begin, n_end = narrow(tiles, seq, h, m0 // BLOCK_M, n_begin, n_end, BLOCK_N)
        if STAGES == 2:
            if n_begin < n_end:
                load_keys(k_tiles, v_tiles, k, v, b, h_kv, k_start + n_begin, k_end, 0)
            cp_async_commit()

        # The lane's ldmatrix addresses (fragments.py): Q and dO (this warp's 16 queries) as
        # A of S and dP; K and V (stage 0) as their B, and K as B of dQ (.trans).
        q_a, do_a = x4_address(q_tile, 16 * warp), x4_address(do_tile, 16 * warp)
        k_b, v_b = b_address(k_tiles, 0), b_address(v_tiles, 0)
        k_t = x4_address(k_tiles, 0) + 2 * col0

        stage = 0
        for n0 in range(n_begin, n_end, BLOCK_N):
            # Load: this key tile (one stage), or the next one behind this one (two stages).
            if STAGES == 2:
                if n0 + BLOCK_N < n_end:
                    load_keys(k_tiles, v_tiles, k, v, b, h_kv, k_start + n0 + BLOCK_N, k_end,
                              1 - stage)
                cp_async_commit()  # (empty on the last tile: the counting stays uniform)
                cp_async_wait(1)  # everything but the next tile has landed
            else:
                load_keys(k_tiles, v_tiles, k, v, b, h_kv, k_start + n0, k_end, 0)
                cp_async_commit()
                cp_async_wait(0)
            cuda.syncthreads()  # why: Q, dO (first time), K, V tiles complete before reads
            stage_bytes = 2 * ROW * BLOCK_N * stage  # where this stage's K and V rows start

            # Scores: S = Q Kᵀ, dP = dO Vᵀ; P = exp2(S - lse), dS = P (dP - D) (not for a tile
            # no query sees: mask_mod's EMPTY).
            kind = mod_class(tiles, seq, h, m0, n0)
            mask = tile_mask(is_partial(m0, n0, seqlen_q, seqlen_k), kind)
            if kind != EMPTY:
                scores(s, opaque(q_a), opaque(k_b + stage_bytes))
                scores(dp, opaque(do_a), opaque(v_b + stage_bytes))
                row_gradients(s, dp, row_lo, n0, mask, lse_lo, lse_hi, delta_lo, delta_hi,
                              tile_scale, pre, slope, offset, seqlen_k, mask_at)

            # Accumulate: dQ += dS K (scaled at the end).
            if kind != EMPTY:
                accumulate(dq_acc, dp, opaque(k_t + stage_bytes))
            cuda.syncthreads()  # why: all warps are done with this stage before it is refilled
            stage = (stage + 1) % STAGES

        cp_async_wait(0)  # nothing may be left in flight into shared memory at exit

        # Epilogue: one write of dQ.
        store(dq, dq_acc, 0, b, q_start + row_lo, h, col0, q_end, softmax_scale, softmax_scale)

    return flash_bwd_dq_mma


@functools.lru_cache(maxsize=None)
def mma_backward_kernels(config, spec):
    """The compiled (dk_dv, dq) kernels of one MmaBackwardConfig and kernel spec."""
    return (cuda.jit(mma_dk_dv_kernel_function(config, spec), cache=spec.mask_mod is None),
            cuda.jit(mma_dq_kernel_function(config, spec), cache=spec.mask_mod is None))


def launch_mma_backward(spec, dout, q, k, v, out, lse, delta, dq, dk, dv, stream=0,
                        config=None, extras=None, tiles=None):
    """All 16-bit arrays are uint16 views (batch, seqlen, nheads, headdim) with contiguous,
    16-byte aligned rows, headdim the padded head dim; lse, delta (scratch): float32 (batch,
    nheads, seqlen_q). `extras` and `tiles` as launch_mma_forward's. `config` overrides
    mma_backward_config (tests, tuning)."""
    check_rows_contiguous(dout=dout, q=q, k=k, v=v)
    _, _, nheads, head_dim = q.shape
    extras = extras or kernel_extras_unused(lse)
    seqlen_q, batch = grid_extent(spec, q, extras[1], 0)
    seqlen_k, _ = grid_extent(spec, k, extras[2], 1)
    config = config or mma_backward_config(head_dim, spec)
    if config is None:
        raise ValueError(f"no tensor-core backward config for head_dim {head_dim} (the engine "
                         f"pads it: config.mma_head_dim)")
    dk_dv_kernel, dq_kernel = mma_backward_kernels(config, spec.for_kernels(head_dim=head_dim))
    scale = np.float32(spec.softmax_scale)
    scale_log2 = np.float32(spec.softmax_scale * float(LOG2E))
    rows, threads = 16 * config.warps, WARP * config.warps
    dk_dv_bytes, dq_bytes = mma_backward_shared_bytes(config, head_dim)
    check_shared_bytes(max(dk_dv_bytes, dq_bytes), f"{config} at head_dim {head_dim}")
    launch_delta(dout, out, delta, "bf16" if spec.bf16 else "f16", stream)
    split_heads = nheads * config.d_split  # (head, part of the head dim) per blockIdx.y
    kv_split_heads = k.shape[2] * config.d_split  # dK, dV: per key/value head (GQA)
    launch(dk_dv_kernel, (-(-seqlen_k // rows), kv_split_heads, batch), threads, stream,
           dk_dv_bytes, q, k, v, dout, lse, delta, dk, dv, scale_log2, scale, *extras,
           *tile_arguments(tiles, lse, config.block_m, rows, along_keys=True))
    launch(dq_kernel, (-(-seqlen_q // rows), split_heads, batch), threads, stream, dq_bytes,
           q, k, v, dout, lse, delta, dq, scale_log2, scale, *extras,
           *tile_arguments(tiles, lse, rows, config.block_n))
