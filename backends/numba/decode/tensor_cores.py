"""Split-KV decoding on tensor cores (mma.sync m16n8k16), float16 and bfloat16, sm_80 and newer.

Decoding reads a long K/V cache for a few query rows, so what bounds it is how many bytes are
in flight, not arithmetic. The SIMT decode kernel (kernels.py) spends a few thousand float32
instructions per lane on each key tile, which on few resident warps leaves the memory idle;
here the arithmetic is a few dozen mma instructions and the warps keep deep copy pipelines.

`decode_kernel`: one block of WARPS warps per (key split, tile of ROWS = 16 rows, key/value
head, sequence), rows as in blocks.py (a GQA group's query heads and a few query tokens share
one 16-row mma slice: every K/V byte read feeds all of them). The block's split of the keys
is cut into tiles of WARP_KEYS = 16 keys; warp w takes tiles w, w + WARPS, .. and keeps its
own pipeline of `stages` tiles in shared memory (cp.async, one commit group a tile, a warp
barrier before a stage is read or overwritten; no block barrier in the key loop). A tile of
16 keys never crosses a page of a paged cache (block sizes are multiples of 16), so a tile
looks the block table up once. Per tile: S = Q Kᵀ (16 x 16, Q's A fragments kept in
registers up to head dim 128), the score mod and the mask of each row's own token and head,
the online softmax on the fragments (device/fragments.py), O += P V with P from registers.
At the end the warps' partial results meet in shared memory (over the drained stages) and
are merged into the split's float32 output and lse (blocks.py); combine.py merges the splits.
"""
import functools
from dataclasses import replace

from numba import cuda, float32, int32, uint16, uint32

from ..device.constants import NEG_INF, ZERO
from ..device.fragments import make_tile_softmax
from ..device.intrinsics import (SHARED_ALIGN, cp_async_16, cp_async_commit, cp_async_wait,
                                 ldmatrix_x4, opaque, shared_tile, shfl_xor, syncwarp)
from ..device.mask import make_mask
from ..device.score_mod import make_score_mod
from ..mma.config import ROW_PAD
from ..mma.fragments import b_address, make_q_scores, make_warp_accumulate, x4_address
from .blocks import make_block_work, make_partials_merge

WARPS = 4
THREADS = 32 * WARPS
ROWS = 16  # rows of a block: one mma slice
WARP_KEYS = 16  # keys of a warp's tile
MAX_STAGES = 4
#: head dims the kernel serves (multiples of 16: mma's k-steps)
MAX_HEAD_DIM = 256
#: Q's A fragments stay in registers up to this head dim (above, re-read from shared memory)
Q_IN_REGISTERS_MAX = 128


def row_halves(head_dim):
    return head_dim + ROW_PAD


def merge_columns(head_dim):
    """Floats per row of the warps' partial outputs in shared memory: head_dim and 4 more, so
    that the 8 rows a warp's lanes store at once (g = lane // 4) fall on distinct banks."""
    return head_dim + 4


def shared_bytes(head_dim, stages):
    """Dynamic shared memory: the Q rows, then each warp's `stages` K tiles and V tiles (16-bit,
    rows padded by ROW_PAD halves); the warps' partial results for the merge (float32 max and
    sum per warp and row, an output row per warp and row) reuse the tiles' bytes."""
    row_bytes = 2 * row_halves(head_dim)
    tiles = 2 * WARPS * stages * WARP_KEYS * row_bytes
    merge = 4 * WARPS * ROWS * (2 + merge_columns(head_dim))
    return ROWS * row_bytes + max(tiles, merge)


@functools.lru_cache(maxsize=None)
def choose_stages(head_dim, limit):
    """The deepest pipeline (at most MAX_STAGES tiles a warp) whose shared memory fits `limit`
    bytes and, where a smaller one allows it, leaves a multiprocessor room for two blocks
    (~228 KiB on sm_90: four stages at d64, three at d128); None if not even two fit."""
    fitting = [s for s in range(MAX_STAGES, 1, -1) if shared_bytes(head_dim, s) <= limit]
    if not fitting:
        return None
    two_blocks = [s for s in fitting if 2 * (shared_bytes(head_dim, s) + 1024) <= limit + 1024]
    return (two_blocks or fitting)[0]


