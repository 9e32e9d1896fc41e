"""The Hopper backward's dQ kernel (sm_90a): wgmma products fed by a producer warpgroup through
an mbarrier pipeline, deterministic (no atomics), in Numba.

One block per (query tile of ROWS = 64·CONSUMERS queries, head, batch entry or sequence) of
1 + CONSUMERS warpgroups:
  - the producer (setmaxnreg.dec) copies the query tile's Q and dO once, then each key tile
    the queries see (device/block_range.py) K and V into stage j % STAGES (the 128-byte
    swizzle of layout.py), announcing each on the stage's full mbarrier: with the copy engine
    (config.copy_engine) one thread issues the copies, which complete on that barrier as
    transactions (tensor maps its warp publishes first, as the forward's); otherwise (maps
    the driver refuses) the warpgroup copies with cp.async;
  - each consumer (setmaxnreg.inc) owns 64 queries, their lse and D in registers: per key
    tile S = Q Kᵀ and dP = dO Vᵀ (products over the head dim, all tiles K-major), P and
    dS = P ∘ (dP − D) in registers (device/fragments.py, rows are queries), then dQ += dS K
    with dS packed to 16 bits as the product's A and K MN-major; then it frees the stage.
    The two consumers take turns (turns.py): each issues its dQ product of one tile and its
    S and dP of the next together while the other computes P and dS. dQ (times the softmax
    scale) leaves from registers.
GQA: the block of query head h reads key/value head h // group; varlen: grid.z runs over the
packed sequences (device/sequence.py); a mask_mod's tile table (device/mask_mod.py) narrows the
key range, and the tiles no query sees are neither copied nor computed.
"""
import functools

from numba import cuda, float32, uint16, uint32, uint64

from ..device.block_range import EMPTY, make_block_range
from ..device.constants import POS_INF, ZERO
from ..device.fragments import make_fragment_store, make_pack_chunk, make_tile_gradients
from ..device.intrinsics import (cp_async_commit, make_descriptor, make_fence_operands,
                                 map_slot, mbarrier_arrive, mbarrier_expect_tx, mbarrier_wait,
                                 opaque, setmaxnreg_dec, setmaxnreg_inc, shared_base,
                                 tensor_map_acquire, wgmma_commit, wgmma_fence, wgmma_wait)
from ..device.mask import tile_mask
from ..device.mask_mod import make_next_key_tile, make_tile_table
from ..device.score_mod import make_score_mod
from ..device.sequence import make_sequence
from ..device.softmax import lse_log2
from .config import WARPGROUP, tile_bytes
from .layout import ATOM_BYTES, K_MAJOR_LEADING, ROW_BYTES, make_tile_copy, make_tile_loader
from .products import (announce_all, announce_previous, barrier_words, empty_barrier,
                       free_parity, full_barrier, full_parity, make_barrier_init,
                       make_register_products, make_score_products)
from .tensor_maps import MAP_COUNT, SCRATCH_WORDS, make_map_writer, publish_maps
from .turns import give_turn, open_turns, take_turn


