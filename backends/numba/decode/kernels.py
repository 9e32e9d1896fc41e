"""Split-KV decoding (flash-decoding) as Numba kernels, CUDA cores, float32 arithmetic.

A few query tokens per sequence attend to a long key/value cache: the work is reading K and V,
so the kernels are built to read each K/V tile once and to spread one sequence's keys over many
blocks.

- `decode_kernel`: one block of 4 warps per (key split, row tile, key/value head, sequence).
  Its rows are the seqlen_q x GROUP (query token, query head of the key/value head's group)
  pairs, token-major, ROWS at a time: the query heads of a GQA group share every K/V tile the
  block reads. The block walks its split of the keys its rows can see (causal and windows
  bound the range) in tiles of BLOCK_N keys per key warp, read through the block table when
  the cache is paged, into shared tiles of the cache's own dtype by cp.async (a double
  buffer: the next tile is in flight while this one is used), or element by element where
  the rows are not 16-byte aligned. The DecodeShape says how the warps share the work: the
  4 warps are row warps x key warps; the row warps split the block's rows, the key warps
  take BLOCK_N keys each of a block tile. With many rows (chunked prefill) the warps split the
  rows and read the same keys; with few (a decode step of multi-head attention has one row,
  a GQA group of 4 four) they split the keys, so that no warp computes rows that do not
  exist, and the key warps' partial softmaxes are merged at the end. Per tile each warp
  computes its rows' scores (lane = key, 16 bytes of the key per read), the online softmax
  (device/softmax.py) with the row max over the warp's lanes, and acc += P V with lane =
  output column, all in float32. It writes its split's normalised
  output and lse in float32.
(combine.py merges the splits' results; append.py writes the new tokens into the cache
first.)

A sequence's keys are its cache's first seqlen_k = cache_seqlens[b] + new_tokens rows
(`fixed_seqlen` >= 0 stands for every sequence's cache_seqlens when the call gave an int or
none); options are aligned to the bottom-right corner as in forward (offset = seqlen_k -
seqlen_q).
"""
import functools
from dataclasses import dataclass

from numba import cuda, float32, uint16

from ..device.bits16 import bf16_bits_to_float32, f16_bits_to_float32
from ..device.constants import NEG_INF, ZERO
from ..device.intrinsics import (SHARED_ALIGN, bits_of_float32, cp_async_16, load_f32x4,
                                 shared_tile, shfl_xor, syncwarp, unpack_bf16x2, unpack_f16x2)
from ..device.mask import make_mask
from ..device.score_mod import make_score_mod
from ..device.softmax import finalize, online_update, probability
from ..device.tile_copy import copy_fences
from .blocks import make_block_work, make_partials_merge, make_row_store

THREADS = 128
WARPS = THREADS // 32
BLOCK_N = 32  # keys per tile: one per lane in the score phase
STAGES = 2  # K/V tiles in shared memory: this one, and the next one in flight


@dataclass(frozen=True)
class DecodeShape:
    """How a decode block's 4 warps share its work: `rows` query rows per block, split among
    WARPS // key_warps row warps; each of the key_warps key warps of a row warp takes
    BLOCK_N keys of a block tile."""

    rows: int
    key_warps: int

    @property
    def rows_per_warp(self):
        return self.rows // (WARPS // self.key_warps)

    @property
    def block_keys(self):
        """Keys per block tile."""
        return BLOCK_N * self.key_warps


#: shared memory the decode shape may take (two stages of the block tile's K and V rows):
#: below sm_80's and sm_90's opt-in limits, and leaving an sm_90 multiprocessor room for a
#: second block of the many-rows shape
DECODE_SHARED_BYTES = 160 * 1024
#: rows a warp keeps while its block splits keys (the scores' inner loop runs over them)
KEY_SPLIT_ROWS = 4