@functools.lru_cache(maxsize=None)
def decode_kernel(spec, paged, stages):
    """The tensor-core decode kernel for a kernel spec (AttentionSpec.for_kernels(), float16 or
    bfloat16, head_dim a multiple of 16 up to MAX_HEAD_DIM), cache layout and pipeline depth.
    q and the caches come as 16-bit patterns, rows contiguous and 16-byte aligned (cp.async)."""
    D, GROUP = spec.head_dim, spec.group
    if D % 16 or D > MAX_HEAD_DIM:
        raise ValueError(f"the tensor-core decode kernel takes head dims that are multiples of "
                         f"16 up to {MAX_HEAD_DIM}; got {D}")
    ROW = row_halves(D)
    CHUNKS = D // 8  # 16-byte copies per row
    TILE_BYTES = 2 * WARP_KEYS * ROW
    WARP_TILES = stages * WARP_KEYS  # tile rows of one warp's stages
    TILE_ROWS = WARPS * WARP_TILES  # (every warp's)
    IN_FLIGHT = stages - 1  # commit groups a warp leaves in flight while it reads a tile
    MERGE_ROWS = WARPS * ROWS
    VALUES_SHAPE = (1, -(-D // 32))  # (a merged row's values: lane + 32·c)
    MERGE_COLS = merge_columns(D)
    K_START = 2 * ROWS * ROW
    V_START = K_START + WARPS * stages * TILE_BYTES
    MERGE_M = K_START  # (after the loop: the stages' bytes)
    MERGE_L = MERGE_M + 4 * WARPS * ROWS
    MERGE_ACC = MERGE_L + 4 * WARPS * ROWS
    NB, DB, KD = WARP_KEYS // 8, D // 8, D // 16
    Q_IN_REGISTERS = D <= Q_IN_REGISTERS_MAX
    Q_FRAG_SHAPE = (1, KD, 4) if Q_IN_REGISTERS else (1, 1, 4)
    q_scores = make_q_scores(spec.bf16, 1, NB, KD, ROW, Q_IN_REGISTERS)
    accumulate_pv = make_warp_accumulate(spec.bf16, 1, NB // 2, DB, ROW)
    # The softmax on fragments without a score mod or a mask: the rows here are (token, head)
    # pairs, so this kernel applies both itself, each row with its own token and slope.
    softmax_step = make_tile_softmax(replace(spec, causal=False, window_left=-1,
                                             window_right=-1, softcap=0.0, alibi=False), NB, DB)
    visible = make_mask(spec)
    score_mod = make_score_mod(spec)
    SCORE_MOD, modified_score, exponent_scales = (score_mod.active, score_mod.score,
                                                  score_mod.scales)
    head_slope = score_mod.head_slope
    block_work = make_block_work(spec, ROWS, WARP_KEYS)
    merge_rows = make_partials_merge(D, GROUP, ROWS, WARPS, WARPS)

    @cuda.jit(device=True, inline="always")
    def tile_page(block_table, b, n0, block_size, owned):
        """Where keys n0 .. n0 + 15 of sequence b lie: (the cache's first index, the slot of
        key n0); the block table is read only for a tile the warp `owned` (page 0 else). A
        tile lies in one page of a paged cache; the page and slot come from 32-bit unsigned
        arithmetic (a 64-bit division is a long instruction sequence)."""
        if not paged:
            return b, n0
        page_of = uint32(n0) // uint32(block_size)
        page = int32(0)
        if owned:
            page = block_table[b, page_of]
        return page, uint32(n0) - page_of * uint32(block_size)

    @cuda.jit(device=True, inline="always")
    def load_tile(k_tiles, v_tiles, tile_row, k_cache, v_cache, page, slot0, h_kv, n0, n_end):
        """The warp's copies of keys n0 .. n0 + 15 (zero past n_end), which lie in `page` from
        slot0 on (tile_page), into tile rows from tile_row: one commit group."""
        lane = cuda.threadIdx.x % 32
        for i in range(WARP_KEYS * CHUNKS // 32):
            c = lane + 32 * i
            j, col = c // CHUNKS, c % CHUNKS * 8
            slot, size = 0, 0  # (past n_end: zero-filled)
            if n0 + j < n_end:
                slot, size = slot0 + j, 16
            cp_async_16(k_tiles, tile_row + j, col, k_cache, page, slot, h_kv, col, size)
            cp_async_16(v_tiles, tile_row + j, col, v_cache, page, slot, h_kv, col, size)
        cp_async_commit()

    @cuda.jit(device=True, inline="always")
    def mask_and_modify(s, n0, tokens, slopes, live, pre, offset, seqlen_k, mask_at):
        """The score mod and the mask in place on a tile of raw scores (keys n0..): the lane's
        rows lo and hi are tokens[half], with ALiBi slopes[half]; rows past the call's
        (`live` False) see nothing. (Keys past n_end need no test of their own: a split ends
        on a tile boundary, so a tile reaches past n_end only where n_end is the bound of
        what the rows see, seqlen_k or the window's right side, which `visible` applies.)"""
        t = cuda.threadIdx.x % 4
        for half in range(2):
            for nb in range(NB):
                for c in range(2):
                    key = n0 + 8 * nb + 2 * t + c
                    x = s[0, nb, 2 * half + c]
                    if SCORE_MOD:  # (before the mask, which must leave -inf)
                        x = modified_score(x, pre, slopes[half], tokens[half], key, offset,
                                           seqlen_k, mask_at)
                    if not (live[half]
                            and visible(tokens[half], key, seqlen_k, offset, mask_at, True)):
                        x = NEG_INF
                    s[0, nb, 2 * half + c] = x

    def flash_decode_mma(q, k_cache, v_cache, block_table, cache_seqlens, fixed_seqlen,
                         new_tokens, out_part, lse_part, scale_log2, alibi_slopes):
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        g = lane // 4
        (split, b, h_kv, r0, n_rows, seqlen_k, offset, n_begin, n_end,
         n_tiles) = block_work(q, cache_seqlens, fixed_seqlen, new_tokens, out_part.shape[0])
        tile_scale, pre = exponent_scales(scale_log2)
        mask_at = (lse_part, b, h_kv, ())  # (no attn_mask or mask_mod here: never read)
        own_tiles = max(0, -(-(n_tiles - warp) // WARPS))  # (tiles warp, warp + WARPS, ..)

        smem = cuda.shared.array(0, uint16, SHARED_ALIGN)
        q_tile = shared_tile(smem, 0, ROWS, ROW, uint16)
        k_tiles = shared_tile(smem, K_START, TILE_ROWS, ROW, uint16)
        v_tiles = shared_tile(smem, V_START, TILE_ROWS, ROW, uint16)
        warp_row = warp * WARP_TILES  # the warp's first tile row

        # Load: the block's Q rows (zero past n_rows), then each warp's first stages - 1 tiles,
        # a commit group each.
        for i in range(-(-ROWS * CHUNKS // THREADS)):
            c = tid + THREADS * i
            if c < ROWS * CHUNKS:
                r, col = c // CHUNKS, c % CHUNKS * 8
                row = r0 + r
                token, h, size = 0, 0, 0  # (past n_rows: zero-filled)
                if row < n_rows:
                    token, h, size = row // GROUP, h_kv * GROUP + row % GROUP, 16
                cp_async_16(q_tile, r, col, q, b, token, h, col, size)
        cp_async_commit()
        block_size = k_cache.shape[1]  # (of a paged cache)
        for stage in range(stages - 1):
            if stage < own_tiles:
                n0 = n_begin + (warp + stage * WARPS) * WARP_KEYS
                page, slot0 = tile_page(block_table, b, n0, block_size, True)
                load_tile(k_tiles, v_tiles, warp_row + stage * WARP_KEYS, k_cache, v_cache,
                          page, slot0, h_kv, n0, n_end)
            else:
                cp_async_commit()  # (an empty group: the waits count groups)
        # The page of the first tile the loop loads, read before it is needed: each tile's
        # copies wait for their page's load from the block table, so the loop reads the next
        # tile's page one tile ahead, behind a tile's arithmetic.
        next_page, next_slot0 = tile_page(
            block_table, b, n_begin + (warp + (stages - 1) * WARPS) * WARP_KEYS, block_size,
            stages - 1 < own_tiles)
        cp_async_wait(IN_FLIGHT)  # Q's group has landed
        cuda.syncthreads()  # why: every thread's part of the Q rows is visible

        q_frag = cuda.local.array(Q_FRAG_SHAPE, uint32)
        if Q_IN_REGISTERS:
            for kd in range(KD):
                f = ldmatrix_x4(q_tile, lane % 16, 16 * kd + 8 * (lane // 16))
                for r in range(4):
                    q_frag[0, kd, r] = f[r]
        s = cuda.local.array((1, NB, 4), float32)
        acc = cuda.local.array((1, DB, 4), float32)
        m_i = cuda.local.array((1, 2), float32)  # running row max (log2 units)
        l_i = cuda.local.array((1, 2), float32)  # this lane's share of the running row sum
        tokens = cuda.local.array(2, int32)  # the lane's rows' query tokens
        slopes = cuda.local.array(2, float32)  # their heads' ALiBi slopes (log2 units)
        live = cuda.local.array(2, int32)  # whether they are rows of the call
        for half in range(2):
            m_i[0, half], l_i[0, half] = NEG_INF, ZERO
            row = r0 + g + 8 * half
            live[half] = row < n_rows
            tokens[half] = min(row, n_rows - 1) // GROUP
            slopes[half] = head_slope(alibi_slopes, b, h_kv * GROUP + min(row, n_rows - 1) % GROUP)
        for db in range(DB):
            for r in range(4):
                acc[0, db, r] = ZERO
        q_lane = x4_address(q_tile, 0)
        k_lane = b_address(k_tiles, warp_row)
        v_lane = x4_address(v_tiles, warp_row)

        for i in range(own_tiles):
            # Load: tile i + stages - 1 into the stage tile i - 1 used (freed below).
            ahead = i + stages - 1
            if ahead < own_tiles:
                load_tile(k_tiles, v_tiles, warp_row + ahead % stages * WARP_KEYS, k_cache,
                          v_cache, next_page, next_slot0, h_kv,
                          n_begin + (warp + ahead * WARPS) * WARP_KEYS, n_end)
                if ahead + 1 < own_tiles:
                    next_page, next_slot0 = tile_page(
                        block_table, b, n_begin + (warp + (ahead + 1) * WARPS) * WARP_KEYS,
                        block_size, True)
            else:
                cp_async_commit()
            cp_async_wait(IN_FLIGHT)  # tile i's group has landed
            syncwarp()  # why: every lane's copies of tile i are visible to the warp
            stage_bytes = i % stages * TILE_BYTES
            # (opaque: the reads' offsets stay immediates; see mma/fragments.py)
            q_scores(s, q_frag, q_lane, opaque(k_lane + stage_bytes))
            n0 = n_begin + (warp + i * WARPS) * WARP_KEYS
            mask_and_modify(s, n0, tokens, slopes, live, pre, offset, seqlen_k, mask_at)
            softmax_step(s, acc, 0, m_i, l_i, 0, n0, False, tile_scale, pre, ZERO, offset,
                         seqlen_k, mask_at)
            accumulate_pv(acc, s, opaque(v_lane + stage_bytes))
            syncwarp()  # why: the warp's reads of this stage are done before it is refilled
        cp_async_wait(0)
        cuda.syncthreads()  # why: every warp is done with its stages (the merge reuses them)

        # Epilogue: each warp's rows' maxes, sums and unnormalised outputs into shared memory,
        # merged over the warps (blocks.py).
        merged_m = shared_tile(smem, MERGE_M, WARPS, ROWS, float32)
        merged_l = shared_tile(smem, MERGE_L, WARPS, ROWS, float32)
        merged_acc = shared_tile(smem, MERGE_ACC, MERGE_ROWS, MERGE_COLS, float32)
        t = lane % 4
        for half in range(2):
            l_row = l_i[0, half]
            for mask in (1, 2):
                l_row += shfl_xor(l_row, mask)
            if t == 0:
                merged_m[warp, g + 8 * half] = m_i[0, half]
                merged_l[warp, g + 8 * half] = l_row
            for db in range(DB):
                for c in range(2):
                    merged_acc[warp * ROWS + g + 8 * half, 8 * db + 2 * t + c] = acc[
                        0, db, 2 * half + c]
        cuda.syncthreads()  # why: every warp's partial results are in shared memory
        values = cuda.local.array(VALUES_SHAPE, float32)
        merge_rows(out_part, lse_part, split, b, h_kv, r0, n_rows, merged_m, merged_l,
                   merged_acc, values)

    return cuda.jit(flash_decode_mma, cache=True)