@functools.lru_cache(maxsize=None)
def hopper_dq_kernel_function(config, spec, queries_slowest=False):
    """The plain Python kernel for one HopperBackwardConfig and kernel spec
    (AttentionSpec.for_kernels(), head_dim 64 or 128); queries_slowest: the query tiles along
    grid.y, the heads along grid.x (hopper/grids.py)."""
    ROWS, BLOCK_N, D = config.rows, config.block_n, spec.head_dim
    CONSUMERS, STAGES = config.consumers, config.stages
    PRODUCER_REGISTERS, CONSUMER_REGISTERS = config.registers
    NB, DB, KC = BLOCK_N // 8, D // 8, BLOCK_N // 16
    ROW_TILE, KV_TILE = tile_bytes(ROWS, D), tile_bytes(BLOCK_N, D)
    DO_START, K_START = ROW_TILE, 2 * ROW_TILE  # Q, dO; then K stages, then V stages
    V_START = K_START + STAGES * KV_TILE
    # mbarriers: Q and dO's; the pipeline's full and empty ones (products.py)
    STAGE_FULL, STAGE_EMPTY = full_barrier(0, 0, STAGES), empty_barrier(0, 0, STAGES, 1)
    BARRIERS = barrier_words(1, STAGES)
    COPY_ENGINE = config.copy_engine
    init_barriers = make_barrier_init(1, STAGES, CONSUMERS, 1 if COPY_ENGINE else WARPGROUP)
    S_SHAPE, ACC_SHAPE, A_SHAPE = (1, NB, 4), (1, DB, 4), (KC, 4)

    load_queries = make_tile_loader(D, ROWS)
    load_keys = make_tile_loader(D, BLOCK_N)
    copy_queries, copy_keys = make_tile_copy(D, ROWS), make_tile_copy(D, BLOCK_N)
    score_products = make_score_products(BLOCK_N, spec.bf16, D, ROWS, BLOCK_N)
    grad_products = make_register_products(D, spec.bf16, KC, BLOCK_N)
    fence_scores, fence_acc = make_fence_operands(NB * 4), make_fence_operands(DB * 4)
    fence_a = make_fence_operands(KC * 4)
    row_gradients = make_tile_gradients(spec, NB)[0]
    pack_chunk = make_pack_chunk(spec.bf16)
    store = make_fragment_store(spec.bf16, DB)
    key_range, _, _, is_partial, query_tile_index = make_block_range(
        spec, ROWS, BLOCK_N, tiles_along_y=queries_slowest)
    narrow, mod_class = make_tile_table(spec, ROWS, BLOCK_N)
    next_key_tile = make_next_key_tile(spec, ROWS, BLOCK_N)
    score_mod = make_score_mod(spec)
    exponent_scales, head_slope = score_mod.scales, score_mod.head_slope
    sequence = make_sequence(spec)
    GROUP, VARLEN = spec.group, spec.varlen
    write_map = make_map_writer(VARLEN)
    # The consumers take turns (turns.py), but not with ALiBi and varlen together: their
    # registers beside the turn's held dS spilled at d128 (scripts/ptx_check.py --variants).
    TURNS = not (spec.alibi and spec.varlen)

    @cuda.jit(device=True, inline="always")
    def produce(smem_base, bars, q, k, v, dout, b, q_row0, q_end, k_start, k_end, h, h_kv,
                n_begin, n_tiles, tiles, seq, m0):
        """Q and dO, then each visited key tile's K and V, one commit group each, each
        announced once landed (products.py)."""
        load_queries(smem_base, q, b, q_row0, h, q_end)
        load_queries(smem_base + DO_START, dout, b, q_row0, h, q_end)
        cp_async_commit()
        landed = bars  # (Q and dO's barrier first)
        j = 0  # the visited tiles so far (the stages count them)
        for tile in range(n_tiles):
            n0 = n_begin + tile * BLOCK_N
            if mod_class(tiles, seq, h, m0, n0) == EMPTY:
                continue
            s = j % STAGES
            row0 = k_start + n0
            mbarrier_wait(bars + STAGE_EMPTY + 8 * s, free_parity(j, STAGES))
            load_keys(smem_base + K_START + s * KV_TILE, k, b, row0, h_kv, k_end)
            load_keys(smem_base + V_START + s * KV_TILE, v, b, row0, h_kv, k_end)
            cp_async_commit()
            announce_previous(landed)
            landed = bars + STAGE_FULL + 8 * s
            j += 1
        announce_all(landed)

    @cuda.jit(device=True, inline="always")
    def produce_by_copy_engine(smem_base, bars, maps, first_map, b, h, h_kv, n_begin,
                               n_tiles, tiles, seq, m0):
        """The producer thread with the copy engine (maps first_map + 0-3: q, dout, k, v, from
        the sequence's first rows: copies in the sequence's row coordinates): Q and dO, then
        each visited key tile's K and V, each pair announced (arrive.expect_tx) before its
        copies are issued."""
        q_slot, do_slot = map_slot(maps, first_map), map_slot(maps, first_map + 1)
        k_slot, v_slot = map_slot(maps, first_map + 2), map_slot(maps, first_map + 3)
        for i in range(4):
            tensor_map_acquire(map_slot(maps, first_map + i))
        mbarrier_expect_tx(bars, 2 * ROW_TILE)
        copy_queries(smem_base, q_slot, h, m0, b, bars)
        copy_queries(smem_base + DO_START, do_slot, h, m0, b, bars)
        j = 0  # the visited tiles so far (the stages count them)
        for tile in range(n_tiles):
            n0 = n_begin + tile * BLOCK_N
            if mod_class(tiles, seq, h, m0, n0) == EMPTY:
                continue
            s = j % STAGES
            full = bars + STAGE_FULL + 8 * s
            mbarrier_wait(bars + STAGE_EMPTY + 8 * s, free_parity(j, STAGES))
            mbarrier_expect_tx(full, 2 * KV_TILE)
            copy_keys(smem_base + K_START + s * KV_TILE, k_slot, h_kv, n0, b, full)
            copy_keys(smem_base + V_START + s * KV_TILE, v_slot, h_kv, n0, b, full)
            j += 1

    @cuda.jit(device=True, inline="always")
    def issue_scores(s, dp, q_rows, smem_base, bars, j):
        """Issue S = Q Kᵀ and dP = dO Vᵀ of visited tile j (64 queries x BLOCK_N keys) once
        its stage landed, and commit. (The Q and dO descriptors are made again each tile,
        from an address the compiler cannot look through: held across the loop, each k16
        step's took two registers.)"""
        stage = j % STAGES
        mbarrier_wait(bars + STAGE_FULL + 8 * stage, full_parity(j, STAGES))
        rows = opaque(q_rows)
        fence_scores(s)
        fence_scores(dp)
        wgmma_fence()
        score_products(s, make_descriptor(rows, K_MAJOR_LEADING, ATOM_BYTES), make_descriptor(
            smem_base + K_START + stage * KV_TILE, K_MAJOR_LEADING, ATOM_BYTES))
        score_products(dp, make_descriptor(rows + DO_START, K_MAJOR_LEADING, ATOM_BYTES),
                       make_descriptor(smem_base + V_START + stage * KV_TILE, K_MAJOR_LEADING,
                                       ATOM_BYTES))
        wgmma_commit()

    @cuda.jit(device=True, inline="always")
    def issue_dq(dq_acc, ds, smem_base, j):
        """Issue dQ += dS K of visited tile j (K MN-major), and commit."""
        fence_acc(dq_acc)
        fence_a(ds)
        wgmma_fence()
        grad_products(dq_acc, ds, smem_base + K_START + (j % STAGES) * KV_TILE)
        wgmma_commit()

    @cuda.jit(device=True, inline="always")
    def wait_products(s, dp, dq_acc):
        wgmma_wait(0)
        fence_scores(s)
        fence_scores(dp)
        fence_acc(dq_acc)

    @cuda.jit(device=True, inline="always")
    def free_stage(bars, tid, j):
        if tid % WARPGROUP == 0:
            mbarrier_arrive(bars + STAGE_EMPTY + 8 * (j % STAGES))  # the stage is read

    @cuda.jit(device=True, inline="always")
    def gradients_to_ds(s, dp, ds, row_lo, m0, n0, kind, seqlen_q, seqlen_k, stats,
                        tile_scale, pre, slope, mask_at):
        """P = exp2(S - lse) and dS = P (dP - D) of the tile at key n0 (kind: its mask_mod
        class; the mask on partial tiles); dS packed to 16 bits in ds, wgmma's A fragments.
        stats: the rows' (lse_lo, lse_hi, delta_lo, delta_hi)."""
        lse_lo, lse_hi, delta_lo, delta_hi = stats
        mask = tile_mask(is_partial(m0, n0, seqlen_q, seqlen_k), kind)
        row_gradients(s, dp, row_lo, n0, mask, lse_lo, lse_hi, delta_lo, delta_hi, tile_scale,
                      pre, slope, seqlen_k - seqlen_q, seqlen_k, mask_at)
        for kc in range(KC):
            ds[kc, 0], ds[kc, 1], ds[kc, 2], ds[kc, 3] = pack_chunk(dp, 0, kc)

    def flash_bwd_dq_hopper(q, k, v, dout, lse, delta, dq, scale_log2, softmax_scale, maps,
                            templates, alibi_slopes, cu_seqlens_q, cu_seqlens_k, attn_mask,
                            tile_classes, tile_spans, mod_arrays):
        tid = cuda.threadIdx.x
        warpgroup = tid // WARPGROUP
        m0 = query_tile_index() * ROWS
        h = cuda.blockIdx.x if queries_slowest else cuda.blockIdx.y
        h_kv = h // GROUP  # the key/value head of this query head (GQA)
        seq = cuda.blockIdx.z
        b, q_start, seqlen_q, k_start, seqlen_k = sequence(seq, q, k, cu_seqlens_q, cu_seqlens_k)
        if VARLEN and m0 >= seqlen_q:
            return  # (the grid is sized for the longest sequence; the whole block leaves)
        tiles = (tile_classes, tile_spans)  # (device/mask_mod.py)
        n_begin, n_end = key_range(m0, seqlen_q, seqlen_k)
        n_begin, n_end = narrow(tiles, seq, h, m0 // ROWS, n_begin, n_end, BLOCK_N)
        n_tiles = max(0, n_end - n_begin + BLOCK_N - 1) // BLOCK_N

        smem = cuda.shared.array(0, uint16)  # dynamic: Q, dO, K and V tiles
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
                produce(smem_base, bars, q, k, v, dout, b, q_start + m0, q_start + seqlen_q,
                        k_start, k_start + seqlen_k, h, h_kv, n_begin, n_tiles, tiles, seq, m0)
            elif tid < 32:
                scratch = shared_base(map_words, 128)
                first_map = seq * MAP_COUNT if VARLEN else 0
                if tid == 0:
                    write_map(scratch, 0, q, templates[0], q_start, seqlen_q)
                    write_map(scratch, 1, dout, templates[1], q_start, seqlen_q)
                    write_map(scratch, 2, k, templates[2], k_start, seqlen_k)
                    write_map(scratch, 3, v, templates[3], k_start, seqlen_k)
                publish_maps(scratch, maps, first_map, 4)
                if tid == 0:
                    produce_by_copy_engine(smem_base, bars, maps, first_map, b, h, h_kv,
                                           n_begin, n_tiles, tiles, seq, m0)
        else:
            setmaxnreg_inc(CONSUMER_REGISTERS)
            consumer = warpgroup - 1
            lane = tid % 32
            # This thread's queries: row_lo and row_lo + 8 (the rows of S).
            row_lo = m0 + 64 * consumer + 16 * ((tid % WARPGROUP) // 32) + lane // 4
            row_hi = row_lo + 8
            lse_lo = lse_log2(lse[b, h, q_start + row_lo]) if row_lo < seqlen_q else POS_INF
            lse_hi = lse_log2(lse[b, h, q_start + row_hi]) if row_hi < seqlen_q else POS_INF
            delta_lo = delta[b, h, q_start + row_lo] if row_lo < seqlen_q else ZERO
            delta_hi = delta[b, h, q_start + row_hi] if row_hi < seqlen_q else ZERO
            tile_scale, pre = exponent_scales(scale_log2)  # (device/score_mod.py)
            slope = head_slope(alibi_slopes, seq, h)
            mask_at = (attn_mask, seq, h, mod_arrays)  # (device/attn_mask.py)

            s = cuda.local.array(S_SHAPE, float32)  # S, then P
            dp = cuda.local.array(S_SHAPE, float32)  # dP, then dS
            dq_acc = cuda.local.array(ACC_SHAPE, float32)
            ds = cuda.local.array(A_SHAPE, uint32)
            for db in range(DB):
                for r in range(4):
                    dq_acc[0, db, r] = ZERO
            q_rows = smem_base + 64 * consumer * ROW_BYTES  # (this consumer's Q rows)
            mbarrier_wait(bars, 0)  # Q and dO have landed
            stats = (lse_lo, lse_hi, delta_lo, delta_hi)
            if TURNS:
                # Turn j issues dQ += dS K of visited tile j - 1 and S, dP of visited tile j
                # (turns.py), then computes tile j's P and dS; a last turn issues the last dQ
                # product. Each stage is freed after its dQ product (K's last reader).
                open_turns(consumer, CONSUMERS)
                tile = next_key_tile(tiles, seq, h, m0, n_begin, 0, n_tiles)
                j = 0  # the visited tiles so far (as the producer counts them)
                if tile < n_tiles:
                    take_turn(consumer)
                    issue_scores(s, dp, q_rows, smem_base, bars, 0)
                    give_turn(consumer, CONSUMERS, False)
                    wait_products(s, dp, dq_acc)
                    while True:
                        n0 = n_begin + tile * BLOCK_N
                        gradients_to_ds(s, dp, ds, row_lo, m0, n0, mod_class(
                            tiles, seq, h, m0, n0), seqlen_q, seqlen_k, stats, tile_scale,
                            pre, slope, mask_at)
                        tile = next_key_tile(tiles, seq, h, m0, n_begin, tile + 1, n_tiles)
                        if tile >= n_tiles:
                            break
                        take_turn(consumer)
                        issue_dq(dq_acc, ds, smem_base, j)
                        issue_scores(s, dp, q_rows, smem_base, bars, j + 1)
                        give_turn(consumer, CONSUMERS, False)
                        wait_products(s, dp, dq_acc)
                        free_stage(bars, tid, j)
                        j += 1
                    take_turn(consumer)
                    issue_dq(dq_acc, ds, smem_base, j)
                    give_turn(consumer, CONSUMERS, True)
                    wait_products(s, dp, dq_acc)
                    free_stage(bars, tid, j)
                else:  # (an empty turn: both consumers take as many)
                    take_turn(consumer)
                    give_turn(consumer, CONSUMERS, True)
            else:  # one tile after the other: S and dP, P and dS, dQ
                j = 0
                for tile in range(n_tiles):
                    n0 = n_begin + tile * BLOCK_N
                    kind = mod_class(tiles, seq, h, m0, n0)
                    if kind == EMPTY:  # (no query sees a key of it: mask_mod only)
                        continue
                    issue_scores(s, dp, q_rows, smem_base, bars, j)
                    wgmma_wait(0)
                    fence_scores(s)
                    fence_scores(dp)
                    gradients_to_ds(s, dp, ds, row_lo, m0, n0, kind, seqlen_q, seqlen_k, stats,
                                    tile_scale, pre, slope, mask_at)
                    issue_dq(dq_acc, ds, smem_base, j)
                    wgmma_wait(0)
                    fence_acc(dq_acc)
                    free_stage(bars, tid, j)
                    j += 1

            # Epilogue: one write of dQ (times the softmax scale).
            store(dq, dq_acc, 0, b, q_start + row_lo, h, 0, q_start + seqlen_q, softmax_scale,
                  softmax_scale)

    return flash_bwd_dq_hopper
