"""FlashAttention forward on Hopper (sm_90a): wgmma products, an mbarrier pipeline fed by a
producer warpgroup, register reallocation between the roles, in Numba.

Run by the Hopper engine (engine.py) for float16/bfloat16 on compute capability 9.0.

One block per (query tile of BLOCK_M = 64·CONSUMERS rows, head, batch entry or sequence) of
1 + CONSUMERS warpgroups (FlashAttention-3's warp specialisation):
  - warpgroup 0, the producer, gives registers back (setmaxnreg.dec) and brings tiles into
    shared memory in the 128-byte swizzle wgmma reads (layout.py): the Q tile once, then for
    each key tile its K and V tiles into stage j % STAGES, each after the consumers freed that
    stage (the stage's `empty` mbarrier), each announced on its `full` mbarrier once landed.
    With the copy engine (config.copy_engine) one thread issues each tile's copies
    (device/intrinsics/tensor_copy.py: tensor maps its warp makes first), which complete on
    the `full` mbarrier as transactions of bytes it announced; otherwise the warpgroup's 128
    threads copy 16 bytes at a time with cp.async, each waiting for its own copies, fencing
    them for the async proxy and arriving (arrays whose maps the driver refuses). With
    varlen each sequence's maps end at its last row (tensor_maps.py), so that no box reads
    the next sequence's.
  - warpgroups 1.. are consumers of 64 query rows each; they take the registers
    (setmaxnreg.inc). Per key tile: S = Q Kᵀ by D/16 wgmma products from the shared tiles (Q
    and K K-major), the K stage freed; the score mod, mask and online softmax on S in
    registers (device/fragments.py: the accumulator layout is mma.sync's, 16 rows a warp);
    P packed to 16 bits in registers as wgmma's A fragments; O += P V by BLOCK_N/16 products
    with A from registers and V MN-major; the V stage freed. The consumers take turns
    (turns.py): each issues its P V of one tile and its S of the next together while the
    others run their softmax. O and lse leave from registers.
  - Tiles wholly masked are not visited (device/block_range.py), the mask runs on partial
    tiles only; a mask_mod's tile table (device/mask_mod.py) narrows the key range, and the
    tiles inside it that no row sees are neither copied nor computed (the producer and the
    consumers skip the same ones, so the pipeline's stages count visited tiles). Under causal
    alone (no window, mask_mod or attn_mask; not varlen) the copy engine's query tiles are
    laid from the end of Q: the one that overhangs is the first, whose rows below 0 arrive
    as zeros and are not stored. Under causal a grid of few waves has its query tiles along
    grid.y and heads along grid.x, so that the longest blocks of every head start first
    (grids.py). GQA: the block of query head h reads key/value head h // group; varlen:
    grid.z runs over the packed sequences (device/sequence.py).
Inputs and outputs are 16-bit patterns (uint16 views of float16 or bfloat16 data); lse is
float32.
"""
import dataclasses
import functools

import numpy as np
from numba import cuda, float32, uint16, uint32, uint64

from ..device.block_range import EMPTY, make_block_range, make_query_tile_start
from ..device.constants import LOG2E, NEG_INF, ZERO
from ..device.fragments import make_fragment_store, make_pack_chunk, make_tile_softmax
from ..device.intrinsics import (SIMULATED, cp_async_commit, make_descriptor,
                                 make_fence_operands, map_slot, mbarrier_arrive,
                                 mbarrier_expect_tx, mbarrier_wait, setmaxnreg_dec,
                                 setmaxnreg_inc, shared_base, shfl_xor, tensor_map_acquire,
                                 wgmma_commit, wgmma_fence, wgmma_wait)
from ..device.mask import tile_mask
from ..device.mask_mod import make_next_key_tile, make_tile_table
from ..device.score_mod import make_score_mod
from ..device.sequence import grid_extent, make_sequence
from ..device.softmax import finalize
from ..launch import kernel_extras_unused, launch
from ..tile_classes import tile_arguments
from .config import (WARPGROUP, hopper_forward_config, hopper_forward_shared_bytes,
                     tile_bytes)
