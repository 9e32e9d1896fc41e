"""Split-KV decoding (flash-decoding) as Numba kernels, CUDA cores, float32 arithmetic.

A few query tokens per sequence attend to a long key/value cache: the work is reading K and V,
so the kernels are built to read each K/V tile once and to spread one sequence's keys over many
blocks.

- `decode_kernel`: one block of 4 warps per (key split, row tile, key/value head, sequence).
  Its rows are the seqlen_q x GROUP (query token, query head of the key/value head's group)
  pairs, token-major, ROWS at a time: the query heads of a GQA group share every K/V tile the
  block reads. The block walks its split of the keys its rows can see (causal and windows
  bound the range) in tiles of BLOCK_N keys, read through the block table when the cache is
  paged; per tile each warp computes its rows' scores (lane = key), the online softmax
  (device/softmax.py) with the row max over the warp's lanes, and acc += P V with lane =
  output column. It writes its split's normalised output and lse in float32.
- `combine_kernel`: one warp per (sequence, token, head) merges the splits by log-sum-exp
  (numba_flash/merge.py's rule; a split that saw no key has weight 0) into out and lse.
- `append_kernel`: the new tokens' k and v copied, bit for bit, into the cache at positions
  cache_seqlens[b] onward (through the block table when paged), before the decode kernel.

A sequence's keys are its cache's first seqlen_k = cache_seqlens[b] + new_tokens rows
(`fixed_seqlen` >= 0 stands for every sequence's cache_seqlens when the call gave an int or
none); options are aligned to the bottom-right corner as in forward (offset = seqlen_k -
seqlen_q).
"""
import functools
import math

from numba import cuda, float32, int32

from ..device.bits16 import bf16_bits_to_float32, float32_to_bf16_bits, unchanged
from ..device.constants import NEG_INF, ZERO
from ..device.intrinsics import SHARED_ALIGN, shared_tile, shfl_xor, syncwarp
from ..device.mask import make_mask
from ..device.score_mod import make_score_mod
from ..device.softmax import finalize, online_update, probability

THREADS = 128
WARPS = THREADS // 32
BLOCK_N = 32  # keys per tile: one per lane in the score phase


def rows_per_block(head_dim):
    """Query rows (token, head) per block: 16, or 8 above head dim 128 (shared memory)."""
    return 16 if head_dim <= 128 else 8


def shared_bytes(head_dim):
    """Dynamic shared memory of the decode kernel: Q rows, K tile (rows padded by one float
    against bank conflicts), V tile, P rows, all float32."""
    rows = rows_per_block(head_dim)
    return 4 * (rows * head_dim + BLOCK_N * (head_dim + 1) + BLOCK_N * head_dim + rows * BLOCK_N)


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


def _decoder(bf16):
    return bf16_bits_to_float32 if bf16 else float32


