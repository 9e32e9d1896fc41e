"""The Hopper backward's dK/dV kernel (sm_90a): wgmma products fed by a producer warpgroup
through an mbarrier pipeline, deterministic (no atomics), in Numba.

One block per (key tile of ROWS = 64·CONSUMERS keys, key/value head, batch entry or sequence)
of 1 + CONSUMERS warpgroups:
  - the producer (setmaxnreg.dec) copies the key tile's K and V once, then for each query
    tile of each query head of the GQA group that sees the keys (device/block_range.py's
    group walk, in a fixed order) its Q and dO (the 128-byte swizzle of layout.py) and its
    lse (log2 units) and D (plain stores) into stage j % STAGES, announcing each on the
    stage's full mbarrier. With the copy engine (config.copy_engine) its first warp does it:
    one lane issues the copies (tensor maps the warp publishes first, as the forward's),
    which complete on the barrier as transactions, and every lane writes its share of the
    stats and arrives; otherwise (maps the driver refuses) the warpgroup copies with
    cp.async;
  - each consumer (setmaxnreg.inc) owns 64 keys: per query tile Sᵀ = K Qᵀ and dPᵀ = V dOᵀ
    (products over the head dim, both tiles K-major), Pᵀ and dSᵀ = Pᵀ ∘ (dPᵀ − D) in
    registers (device/fragments.py, columns are queries), then dV += Pᵀ dO and dK += dSᵀ Q
    with Pᵀ and dSᵀ packed to 16 bits as the products' A and dO, Q MN-major; then each of
    its warps frees the stage (a warp barrier orders its lanes' loads of lse and D first).
    dK (times the softmax scale) and dV leave from registers.
A mask_mod's tile table (device/mask_mod.py) narrows the query range (over the group's heads),
and the query tiles that see no key of the tile are neither copied nor computed.
Where blocks are few (hopper/grids.py) a block may walk a part of the group, storing float32
partial dK and dV to its own head slot (device/group_sums.py adds them), and the key tiles
may run along grid.y (longest first under causal).
"""
import functools

from numba import cuda, float32, uint16, uint32, uint64

from ..device.block_range import EMPTY, make_block_range, make_group_walk
from ..device.constants import POS_INF, ZERO
from ..device.fragments import make_fragment_store, make_pack_chunk, make_tile_gradients
from ..device.intrinsics import (cp_async_commit, make_descriptor, make_fence_operands,
                                 map_slot, mbarrier_arrive, mbarrier_expect_tx, mbarrier_wait,
                                 opaque, setmaxnreg_dec, setmaxnreg_inc, shared_base, syncwarp,
                                 tensor_map_acquire, wgmma_commit, wgmma_fence, wgmma_wait)
from ..device.mask import tile_mask
from ..device.mask_mod import make_tile_table
from ..device.score_mod import make_score_mod
from ..device.sequence import make_sequence
from ..device.softmax import lse_log2
from .config import WARPGROUP, tile_bytes
from .layout import ATOM_BYTES, K_MAJOR_LEADING, ROW_BYTES, make_tile_copy, make_tile_loader
from .products import (announce_all, announce_previous, barrier_words, empty_barrier,
                       free_parity, full_barrier, full_parity, make_barrier_init,
                       make_register_products, make_score_products)
from .tensor_maps import MAP_COUNT, SCRATCH_WORDS, make_map_writer, publish_maps