from .grids import grid_shape, tiles_slowest
from .layout import ATOM_BYTES, K_MAJOR_LEADING, ROW_BYTES, make_tile_copy, make_tile_loader
from .products import (announce_all, announce_previous, barrier_words, empty_barrier,
                       free_parity, full_barrier, full_parity, make_barrier_init,
                       make_register_products, make_score_products)
from .tensor_maps import (MAP_COUNT, SCRATCH_WORDS, check_map_slots, make_map_writer, map_slots,
                          map_templates, no_templates, publish_maps)
from .turns import give_turn, open_turns, take_turn


@functools.lru_cache(maxsize=None)
def hopper_forward_kernel_function(config, spec, queries_slowest=False):
    """The plain Python kernel for one HopperConfig and kernel spec (AttentionSpec.for_kernels(),
    head_dim a multiple of 16); queries_slowest: the query tiles along grid.y (grids.py)."""
    if spec.head_dim % 16 or config.block_n % 16:
        raise ValueError("head_dim and block_n must be multiples of 16")
    BLOCK_M, BLOCK_N, D = config.block_m, config.block_n, spec.head_dim
    CONSUMERS, STAGES = config.consumers, config.stages
    PRODUCER_REGISTERS, CONSUMER_REGISTERS = config.registers
    NB, DB, KC = BLOCK_N // 8, D // 8, BLOCK_N // 16
    Q_BYTES, KV_BYTES = tile_bytes(BLOCK_M, D), tile_bytes(BLOCK_N, D)
    K_START = Q_BYTES  # K stages, then V stages, after the Q tile
    V_START = K_START + STAGES * KV_BYTES
    # mbarriers: Q's; the K and V pipelines' full and empty ones (products.py)
    K_FULL, V_FULL = full_barrier(0, 0, STAGES), full_barrier(1, 0, STAGES)
    K_EMPTY, V_EMPTY = empty_barrier(0, 0, STAGES, 2), empty_barrier(1, 0, STAGES, 2)
    BARRIERS = barrier_words(2, STAGES)
    COPY_ENGINE = config.copy_engine
    init_barriers = make_barrier_init(2, STAGES, CONSUMERS, 1 if COPY_ENGINE else WARPGROUP)
    S_SHAPE, ACC_SHAPE, P_SHAPE = (1, NB, 4), (1, DB, 4), (KC, 4)

    load_q = make_tile_loader(D, BLOCK_M)
    load_kv = make_tile_loader(D, BLOCK_N)
    copy_q, copy_kv = make_tile_copy(D, BLOCK_M), make_tile_copy(D, BLOCK_N)
    score_products = make_score_products(BLOCK_N, spec.bf16, D, BLOCK_M, BLOCK_N)
    pv_products = make_register_products(D, spec.bf16, KC, BLOCK_N)
    fence_scores, fence_out = make_fence_operands(NB * 4), make_fence_operands(DB * 4)
    fence_p = make_fence_operands(KC * 4)
    softmax_step = make_tile_softmax(spec, NB, DB)
    pack_chunk = make_pack_chunk(spec.bf16)
    store = make_fragment_store(spec.bf16, DB)
    key_range, _, _, is_partial, _ = make_block_range(spec, BLOCK_M, BLOCK_N)
    # The copy engine reads rows below 0 as zeros: under causal its tiles are laid from the
    # end of Q (a mask_mod's tile tables and an attn_mask are indexed from row 0).
    query_tile_start = make_query_tile_start(spec, BLOCK_M, COPY_ENGINE and not spec.varlen
                                             and spec.mask_mod is None
                                             and spec.attn_mask is None, queries_slowest)
    narrow, mod_class = make_tile_table(spec, BLOCK_M, BLOCK_N)
    next_key_tile = make_next_key_tile(spec, BLOCK_M, BLOCK_N)
    score_mod = make_score_mod(spec)
    exponent_scales, head_slope = score_mod.scales, score_mod.head_slope
    sequence = make_sequence(spec)
    GROUP, VARLEN = spec.group, spec.varlen
    write_map = make_map_writer(VARLEN)
    TURNS = config.turns

    @cuda.jit(device=True, inline="always")
    def produce(smem_base, bars, q, k, v, b, q_row0, q_end, k_start, k_end, h, h_kv, n_begin,
                n_tiles, tiles, seq, m0):
        """The producer warpgroup: Q, then each visited key tile's K and V, one commit group
        each. After issuing a group it waits for the one before (cp.async completes in
        order), fences it for the async proxy and announces it: two groups in flight per
        thread."""
        load_q(smem_base, q, b, q_row0, h, q_end)
        cp_async_commit()
        landed = bars  # the barrier of the group before the newest: Q's first
        j = 0  # the visited tiles so far (the stages count them)
        for tile in range(n_tiles):
            n0 = n_begin + tile * BLOCK_N
            if mod_class(tiles, seq, h, m0, n0) == EMPTY:
                continue
            s = j % STAGES
            row0 = k_start + n0
            mbarrier_wait(bars + K_EMPTY + 8 * s, free_parity(j, STAGES))
            load_kv(smem_base + K_START + s * KV_BYTES, k, b, row0, h_kv, k_end)
            cp_async_commit()
            announce_previous(landed)
            mbarrier_wait(bars + V_EMPTY + 8 * s, free_parity(j, STAGES))
            load_kv(smem_base + V_START + s * KV_BYTES, v, b, row0, h_kv, k_end)
            cp_async_commit()
            announce_previous(bars + K_FULL + 8 * s)
            landed = bars + V_FULL + 8 * s
            j += 1
        announce_all(landed)

    @cuda.jit(device=True, inline="always")
    def produce_by_copy_engine(smem_base, bars, maps, first_map, b, h, h_kv, n_begin,
                               n_tiles, tiles, seq, m0):
        """The producer thread with the copy engine: Q, then each visited key tile's K and V,
        each announced (arrive.expect_tx) before its copies are issued (the maps start at the
        sequence's first rows: rows in the sequence's coordinates)."""
        q_slot = map_slot(maps, first_map)
        k_slot, v_slot = map_slot(maps, first_map + 1), map_slot(maps, first_map + 2)
        tensor_map_acquire(q_slot)
        tensor_map_acquire(k_slot)
        tensor_map_acquire(v_slot)
        mbarrier_expect_tx(bars, Q_BYTES)
        copy_q(smem_base, q_slot, h, m0, b, bars)
        j = 0  # the visited tiles so far (the stages count them)
        for tile in range(n_tiles):
            n0 = n_begin + tile * BLOCK_N
            if mod_class(tiles, seq, h, m0, n0) == EMPTY:
                continue
            s = j % STAGES
            mbarrier_wait(bars + K_EMPTY + 8 * s, free_parity(j, STAGES))
            mbarrier_expect_tx(bars + K_FULL + 8 * s, KV_BYTES)
            copy_kv(smem_base + K_START + s * KV_BYTES, k_slot, h_kv, n0, b,
                    bars + K_FULL + 8 * s)
            mbarrier_wait(bars + V_EMPTY + 8 * s, free_parity(j, STAGES))
            mbarrier_expect_tx(bars + V_FULL + 8 * s, KV_BYTES)
            copy_kv(smem_base + V_START + s * KV_BYTES, v_slot, h_kv, n0, b,
                    bars + V_FULL + 8 * s)
            j += 1

    @cuda.jit(device=True, inline="always")
    def issue_scores(s, q_desc, smem_base, bars, j):
        """Issue S = Q Kᵀ of visited tile j (64 x BLOCK_N per consumer) once its K landed,
        and commit."""
        stage = j % STAGES
        mbarrier_wait(bars + K_FULL + 8 * stage, full_parity(j, STAGES))
        fence_scores(s)
        wgmma_fence()
        score_products(s, q_desc, make_descriptor(smem_base + K_START + stage * KV_BYTES,
                                                  K_MAJOR_LEADING, ATOM_BYTES))
        wgmma_commit()

    @cuda.jit(device=True, inline="always")
    def wait_scores(s, bars, tid, j):
        """Wait for every product issued; free tile j's K stage."""
        wgmma_wait(0)
        fence_scores(s)
        if tid % WARPGROUP == 0:
            mbarrier_arrive(bars + K_EMPTY + 8 * (j % STAGES))

    @cuda.jit(device=True, inline="always")
    def issue_values(acc, p, smem_base, bars, j):
        """Issue O += P V of visited tile j (P from registers, V MN-major) once its V landed,
        and commit."""
        stage = j % STAGES
        mbarrier_wait(bars + V_FULL + 8 * stage, full_parity(j, STAGES))
        fence_out(acc)
        fence_p(p)
        wgmma_fence()
        pv_products(acc, p, smem_base + V_START + stage * KV_BYTES)
        wgmma_commit()

    @cuda.jit(device=True, inline="always")
    def wait_values(acc, bars, tid, j):
        """Wait for every product issued; free tile j's V stage."""
        wgmma_wait(0)
        fence_out(acc)
        if tid % WARPGROUP == 0:
            mbarrier_arrive(bars + V_EMPTY + 8 * (j % STAGES))

    @cuda.jit(device=True, inline="always")
    def softmax_to_p(s, acc, p, m_i, l_i, row_lo, m0, n0, kind, seqlen_q, seqlen_k, tile_scale,
                     pre, slope, mask_at):
        """Mask, score mod and online softmax of the tile at key n0 (kind: its mask_mod
        class); O rescaled; P packed to 16 bits in p, wgmma's A fragments."""
        mask = tile_mask(is_partial(m0, n0, seqlen_q, seqlen_k), kind)
        softmax_step(s, acc, 0, m_i, l_i, row_lo, n0, mask, tile_scale, pre, slope,
                     seqlen_k - seqlen_q, seqlen_k, mask_at)
        for kc in range(KC):
            p[kc, 0], p[kc, 1], p[kc, 2], p[kc, 3] = pack_chunk(s, 0, kc)

    def flash_forward_hopper(q, k, v, out, lse, scale_log2, maps, templates, alibi_slopes,
                             cu_seqlens_q, cu_seqlens_k, attn_mask, tile_classes, tile_spans,
                             mod_arrays):
        tid = cuda.threadIdx.x
        warpgroup = tid // WARPGROUP
        h = cuda.blockIdx.x if queries_slowest else cuda.blockIdx.y
        h_kv = h // GROUP  # the key/value head of this query head (GQA)
        seq = cuda.blockIdx.z
        b, q_start, seqlen_q, k_start, seqlen_k = sequence(seq, q, k, cu_seqlens_q, cu_seqlens_k)
        m0 = query_tile_start(seqlen_q)
        if VARLEN and m0 >= seqlen_q:
            return  # (the grid is sized for the longest sequence; the whole block leaves)
        tiles = (tile_classes, tile_spans)  # (device/mask_mod.py)
        n_begin, n_end = key_range(m0, seqlen_q, seqlen_k)
        n_begin, n_end = narrow(tiles, seq, h, m0 // BLOCK_M, n_begin, n_end, BLOCK_N)
        n_tiles = max(0, n_end - n_begin + BLOCK_N - 1) // BLOCK_N

        smem = cuda.shared.array(0, uint16)  # dynamic: Q, K and V tiles
        barrier_words = cuda.shared.array(BARRIERS, uint64)
        map_words = cuda.shared.array(SCRATCH_WORDS, uint64)
        smem_base = shared_base(smem, ATOM_BYTES)  # tiles start on the swizzle's atoms
        bars = shared_base(barrier_words, 8)
        if tid == 0:
            init_barriers(bars)
        cuda.syncthreads()  # why: the barriers are initialised before anyone uses them

        if warpgroup == 0:
            setmaxnreg_dec(PRODUCER_REGISTERS)
            if not COPY_ENGINE:
                produce(smem_base, bars, q, k, v, b, q_start + m0, q_start + seqlen_q, k_start,
                        k_start + seqlen_k, h, h_kv, n_begin, n_tiles, tiles, seq, m0)
            elif tid < 32:
                scratch = shared_base(map_words, 128)
                first_map = seq * MAP_COUNT if VARLEN else 0
                if tid == 0:
                    write_map(scratch, 0, q, templates[0], q_start, seqlen_q)
                    write_map(scratch, 1, k, templates[1], k_start, seqlen_k)
                    write_map(scratch, 2, v, templates[2], k_start, seqlen_k)
                publish_maps(scratch, maps, first_map, 3)
                if tid == 0:
                    produce_by_copy_engine(smem_base, bars, maps, first_map, b, h, h_kv,
                                           n_begin, n_tiles, tiles, seq, m0)
        else:
            setmaxnreg_inc(CONSUMER_REGISTERS)
            consumer = warpgroup - 1
            lane = tid % 32
            # This thread's rows: row_lo and row_lo + 8 (the accumulators' r < 2 and r >= 2).
            row_lo = m0 + 64 * consumer + 16 * ((tid % WARPGROUP) // 32) + lane // 4
            tile_scale, pre = exponent_scales(scale_log2)  # (device/score_mod.py)
            slope = head_slope(alibi_slopes, seq, h)
            mask_at = (attn_mask, seq, h, mod_arrays)  # (device/attn_mask.py)

            s = cuda.local.array(S_SHAPE, float32)
            acc = cuda.local.array(ACC_SHAPE, float32)
            p = cuda.local.array(P_SHAPE, uint32)
            m_i = cuda.local.array((1, 2), float32)  # running row max (log2 units)
            l_i = cuda.local.array((1, 2), float32)  # this lane's share of the row sum
            for db in range(DB):
                for r in range(4):
                    acc[0, db, r] = ZERO
            for half in range(2):
                m_i[0, half] = NEG_INF
                l_i[0, half] = ZERO
            q_desc = make_descriptor(smem_base + 64 * consumer * ROW_BYTES, K_MAJOR_LEADING,
                                     ATOM_BYTES)
            mbarrier_wait(bars, 0)  # the Q tile has landed
            if TURNS:
                # Turn j issues O += P V of visited tile j - 1 and S = Q Kᵀ of visited tile
                # j (turns.py: the other consumer runs its softmax meanwhile), then runs the
                # softmax of tile j; a last turn issues the last P V. (No product sits in a
                # branch of its own: ptxas would serialise every wgmma, warning C7519.)
                open_turns(consumer, CONSUMERS)
                tile = next_key_tile(tiles, seq, h, m0, n_begin, 0, n_tiles)
                j = 0  # the visited tiles so far (as the producer counts them)
                if tile < n_tiles:
                    take_turn(consumer)
                    issue_scores(s, q_desc, smem_base, bars, 0)
                    give_turn(consumer, CONSUMERS, False)
                    wait_scores(s, bars, tid, 0)
                    while True:
                        n0 = n_begin + tile * BLOCK_N
                        softmax_to_p(s, acc, p, m_i, l_i, row_lo, m0, n0, mod_class(
                            tiles, seq, h, m0, n0), seqlen_q, seqlen_k, tile_scale, pre,
                            slope, mask_at)
                        tile = next_key_tile(tiles, seq, h, m0, n_begin, tile + 1,
                                             n_tiles)
                        if tile >= n_tiles:
                            break
                        take_turn(consumer)
                        issue_values(acc, p, smem_base, bars, j)
                        issue_scores(s, q_desc, smem_base, bars, j + 1)
                        give_turn(consumer, CONSUMERS, False)
                        wait_values(acc, bars, tid, j)
                        wait_scores(s, bars, tid, j + 1)
                        j += 1
                    take_turn(consumer)
                    issue_values(acc, p, smem_base, bars, j)
                    give_turn(consumer, CONSUMERS, True)
                    wait_values(acc, bars, tid, j)
                else:  # (an empty turn: both consumers take as many)
                    take_turn(consumer)
                    give_turn(consumer, CONSUMERS, True)
            else:  # one tile after the other: S, its softmax, P V
                j = 0
                for tile in range(n_tiles):
                    n0 = n_begin + tile * BLOCK_N
                    kind = mod_class(tiles, seq, h, m0, n0)
                    if kind == EMPTY:  # (no row sees a key of it: mask_mod only)
                        continue
                    issue_scores(s, q_desc, smem_base, bars, j)
                    wait_scores(s, bars, tid, j)
                    softmax_to_p(s, acc, p, m_i, l_i, row_lo, m0, n0, kind, seqlen_q,
                                 seqlen_k, tile_scale, pre, slope, mask_at)
                    issue_values(acc, p, smem_base, bars, j)
                    wait_values(acc, bars, tid, j)
                    j += 1

            # Epilogue: row sums over the 4 lanes; out = acc / l; lse = m + log(l).
            inv_l = cuda.local.array(2, float32)
            for half in range(2):
                l_row = l_i[0, half]
                for mask in (1, 2):
                    l_row += shfl_xor(l_row, mask)
                inv_l[half], lse_row = finalize(l_row, m_i[0, half])
                if lane % 4 == 0 and 0 <= row_lo + 8 * half < seqlen_q:
                    lse[b, h, q_start + row_lo + 8 * half] = lse_row
            store(out, acc, 0, b, q_start + row_lo, h, 0, q_start + seqlen_q, inv_l[0],
                  inv_l[1])

    return flash_forward_hopper


@functools.lru_cache(maxsize=None)
def hopper_forward_kernel(config, spec, queries_slowest=False):
    function = hopper_forward_kernel_function(config, spec, queries_slowest)
    if SIMULATED:  # (the simulator takes no launch bounds)
        return cuda.jit(function)
    # launch_bounds=(threads, 1): the register cap at entry that setmaxnreg needs; no disk
    # cache with a mask_mod (its key would not see mask_mod's code)
    return cuda.jit(function, cache=spec.mask_mod is None, launch_bounds=(config.threads, 1))


def launch_hopper_forward(spec, q, k, v, out, lse, stream=0, config=None, extras=None,
                          tiles=None, maps=None, multiprocessors=0):
    """q, k, v, out: uint16 views (batch, seqlen, nheads, headdim) of f16/bf16 data, last dim
    contiguous and rows 16-byte aligned, headdim the padded head dim the spec's kernels run
    at; lse: float32 (batch, nheads, seqlen_q). `extras`: the kernels' (alibi_slopes,
    cu_seqlens_q, cu_seqlens_k, attn_mask) (marshal.kernel_extras); `tiles`: a mask_mod's
    tile tables (tile_classes.py); `maps`: a scratch int64 array of this call, of shape
    tensor_maps.map_slot_shape(sequences), for the copy engine's tensor maps, never shared
    with a launch that may run at the same time (made here if not given: a NumPy array for
    host inputs, else a Numba device array). `multiprocessors`: the GPU's, for the grid's
    layout (grids.py; 0: the plain layout). `config` overrides hopper_forward_config (the
    engine's choice: key_tiles.py; tests, tuning)."""
    _, kernel, grid, threads, shared_bytes, args = hopper_forward_launch(
        spec, q, k, v, out, lse, config, extras, tiles, maps, multiprocessors)
    launch(kernel, grid, threads, stream, shared_bytes, *args)


def hopper_forward_launch(spec, q, k, v, out, lse, config=None, extras=None, tiles=None,
                          maps=None, multiprocessors=0):
    """What launch_hopper_forward launches: (config, kernel, grid, threads, dynamic shared
    bytes, arguments), config as the launch takes it (cp.async where the maps are refused)."""
    _, _, nheads, head_dim = q.shape
    extras = extras or kernel_extras_unused(lse)
    seqlen_q, batch = grid_extent(spec, q, extras[1], 0)
    chosen = config is None
    config = config or hopper_forward_config(head_dim, spec)
    if config is None:
        raise ValueError(f"no Hopper forward config for head_dim {head_dim}")
    templates = config.copy_engine and map_templates(
        ((q, config.block_m), (k, config.block_n), (v, config.block_n)))
    if not templates:  # (cp.async: the config's choice, or strides the copy engine refuses)
        config = (hopper_forward_config(head_dim, spec, copy_engine=False) if chosen else
                  dataclasses.replace(config, copy_engine=False))
        templates = no_templates(3)
    sequences = batch if spec.varlen else 1  # (varlen: maps per sequence, tensor_maps.py)
    if maps is None:
        maps = map_slots(lse, sequences)
    check_map_slots(maps, sequences)
    query_tiles = -(-seqlen_q // config.block_m)
    queries_slowest = tiles_slowest(spec, query_tiles * nheads * batch, multiprocessors)
    kernel = hopper_forward_kernel(config, spec.for_kernels(head_dim=head_dim), queries_slowest)
    grid = grid_shape(query_tiles, nheads, batch, queries_slowest)
    return (config, kernel, grid, config.threads, hopper_forward_shared_bytes(config, head_dim),
            (q, k, v, out, lse, np.float32(spec.softmax_scale * float(LOG2E)), maps, templates,
             *extras, *tile_arguments(tiles, lse, config.block_m, config.block_n)))