def decode_shape(spec, n_rows):
    """The shape for n_rows = seqlen_q x GQA group rows: as many key warps (4, 2) as keep a
    warp's rows at KEY_SPLIT_ROWS or fewer and the tiles within DECODE_SHARED_BYTES, rows the
    next power of two that the row warps divide; else the warps split 16 rows (8 above head
    dim 128)."""
    for key_warps in (4, 2):
        row_warps = WARPS // key_warps
        rows = row_warps
        while rows < n_rows:
            rows *= 2
        shape = DecodeShape(rows, key_warps)
        if (shape.rows_per_warp <= KEY_SPLIT_ROWS
                and shared_bytes(spec, shape) <= DECODE_SHARED_BYTES):
            return shape
    return DecodeShape(16 if spec.head_dim <= 128 else 8, 1)


def tile_layout(spec):
    """(item bytes, elements per K/V tile row, bytes per tile row) of the cache's own dtype:
    rows of whole 16-byte chunks (cp.async's copies) and one chunk more, so that the score
    phase's 16-byte reads of 8 lanes (one key each) fall on distinct banks."""
    item = 4 if spec.dtype == "float32" else 2
    per_copy = 16 // item
    cols = -(-spec.head_dim // per_copy) * per_copy
    return item, cols, cols * item + 16


def shared_bytes(spec, shape):
    """Dynamic shared memory of the decode kernel: the Q rows (float32), STAGES K and V tiles
    (the cache's dtype), the warps' P rows (float32) and, when the warps split the keys, their
    partial results for the merge (float32 m, l and a row of O per warp and row)."""
    _, cols, row_bytes = tile_layout(spec)
    merge = 4 * shape.key_warps * shape.rows * (2 + cols) if shape.key_warps > 1 else 0
    return (4 * shape.rows * cols + STAGES * 2 * shape.block_keys * row_bytes
            + 4 * WARPS * shape.rows_per_warp * BLOCK_N + merge)


@cuda.jit(device=True, inline="always")
def warp_max(x):
    """The max of x over the warp's 32 lanes (every lane gets it)."""
    x = max(x, shfl_xor(x, 1))
    x = max(x, shfl_xor(x, 2))
    x = max(x, shfl_xor(x, 4))
    x = max(x, shfl_xor(x, 8))
    return max(x, shfl_xor(x, 16))


@cuda.jit(device=True, inline="always")
def warp_sum(x):
    """The sum of x over the warp's 32 lanes (every lane gets it)."""
    x += shfl_xor(x, 1)
    x += shfl_xor(x, 2)
    x += shfl_xor(x, 4)
    x += shfl_xor(x, 8)
    return x + shfl_xor(x, 16)


@cuda.jit(device=True, inline="always")
def _same(x):
    return x


def _element(spec):
    """(the kernels' element type of q and the caches, its decoder to float32, the unpacker
    of two 16-bit elements from 32 bits): bit patterns for 16-bit dtypes."""
    if spec.dtype == "float32":
        return float32, _same, None
    if spec.bf16:
        return uint16, bf16_bits_to_float32, unpack_bf16x2
    return uint16, f16_bits_to_float32, unpack_f16x2


@functools.lru_cache(maxsize=None)
def decode_kernel(spec, paged, async_copy, shape):
    """The decode kernel for a kernel spec (AttentionSpec.for_kernels()), cache layout, load
    kind and DecodeShape: q and the caches as the cache dtype's elements (16-bit ones as bit
    patterns); with async_copy the K/V rows are read by cp.async (rows of whole 16-byte
    chunks, 16-byte aligned: engine.py checks), else element by element."""
    D, GROUP = spec.head_dim, spec.group
    ROWS, ROWS_PER_WARP, KEY_WARPS = shape.rows, shape.rows_per_warp, shape.key_warps
    BLOCK_KEYS = shape.block_keys
    OUT_COLS = -(-D // 32)  # output columns per lane
    ITEM, COLS, ROW_BYTES = tile_layout(spec)
    PER_COPY, WORDS = 16 // ITEM, COLS * ITEM // 4
    CHUNKS = COLS // PER_COPY
    ROW_ITEMS, ROW_WORDS = ROW_BYTES // ITEM, ROW_BYTES // 4  # (a tile row's stride)
    STAGE_ROWS = STAGES * BLOCK_KEYS
    TILE_BYTES = BLOCK_KEYS * ROW_BYTES
    P_SLOTS = WARPS * ROWS_PER_WARP  # (each warp's P rows)
    # byte offsets in dynamic shared memory: Q rows, the stages' K tiles one after the other
    # (stage s: rows s·BLOCK_KEYS on), their V tiles, the P rows, the merge's partial results
    K_START = 4 * ROWS * COLS
    V_START = K_START + STAGES * TILE_BYTES
    P_START = V_START + STAGES * TILE_BYTES
    MERGE_M = P_START + 4 * P_SLOTS * BLOCK_N  # the merge's partial maxes, sums, outputs
    MERGE_L = MERGE_M + 4 * KEY_WARPS * ROWS
    MERGE_ACC = MERGE_L + 4 * KEY_WARPS * ROWS
    MERGE_ROWS = KEY_WARPS * ROWS
    element, decode, unpack = _element(spec)
    commit_loads, wait_older_loads = copy_fences(async_copy, keep_newest=True)
    wait_loads = copy_fences(async_copy)[1]
    visible = make_mask(spec)
    score_mod = make_score_mod(spec)
    SCORE_MOD, modified_score, exponent_scales = (score_mod.active, score_mod.score,
                                                  score_mod.scales)
    head_slope = score_mod.head_slope
    ACC_SHAPE = (ROWS_PER_WARP, OUT_COLS)
    block_work = make_block_work(spec, ROWS, BLOCK_KEYS)
    store_row = make_row_store(D, GROUP)
    merge_rows = make_partials_merge(D, GROUP, ROWS, KEY_WARPS, WARPS)

    @cuda.jit(device=True, inline="always")
    def location(block_table, b, key, block_size):
        """(first index, row) of a key of sequence b in the caches."""
        if paged:
            return block_table[b, key // block_size], key % block_size
        return b, key

    @cuda.jit(device=True, inline="always")
    def load_kv(k_tile, v_tile, row0, k_cache, v_cache, block_table, b, h_kv, n0, n_end):
        """This tile's keys and values into the tiles' rows from row0 (a stage's); zero past
        n_end (and past D)."""
        block_size = k_cache.shape[1]
        if async_copy:
            for i in range(cuda.threadIdx.x, BLOCK_KEYS * CHUNKS, THREADS):
                j, col = i // CHUNKS, i % CHUNKS * PER_COPY
                page, slot, size = 0, 0, 0  # (past n_end: zero-filled)
                if n0 + j < n_end:
                    page, slot = location(block_table, b, n0 + j, block_size)
                    size = 16
                cp_async_16(k_tile, row0 + j, col, k_cache, page, slot, h_kv, col, size)
                cp_async_16(v_tile, row0 + j, col, v_cache, page, slot, h_kv, col, size)
        else:
            for i in range(cuda.threadIdx.x, BLOCK_KEYS * COLS, THREADS):
                j, c = i // COLS, i % COLS
                value_k, value_v = element(0), element(0)
                if n0 + j < n_end and c < D:
                    page, slot = location(block_table, b, n0 + j, block_size)
                    value_k, value_v = k_cache[page, slot, h_kv, c], v_cache[page, slot, h_kv, c]
                k_tile[row0 + j, c] = value_k
                v_tile[row0 + j, c] = value_v

    def flash_decode(q, k_cache, v_cache, block_table, cache_seqlens, fixed_seqlen, new_tokens,
                     out_part, lse_part, scale_log2, alibi_slopes):
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        # The block's rows, and the keys they see: this split's share in whole tiles.
        (split, b, h_kv, r0, n_rows, seqlen_k, offset, n_begin, n_end,
         n_tiles) = block_work(q, cache_seqlens, fixed_seqlen, new_tokens, out_part.shape[0])
        tile_scale, pre = exponent_scales(scale_log2)
        mask_at = (lse_part, b, h_kv, ())  # (no attn_mask or mask_mod here: never read)

        smem = cuda.shared.array(0, float32, SHARED_ALIGN)
        q_rows = shared_tile(smem, 0, ROWS, COLS, float32)
        k_tile = shared_tile(smem, K_START, STAGE_ROWS, ROW_ITEMS, element)
        k_words = shared_tile(smem, K_START, STAGE_ROWS, ROW_WORDS, float32)  # (the
        #                                                 same bytes, read 16 at a time)
        v_tile = shared_tile(smem, V_START, STAGE_ROWS, ROW_ITEMS, element)
        p_rows = shared_tile(smem, P_START, P_SLOTS, BLOCK_N, float32)
        # The warp's rows start at row slot `first_row`, its keys at `key_slot` in a tile.
        key_warp = warp % KEY_WARPS
        first_row = warp // KEY_WARPS * ROWS_PER_WARP
        key_slot = key_warp * BLOCK_N

        # Load: the first K/V tile, in flight while the block's query rows (row r: token
        # r // GROUP, head h_kv·GROUP + r % GROUP) are read.
        if n_tiles > 0:
            load_kv(k_tile, v_tile, 0, k_cache, v_cache, block_table, b, h_kv, n_begin, n_end)
        commit_loads()
        for i in range(tid, ROWS * COLS, THREADS):
            r, c = i // COLS, i % COLS
            value = ZERO
            if r0 + r < n_rows and c < D:
                row = r0 + r
                value = decode(q[b, row // GROUP, h_kv * GROUP + row % GROUP, c])
            q_rows[r, c] = value

        acc = cuda.local.array(ACC_SHAPE, float32)
        m_i = cuda.local.array(ROWS_PER_WARP, float32)  # running row max (log2 units)
        l_i = cuda.local.array(ROWS_PER_WARP, float32)  # this lane's share of the row sum
        s_row = cuda.local.array(ROWS_PER_WARP, float32)  # this lane's key's scores
        for i in range(ROWS_PER_WARP):
            m_i[i] = NEG_INF
            l_i[i] = ZERO
            for c in range(OUT_COLS):
                acc[i, c] = ZERO

        for t in range(n_tiles):
            n0 = n_begin + t * BLOCK_KEYS
            stage_row = t % STAGES * BLOCK_KEYS
            cuda.syncthreads()  # why: every warp is done with the other stage's tiles
            # Load: the next tile into the other stage, in flight while this one is used.
            if t + 1 < n_tiles:
                load_kv(k_tile, v_tile, BLOCK_KEYS - stage_row, k_cache, v_cache, block_table,
                        b, h_kv, n0 + BLOCK_KEYS, n_end)
            commit_loads()  # (an empty group on the last tile: the wait counts groups)
            wait_older_loads()
            cuda.syncthreads()  # why: every thread's copies of this tile (and Q) are complete

            # Scores: this lane's key against each of the warp's rows, 16 bytes of the key
            # at a time (one pass over the key, so that the rows' sums stay in registers).
            key = n0 + key_slot + lane
            for i in range(ROWS_PER_WARP):
                s_row[i] = ZERO
            for w in range(0, WORDS, 4):
                x0, x1, x2, x3 = load_f32x4(k_words, stage_row + key_slot + lane, w)
                if ITEM == 4:
                    for i in range(ROWS_PER_WARP):
                        r = first_row + i
                        s_row[i] += (q_rows[r, w] * x0 + q_rows[r, w + 1] * x1
                                     + q_rows[r, w + 2] * x2 + q_rows[r, w + 3] * x3)
                else:
                    c = 2 * w
                    k0, k1 = unpack(bits_of_float32(x0))
                    k2, k3 = unpack(bits_of_float32(x1))
                    k4, k5 = unpack(bits_of_float32(x2))
                    k6, k7 = unpack(bits_of_float32(x3))
                    for i in range(ROWS_PER_WARP):
                        r = first_row + i
                        s_row[i] += (q_rows[r, c] * k0 + q_rows[r, c + 1] * k1
                                     + q_rows[r, c + 2] * k2 + q_rows[r, c + 3] * k3
                                     + q_rows[r, c + 4] * k4 + q_rows[r, c + 5] * k5
                                     + q_rows[r, c + 6] * k6 + q_rows[r, c + 7] * k7)
            for i in range(ROWS_PER_WARP):
                r = first_row + i
                row = r0 + r
                # The score mod and the mask (a row past the block's rows sees nothing, and
                # still takes part in the warp's shuffles).
                s = NEG_INF
                if row < n_rows:  # (warp-uniform)
                    t_row, h = row // GROUP, h_kv * GROUP + row % GROUP
                    s = s_row[i]
                    if SCORE_MOD:
                        s = modified_score(s, pre, head_slope(alibi_slopes, b, h), t_row, key,
                                           offset, seqlen_k, mask_at)
                    if key >= n_end or not visible(t_row, key, seqlen_k, offset, mask_at, True):
                        s = NEG_INF
                # Rescale: the row max over the warp; P into the row's shared slots.
                m_i[i], m_ref, alpha = online_update(m_i[i], warp_max(s) * tile_scale)
                p = probability(s, tile_scale, m_ref)
                l_i[i] = l_i[i] * alpha + p
                p_rows[warp * ROWS_PER_WARP + i, lane] = p
                for c in range(OUT_COLS):
                    acc[i, c] *= alpha
            syncwarp()  # why: the warp's P rows are written before its lanes read all of them
            # Accumulate: acc += P V, lane = output column.
            for j in range(BLOCK_N):
                for c in range(OUT_COLS):
                    col = lane + 32 * c
                    v_jc = decode(v_tile[stage_row + key_slot + j, col]) if col < D else ZERO
                    for i in range(ROWS_PER_WARP):
                        acc[i, c] += p_rows[warp * ROWS_PER_WARP + i, j] * v_jc
        wait_loads()  # (no copy left in flight when the block ends)

        # Epilogue: the row sum over the lanes; this split's normalised output and lse.
        if KEY_WARPS == 1:
            for i in range(ROWS_PER_WARP):
                row = r0 + first_row + i
                l_row = warp_sum(l_i[i])
                inv_l, lse_row = finalize(l_row, m_i[i])
                if row < n_rows:
                    store_row(out_part, lse_part, split, b, h_kv, row, acc, i, inv_l, lse_row,
                              lane)
        else:  # the key warps' partial results, merged by their maxes
            merged_m = shared_tile(smem, MERGE_M, KEY_WARPS, ROWS, float32)
            merged_l = shared_tile(smem, MERGE_L, KEY_WARPS, ROWS, float32)
            merged_acc = shared_tile(smem, MERGE_ACC, MERGE_ROWS, COLS, float32)
            for i in range(ROWS_PER_WARP):
                r = first_row + i
                l_row = warp_sum(l_i[i])
                if lane == 0:
                    merged_m[key_warp, r] = m_i[i]
                    merged_l[key_warp, r] = l_row
                for c in range(OUT_COLS):
                    col = lane + 32 * c
                    if col < COLS:
                        merged_acc[key_warp * ROWS + r, col] = acc[i, c]
            cuda.syncthreads()  # why: every warp's partial results are in shared memory
            merge_rows(out_part, lse_part, split, b, h_kv, r0, n_rows, merged_m, merged_l,
                       merged_acc, acc)

    return cuda.jit(flash_decode, cache=True)