@functools.lru_cache(maxsize=None)
def hopper_dk_dv_kernel_function(config, spec, split=1, keys_slowest=False):
    """The plain Python kernel for one HopperBackwardConfig and kernel spec
    (AttentionSpec.for_kernels(), head_dim 64 or 128); split, keys_slowest: the grid's
    layout (hopper/grids.py: the blocks of a key tile and key head, key tiles along grid.y)."""
    ROWS, BLOCK_M, D = config.rows, config.block_m, spec.head_dim
    CONSUMERS, STAGES = config.consumers, config.stages
    PRODUCER_REGISTERS, CONSUMER_REGISTERS = config.registers
    NQ, DB, QC = BLOCK_M // 8, D // 8, BLOCK_M // 16
    ROW_TILE, Q_TILE = tile_bytes(ROWS, D), tile_bytes(BLOCK_M, D)
    V_START, Q_START = ROW_TILE, 2 * ROW_TILE  # K, V; then Q stages, then dO stages
    DO_START = Q_START + STAGES * Q_TILE
    # mbarriers: K and V's; the pipeline's full and empty ones (products.py)
    STAGE_FULL, STAGE_EMPTY = full_barrier(0, 0, STAGES), empty_barrier(0, 0, STAGES, 1)
    BARRIERS = barrier_words(1, STAGES)
    COPY_ENGINE = config.copy_engine
    # (empty: an arrival per consumer warp; full: the producer warp's lanes, or warpgroup's)
    init_barriers = make_barrier_init(1, STAGES, CONSUMERS * (WARPGROUP // 32),
                                      32 if COPY_ENGINE else WARPGROUP)
    STATS_SHAPE = (2 * STAGES, BLOCK_M)  # lse (log2 units) and D of each stage's queries
    S_SHAPE, ACC_SHAPE, A_SHAPE = (1, NQ, 4), (1, DB, 4), (QC, 4)

    load_keys = make_tile_loader(D, ROWS)
    load_queries = make_tile_loader(D, BLOCK_M)
    copy_keys, copy_queries = make_tile_copy(D, ROWS), make_tile_copy(D, BLOCK_M)
    score_products = make_score_products(BLOCK_M, spec.bf16, D, ROWS, BLOCK_M)
    grad_products = make_register_products(D, spec.bf16, QC, BLOCK_M)
    fence_scores, fence_acc = make_fence_operands(NQ * 4), make_fence_operands(DB * 4)
    fence_a = make_fence_operands(QC * 4)
    # (dK, dV rows past seqlen_k are never stored: no mask there)
    column_gradients = make_tile_gradients(spec, NQ, key_bound=False)[1]
    pack_chunk = make_pack_chunk(spec.bf16)
    SPLIT, KEYS_SLOWEST = split, keys_slowest
    HEADS = spec.group // SPLIT  # (the query heads a block walks)
    store = make_fragment_store(spec.bf16, DB, float32_out=SPLIT > 1)
    _, query_range, _, is_partial, _ = make_block_range(spec, BLOCK_M, ROWS, key_bound=False)
    group_walk, walk_position = make_group_walk(spec, BLOCK_M, HEADS)
    narrow, mod_class = make_tile_table(spec, BLOCK_M, ROWS)
    score_mod = make_score_mod(spec)
    exponent_scales, head_slope = score_mod.scales, score_mod.head_slope
    sequence = make_sequence(spec)
    GROUP, VARLEN = spec.group, spec.varlen
    write_map = make_map_writer(VARLEN)

    @cuda.jit(device=True, inline="always")
    def write_stats(stats, s, lse, delta, b, h, row0, q_end, first, step):
        """lse (log2 units) and D of the stage's query rows first, first + step, ... (rows
        past the sequence: P = 0)."""
        for r in range(first, BLOCK_M, step):
            row = row0 + r
            in_range = row < q_end
            stats[2 * s, r] = lse_log2(lse[b, h, row]) if in_range else POS_INF
            stats[2 * s + 1, r] = delta[b, h, row] if in_range else ZERO

    @cuda.jit(device=True, inline="always")
    def produce(smem_base, bars, stats, q, k, v, dout, lse, delta, b, q_start, q_end, k_row0,
                k_end, h_kv, h_first, m_begin, m_stop, span, tiles, seq, n0):
        """K and V, then each visited query tile's Q, dO, lse and D, one commit group each,
        each announced once landed (products.py)."""
        load_keys(smem_base, k, b, k_row0, h_kv, k_end)
        load_keys(smem_base + V_START, v, b, k_row0, h_kv, k_end)
        cp_async_commit()
        landed = bars  # (K and V's barrier first)
        j = 0
        for step in range(m_begin, m_stop, BLOCK_M):
            head, m0 = walk_position(step, m_begin, span)
            h = h_first + head
            if mod_class(tiles, seq, h, m0, n0) == EMPTY:
                continue
            s = j % STAGES
            mbarrier_wait(bars + STAGE_EMPTY + 8 * s, free_parity(j, STAGES))
            load_queries(smem_base + Q_START + s * Q_TILE, q, b, q_start + m0, h, q_end)
            load_queries(smem_base + DO_START + s * Q_TILE, dout, b, q_start + m0, h, q_end)
            write_stats(stats, s, lse, delta, b, h, q_start + m0, q_end,
                        cuda.threadIdx.x % WARPGROUP, WARPGROUP)
            cp_async_commit()
            announce_previous(landed)
            landed = bars + STAGE_FULL + 8 * s
            j += 1
        announce_all(landed)

    @cuda.jit(device=True, inline="always")
    def produce_by_copy_engine(smem_base, bars, stats, maps, first_map, lse, delta, b,
                               q_start, q_end, h_kv, h_first, m_begin, m_stop, span, tiles,
                               seq, n0):
        """The producer warp with the copy engine (maps first_map + 0-3: q, dout, k, v, from
        the sequence's first rows: copies in the sequence's row coordinates): lane 0 issues
        K and V, then each visited query tile's Q and dO, announced (arrive.expect_tx) before
        their copies; every lane writes its share of the tile's stats and arrives (an
        arrival releases the lane's stores to the consumers)."""
        lane = cuda.threadIdx.x % 32
        if lane == 0:
            for i in range(4):
                tensor_map_acquire(map_slot(maps, first_map + i))
            mbarrier_expect_tx(bars, 2 * ROW_TILE)
            copy_keys(smem_base, map_slot(maps, first_map + 2), h_kv, n0, b, bars)
            copy_keys(smem_base + V_START, map_slot(maps, first_map + 3), h_kv, n0, b, bars)
        else:
            mbarrier_arrive(bars)
        j = 0
        for step in range(m_begin, m_stop, BLOCK_M):
            head, m0 = walk_position(step, m_begin, span)
            h = h_first + head
            if mod_class(tiles, seq, h, m0, n0) == EMPTY:
                continue
            s = j % STAGES
            full = bars + STAGE_FULL + 8 * s
            mbarrier_wait(bars + STAGE_EMPTY + 8 * s, free_parity(j, STAGES))
            write_stats(stats, s, lse, delta, b, h, q_start + m0, q_end, lane, 32)
            if lane == 0:
                mbarrier_expect_tx(full, 2 * Q_TILE)
                copy_queries(smem_base + Q_START + s * Q_TILE, map_slot(maps, first_map), h,
                             m0, b, full)
                copy_queries(smem_base + DO_START + s * Q_TILE,
                             map_slot(maps, first_map + 1), h, m0, b, full)
            else:
                mbarrier_arrive(full)
            j += 1

    def flash_bwd_dk_dv_hopper(q, k, v, dout, lse, delta, dk, dv, scale_log2, softmax_scale,
                               maps, templates, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                               attn_mask, tile_classes, tile_spans, mod_arrays):
        tid = cuda.threadIdx.x
        warpgroup = tid // WARPGROUP
        key_tile = cuda.blockIdx.y if KEYS_SLOWEST else cuda.blockIdx.x
        slot = cuda.blockIdx.x if KEYS_SLOWEST else cuda.blockIdx.y  # (of dk and dv's heads)
        n0 = key_tile * ROWS
        h_kv = slot // SPLIT  # the key/value head; HEADS query heads of its group summed
        seq = cuda.blockIdx.z
        b, q_start, seqlen_q, k_start, seqlen_k = sequence(seq, q, k, cu_seqlens_q, cu_seqlens_k)
        if VARLEN and n0 >= seqlen_k:
            return  # (the grid is sized for the longest sequence; the whole block leaves)
        tiles = (tile_classes, tile_spans)  # (device/mask_mod.py)
        m_begin, m_end = query_range(n0, seqlen_q, seqlen_k)
        m_begin, m_end = narrow(tiles, seq, h_kv, key_tile, m_begin, m_end, BLOCK_M)
        m_stop, span = group_walk(m_begin, m_end)
        h_first = h_kv * GROUP + slot % SPLIT * HEADS

        smem = cuda.shared.array(0, uint16)  # dynamic: K, V, Q and dO tiles
        stats = cuda.shared.array(STATS_SHAPE, float32)
        barrier_words = cuda.shared.array(BARRIERS, uint64)
        map_words = cuda.shared.array(SCRATCH_WORDS, uint64)
        smem_base = shared_base(smem, ATOM_BYTES)
        bars = shared_base(barrier_words, 8)
        if tid == 0:
            init_barriers(bars)
        cuda.syncthreads()  # why: the barriers are initialised before anyone uses them

        if warpgroup == 0:
            setmaxnreg_dec(PRODUCER_REGISTERS)
            if not COPY_ENGINE:
                produce(smem_base, bars, stats, q, k, v, dout, lse, delta, b, q_start,
                        q_start + seqlen_q, k_start + n0, k_start + seqlen_k, h_kv, h_first,
                        m_begin, m_stop, span, tiles, seq, n0)
            elif tid < 32:
                scratch = shared_base(map_words, 128)
                first_map = seq * MAP_COUNT if VARLEN else 0
                if tid == 0:
                    write_map(scratch, 0, q, templates[0], q_start, seqlen_q)
                    write_map(scratch, 1, dout, templates[1], q_start, seqlen_q)
                    write_map(scratch, 2, k, templates[2], k_start, seqlen_k)
                    write_map(scratch, 3, v, templates[3], k_start, seqlen_k)
                publish_maps(scratch, maps, first_map, 4)
                produce_by_copy_engine(smem_base, bars, stats, maps, first_map, lse, delta, b,
                                       q_start, q_start + seqlen_q, h_kv, h_first, m_begin,
                                       m_stop, span, tiles, seq, n0)
        else:
            setmaxnreg_inc(CONSUMER_REGISTERS)
            consumer = warpgroup - 1
            lane = tid % 32
            # This thread's keys: key_lo and key_lo + 8 (the rows of Sᵀ).
            key_lo = n0 + 64 * consumer + 16 * ((tid % WARPGROUP) // 32) + lane // 4
            offset = seqlen_k - seqlen_q
            tile_scale, pre = exponent_scales(scale_log2)  # (device/score_mod.py)

            s = cuda.local.array(S_SHAPE, float32)  # Sᵀ, then Pᵀ
            dp = cuda.local.array(S_SHAPE, float32)  # dPᵀ, then dSᵀ
            dk_acc = cuda.local.array(ACC_SHAPE, float32)
            dv_acc = cuda.local.array(ACC_SHAPE, float32)
            p = cuda.local.array(A_SHAPE, uint32)
            ds = cuda.local.array(A_SHAPE, uint32)
            for db in range(DB):
                for r in range(4):
                    dk_acc[0, db, r] = ZERO
                    dv_acc[0, db, r] = ZERO
            k_rows = smem_base + 64 * consumer * ROW_BYTES  # (this consumer's K rows)
            mbarrier_wait(bars, 0)  # K and V have landed
            j = 0
            for step in range(m_begin, m_stop, BLOCK_M):
                head, m0 = walk_position(step, m_begin, span)
                h = h_first + head
                kind = mod_class(tiles, seq, h, m0, n0)
                if kind == EMPTY:  # (no query sees a key of it: mask_mod only)
                    continue
                stage = j % STAGES
                q_tile = smem_base + Q_START + stage * Q_TILE
                do_tile = smem_base + DO_START + stage * Q_TILE
                mbarrier_wait(bars + STAGE_FULL + 8 * stage, full_parity(j, STAGES))

                # Scores: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, 64 keys x BLOCK_M queries. (The K and V
                # descriptors are made again each tile, from an address the compiler cannot
                # look through: held across the loop, each k16 step's took two registers.)
                rows = opaque(k_rows)
                k_desc = make_descriptor(rows, K_MAJOR_LEADING, ATOM_BYTES)
                v_desc = make_descriptor(rows + V_START, K_MAJOR_LEADING, ATOM_BYTES)
                fence_scores(s)
                fence_scores(dp)
                wgmma_fence()
                score_products(s, k_desc,
                               make_descriptor(q_tile, K_MAJOR_LEADING, ATOM_BYTES))
                score_products(dp, v_desc,
                               make_descriptor(do_tile, K_MAJOR_LEADING, ATOM_BYTES))
                wgmma_commit()
                wgmma_wait(0)
                fence_scores(s)
                fence_scores(dp)

                # Pᵀ = exp2(Sᵀ - lse) and dSᵀ = Pᵀ (dPᵀ - D), the mask on partial tiles.
                column_gradients(s, dp, key_lo, m0,
                                 tile_mask(is_partial(m0, n0, seqlen_q, seqlen_k), kind),
                                 stats, 2 * stage, 2 * stage + 1, tile_scale, pre,
                                 head_slope(alibi_slopes, seq, h), offset, seqlen_k,
                                 (attn_mask, seq, h, mod_arrays))
                for qc in range(QC):
                    p[qc, 0], p[qc, 1], p[qc, 2], p[qc, 3] = pack_chunk(s, 0, qc)
                    ds[qc, 0], ds[qc, 1], ds[qc, 2], ds[qc, 3] = pack_chunk(dp, 0, qc)

                # Accumulate: dV += Pᵀ dO, dK += dSᵀ Q (dO and Q MN-major).
                fence_acc(dv_acc)
                fence_acc(dk_acc)
                fence_a(p)
                fence_a(ds)
                wgmma_fence()
                grad_products(dv_acc, p, do_tile)
                grad_products(dk_acc, ds, q_tile)
                wgmma_commit()
                wgmma_wait(0)
                fence_acc(dv_acc)
                fence_acc(dk_acc)
                # why: the lanes' plain loads of the stage's lse and D come before their warp's
                # arrival, which (with the other consumer warps') lets the producer overwrite them
                syncwarp()
                if lane == 0:
                    mbarrier_arrive(bars + STAGE_EMPTY + 8 * stage)  # the stage is read
                j += 1

            # Epilogue: one write of dK (times the softmax scale) and dV (or their parts).
            k_row = k_start + key_lo
            store(dk, dk_acc, 0, b, k_row, slot, 0, k_start + seqlen_k, softmax_scale,
                  softmax_scale)
            store(dv, dv_acc, 0, b, k_row, slot, 0, k_start + seqlen_k, float32(1.0),
                  float32(1.0))

    return flash_bwd_dk_dv_hopper