@functools.lru_cache(maxsize=None)
def decode_kernel(spec, paged):
    """The decode kernel for a kernel spec (AttentionSpec.for_kernels()) and cache layout;
    16-bit q and caches as the SIMT kernels take them (bfloat16 as bit patterns)."""
    D, GROUP = spec.head_dim, spec.group
    ROWS = rows_per_block(D)
    ROWS_PER_WARP = ROWS // WARPS
    COLS = -(-D // 32)  # output columns per lane
    K_ROW = D + 1
    K_START = 4 * ROWS * D
    V_START = K_START + 4 * BLOCK_N * K_ROW
    P_START = V_START + 4 * BLOCK_N * D
    LEFT, RIGHT = spec.window_left, spec.window_right
    decode = _decoder(spec.bf16)
    visible = make_mask(spec)
    score_mod = make_score_mod(spec)
    SCORE_MOD, modified_score, exponent_scales = (score_mod.active, score_mod.score,
                                                  score_mod.scales)
    head_slope = score_mod.head_slope
    ACC_SHAPE = (ROWS_PER_WARP, COLS)

    def flash_decode(q, k_cache, v_cache, block_table, cache_seqlens, fixed_seqlen, new_tokens,
                     out_part, lse_part, scale_log2, alibi_slopes):
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        splits = out_part.shape[0]
        row_tiles = cuda.gridDim.x // splits
        split, row_tile = cuda.blockIdx.x // row_tiles, cuda.blockIdx.x % row_tiles
        h_kv, b = cuda.blockIdx.y, cuda.blockIdx.z
        seqlen_q = q.shape[1]
        n_rows = seqlen_q * GROUP
        seqlen_k = (fixed_seqlen if fixed_seqlen >= 0 else cache_seqlens[b]) + new_tokens
        offset = seqlen_k - seqlen_q
        block_size = k_cache.shape[1]
        tile_scale, pre = exponent_scales(scale_log2)
        mask_at = (lse_part, b, h_kv, ())  # (no attn_mask or mask_mod here: never read)

        # The keys this block's rows can see, and this split's share of them in whole tiles.
        r0 = row_tile * ROWS
        t_first, t_last = r0 // GROUP, min(seqlen_q - 1, (r0 + ROWS - 1) // GROUP)
        lo = max(0, t_first + offset - LEFT) if LEFT >= 0 else 0
        hi = min(seqlen_k, t_last + offset + RIGHT + 1) if RIGHT >= 0 else seqlen_k
        n_lo = lo // BLOCK_N * BLOCK_N
        tiles = max(0, -(-(hi - n_lo) // BLOCK_N))
        per_split = -(-tiles // splits)
        n_begin = n_lo + split * per_split * BLOCK_N
        n_end = min(hi, n_begin + per_split * BLOCK_N)

        smem = cuda.shared.array(0, float32, SHARED_ALIGN)
        q_rows = shared_tile(smem, 0, ROWS, D, float32)
        k_tile = shared_tile(smem, K_START, BLOCK_N, K_ROW, float32)
        v_tile = shared_tile(smem, V_START, BLOCK_N, D, float32)
        p_rows = shared_tile(smem, P_START, ROWS, BLOCK_N, float32)

        # Load: the block's query rows (row r: token r // GROUP, head h_kv·GROUP + r % GROUP).
        for i in range(tid, ROWS * D, THREADS):
            r, c = i // D, i % D
            value = ZERO
            if r0 + r < n_rows:
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
            for c in range(COLS):
                acc[i, c] = ZERO

        for n0 in range(n_begin, n_end, BLOCK_N):
            cuda.syncthreads()  # why: every warp is done with the previous K, V and P tiles
            # Load: this tile's keys and values, zero past the split's end.
            for i in range(tid, BLOCK_N * D, THREADS):
                j, c = i // D, i % D
                key, value_k, value_v = n0 + j, ZERO, ZERO
                if key < n_end:
                    if paged:
                        page, slot = block_table[b, key // block_size], key % block_size
                    else:
                        page, slot = b, key
                    value_k = decode(k_cache[page, slot, h_kv, c])
                    value_v = decode(v_cache[page, slot, h_kv, c])
                k_tile[j, c] = value_k
                v_tile[j, c] = value_v
            cuda.syncthreads()  # why: the K and V tiles (and, first time, Q rows) are complete

            # Scores: this lane's key against each of the warp's rows (one pass over the
            # key's columns, so that the rows' sums stay in registers).
            key = n0 + lane
            for i in range(ROWS_PER_WARP):
                s_row[i] = ZERO
            for c in range(D):
                k_c = k_tile[lane, c]
                for i in range(ROWS_PER_WARP):
                    s_row[i] += q_rows[warp * ROWS_PER_WARP + i, c] * k_c
            for i in range(ROWS_PER_WARP):
                r = warp * ROWS_PER_WARP + i
                row = r0 + r
                # The score mod and the mask (a row past the block's rows sees nothing, and
                # still takes part in the shuffles, which the simulator's twin makes
                # block-wide).
                s = NEG_INF
                if row < n_rows:  # (warp-uniform)
                    t, h = row // GROUP, h_kv * GROUP + row % GROUP
                    s = s_row[i]
                    if SCORE_MOD:
                        s = modified_score(s, pre, head_slope(alibi_slopes, b, h), t, key,
                                           offset, seqlen_k, mask_at)
                    if key >= n_end or not visible(t, key, seqlen_k, offset, mask_at):
                        s = NEG_INF
                # Rescale: the row max over the warp; P into the row's shared slots.
                m_i[i], m_ref, alpha = online_update(m_i[i], warp_max(s) * tile_scale)
                p = probability(s, tile_scale, m_ref)
                l_i[i] = l_i[i] * alpha + p
                p_rows[r, lane] = p
                for c in range(COLS):
                    acc[i, c] *= alpha
            syncwarp()  # why: the warp's P rows are written before its lanes read all of them
            # Accumulate: acc += P V, lane = output column.
            for j in range(BLOCK_N):
                for c in range(COLS):
                    col = lane + 32 * c
                    v_jc = v_tile[j, col] if col < D else ZERO
                    for i in range(ROWS_PER_WARP):
                        acc[i, c] += p_rows[warp * ROWS_PER_WARP + i, j] * v_jc

        # Epilogue: the row sum over the lanes; this split's normalised output and lse.
        for i in range(ROWS_PER_WARP):
            row = r0 + warp * ROWS_PER_WARP + i
            l_row = warp_sum(l_i[i])
            inv_l, lse_row = finalize(l_row, m_i[i])
            if row < n_rows:
                t, h = row // GROUP, h_kv * GROUP + row % GROUP
                for c in range(COLS):
                    col = lane + 32 * c
                    if col < D:
                        out_part[split, b, t, h, col] = acc[i, c] * inv_l
                if lane == 0:
                    lse_part[split, b, h, t] = lse_row

    return cuda.jit(flash_decode, cache=True)


@functools.lru_cache(maxsize=None)
def combine_kernel(bf16):
    """out, lse from the splits' float32 outputs and lses: one warp per (b, t, h) row."""
    encode = float32_to_bf16_bits if bf16 else unchanged

    def combine(out_part, lse_part, out, lse):
        splits, batch, seqlen_q, nheads, D = out_part.shape
        row = cuda.blockIdx.x * WARPS + cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        if row >= batch * seqlen_q * nheads:
            return
        h, t, b = row % nheads, row // nheads % seqlen_q, row // (nheads * seqlen_q)
        top = NEG_INF
        for s in range(splits):
            top = max(top, lse_part[s, b, h, t])
        total = ZERO
        if top != NEG_INF:
            for s in range(splits):
                total += math.exp(lse_part[s, b, h, t] - top)
        for col in range(lane, D, 32):
            value = ZERO
            if top != NEG_INF:
                for s in range(splits):
                    part = lse_part[s, b, h, t]
                    if part != NEG_INF:  # (a split without keys: weight 0, output unread)
                        value += math.exp(part - top) / total * out_part[
                            s, b, t, h, col]
            out[b, t, h, col] = encode(value)
        if lane == 0:
            lse[b, h, t] = top + math.log(total) if top != NEG_INF else NEG_INF

    return cuda.jit(combine, cache=True)


@functools.lru_cache(maxsize=None)
def append_kernel(paged):
    """k_new, v_new (batch, new_tokens, nheads_kv, D) into the caches at positions
    cache_seqlens[b] + i (or fixed_seqlen + i), bit for bit; a grid-stride loop."""
    def append(k_new, v_new, k_cache, v_cache, block_table, cache_seqlens, fixed_seqlen):
        batch, new_tokens, nheads_kv, D = k_new.shape
        block_size = k_cache.shape[1]
        for i in range(cuda.grid(1), batch * new_tokens * nheads_kv * D, cuda.gridsize(1)):
            c = i % D
            h = i // D % nheads_kv
            n = i // (D * nheads_kv) % new_tokens
            b = i // (D * nheads_kv * new_tokens)
            key = int32(fixed_seqlen if fixed_seqlen >= 0 else cache_seqlens[b]) + n
            if paged:
                page, slot = block_table[b, key // block_size], key % block_size
            else:
                page, slot = b, key
            k_cache[page, slot, h, c] = k_new[b, n, h, c]
            v_cache[page, slot, h, c] = v_new[b, n, h, c]

    return cuda.jit(append, cache=True)
