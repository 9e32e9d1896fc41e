"""Register tiles in the accumulator layout that mma.sync m16n8k16 and wgmma m64nNk16 share,
and what every tensor-core family does with them: the online softmax of a tile of scores, the
backward's P and dS of a tile, P packed as A fragments, rows of O stored.

A warp holds 16 rows of a tile (a 16-row slice; a wgmma warpgroup's warp w holds rows 16w..)
as (slices, 8-column blocks, 4) float32 arrays: with g = lane // 4 and t = lane % 4, entry
[sl, j, r] is row 16·sl + g + 8·(r // 2), column 8·j + 2t + r % 2 of the warp's slices. So each
row's values sit in the 4 lanes of a quad (combined by shuffles), and two adjacent 8-column
blocks, packed to 16 bits, are the A fragment of a 16-wide chunk (mma's and wgmma's alike):
P goes from the scores' registers straight into the P V product.
"""
import functools

from numba import cuda, float32, uint16

from .constants import NEG_INF, ZERO
from .intrinsics import pack_bf16x2, pack_f16x2, shfl_xor
from .mask import MASK_ALL, make_mask
from .score_mod import make_score_mod
from .softmax import grad_score, online_update, probability


def _pack(bf16):
    return pack_bf16x2 if bf16 else pack_f16x2


@functools.lru_cache(maxsize=None)
def make_tile_softmax(spec, nb_count, db_count, key_bound=True):
    """softmax_step(s, acc, sl, m_i, l_i, row_lo, n0, mask, tile_scale, pre, slope, offset,
    seqlen_k, mask_at) for score tiles of nb_count 8-key blocks and O accumulators of db_count
    8-column blocks: slice sl of the scores s (raw Q Kᵀ, keys n0..) becomes P in place (the
    score mod, device/score_mod.py; the tile's mask, device/mask.py tile_mask; the online
    update of the running max m_i[sl, :] and sum l_i[sl, :], this lane's share of each row's,
    for the rows row_lo and row_lo + 8), and slice sl of the O accumulator is rescaled by
    exp2(m_old - m_new) row by row."""
    visible = make_mask(spec, key_bound)
    score_mod = make_score_mod(spec)
    SCORE_MOD, modified_score = score_mod.active, score_mod.score

    @cuda.jit(device=True, inline="always")
    def mask_scores(s, sl, row_lo, n0, with_mod, seqlen_k, offset, mask_at):
        """-inf where the row does not see the key."""
        t = cuda.threadIdx.x % 4
        for nb in range(nb_count):
            for r in range(4):
                if not visible(row_lo + 8 * (r // 2), n0 + 8 * nb + 2 * t + r % 2, seqlen_k,
                               offset, mask_at, with_mod):
                    s[sl, nb, r] = NEG_INF

    @cuda.jit(device=True, inline="always")
    def softmax_step(s, acc, sl, m_i, l_i, row_lo, n0, mask, tile_scale, pre, slope, offset,
                     seqlen_k, mask_at):
        t = cuda.threadIdx.x % 4
        if SCORE_MOD:  # (before the mask, which must leave -inf)
            for nb in range(nb_count):
                for r in range(4):
                    s[sl, nb, r] = modified_score(s[sl, nb, r], pre, slope, row_lo + 8 * (r // 2),
                                                  n0 + 8 * nb + 2 * t + r % 2, offset, seqlen_k,
                                                  mask_at)
        # The mask on partial tiles, a copy for each answer to "ask mask_mod?" (as the
        # gradients below)
        if mask == MASK_ALL:
            mask_scores(s, sl, row_lo, n0, True, seqlen_k, offset, mask_at)
        elif mask:
            mask_scores(s, sl, row_lo, n0, False, seqlen_k, offset, mask_at)
        # Rescale: row max over the lane's columns, then over the row's 4 lanes, taken on the
        # unscaled scores (the scale is positive).
        ref = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        for half in range(2):
            tile_max = NEG_INF
            for nb in range(nb_count):
                tile_max = max(tile_max, max(s[sl, nb, 2 * half], s[sl, nb, 2 * half + 1]))
            for mask in (1, 2):
                tile_max = max(tile_max, shfl_xor(tile_max, mask))
            m_i[sl, half], ref[half], alpha[half] = online_update(m_i[sl, half],
                                                                  tile_max * tile_scale)
        for db in range(db_count):
            for r in range(4):
                acc[sl, db, r] *= alpha[r // 2]
        # P = exp2(S·scale·log2(e) - m), in place of S.
        for half in range(2):
            row_sum = ZERO
            for nb in range(nb_count):
                for c in range(2):
                    s[sl, nb, 2 * half + c] = probability(s[sl, nb, 2 * half + c], tile_scale,
                                                          ref[half])
                row_sum += s[sl, nb, 2 * half] + s[sl, nb, 2 * half + 1]
            l_i[sl, half] = l_i[sl, half] * alpha[half] + row_sum

    return softmax_step


@functools.lru_cache(maxsize=None)
def make_tile_gradients(spec, block_count, key_bound=True):
    """(row_gradients, column_gradients): the backward's P = exp2(S·scale − lse) (score mod
    and its derivative, device/score_mod.py; 0 where the mask hides the pair on a partial
    tile) in place of S and dS = P ∘ (dP − D) · (the score mod's derivative) in place of dP,
    for one 16-row slice of block_count 8-column blocks:

    row_gradients(s, dp, row_lo, n0, mask, lse_lo, lse_hi, delta_lo, delta_hi, tile_scale,
                  pre, slope, offset, seqlen_k, mask_at): rows are queries (row_lo, row_lo + 8
        this lane's, their lse in log2 units and D given), columns the keys n0.. (dQ);
    column_gradients(s, dp, key_lo, m0, mask, stats, lse_row, delta_row, tile_scale, pre,
                     slope, offset, seqlen_k, mask_at): rows are keys (key_lo, key_lo + 8),
        columns the queries m0.., whose lse and D are stats[lse_row, c] and
        stats[delta_row, c] for the tile's query c (Sᵀ, for dK and dV).
    mask: the tile's (device/mask.py tile_mask). Query rows past seqlen_q or that see no key
    come with lse = +inf: their P is 0."""
    visible = make_mask(spec, key_bound)
    score_and_grad = make_score_mod(spec).score_and_grad

    @cuda.jit(device=True, inline="always")
    def row_gradients_with(s, dp, row_lo, n0, mask, with_mod, lse_lo, lse_hi, delta_lo,
                           delta_hi, tile_scale, pre, slope, offset, seqlen_k, mask_at):
        t = cuda.threadIdx.x % 32 % 4  # (as the kernels compute their lanes' t)
        for nb in range(block_count):
            for r in range(4):
                hi = r >= 2
                row = row_lo + 8 * (r // 2)
                col = n0 + 8 * nb + 2 * t + r % 2
                score, dscore = score_and_grad(s[0, nb, r], pre, slope, row, col, offset,
                                               seqlen_k, mask_at)
                p = probability(score, tile_scale, lse_hi if hi else lse_lo)
                if mask and not visible(row, col, seqlen_k, offset, mask_at, with_mod):
                    p = ZERO
                s[0, nb, r] = p
                dp[0, nb, r] = grad_score(p, dp[0, nb, r], delta_hi if hi else delta_lo) * dscore

    @cuda.jit(device=True, inline="always")
    def column_gradients_with(s, dp, key_lo, m0, mask, with_mod, stats, lse_row, delta_row,
                              tile_scale, pre, slope, offset, seqlen_k, mask_at):
        t = cuda.threadIdx.x % 32 % 4  # (as the kernels compute their lanes' t)
        for nq in range(block_count):
            for r in range(4):
                c = 8 * nq + 2 * t + r % 2  # the query within the tile
                score, dscore = score_and_grad(s[0, nq, r], pre, slope, m0 + c,
                                               key_lo + 8 * (r // 2), offset, seqlen_k,
                                               mask_at)
                p = probability(score, tile_scale, stats[lse_row, c])
                if mask and not visible(m0 + c, key_lo + 8 * (r // 2), seqlen_k, offset,
                                        mask_at, with_mod):
                    p = ZERO
                s[0, nq, r] = p
                dp[0, nq, r] = grad_score(p, dp[0, nq, r], stats[delta_row, c]) * dscore

    # Each takes a copy of its loop for each answer to "ask mask_mod?": with the flag known
    # only at run time the Hopper dQ kernel with a mask_mod and GQA spilled 36 bytes, and a
    # mask_mod's backward ran 10-14 % slower (docs/KERNEL_NOTES.md, "the tile mask").
    @cuda.jit(device=True, inline="always")
    def row_gradients(s, dp, row_lo, n0, mask, lse_lo, lse_hi, delta_lo, delta_hi,
                      tile_scale, pre, slope, offset, seqlen_k, mask_at):
        if mask == MASK_ALL:
            row_gradients_with(s, dp, row_lo, n0, mask, True, lse_lo, lse_hi, delta_lo,
                               delta_hi, tile_scale, pre, slope, offset, seqlen_k, mask_at)
        else:
            row_gradients_with(s, dp, row_lo, n0, mask, False, lse_lo, lse_hi, delta_lo,
                               delta_hi, tile_scale, pre, slope, offset, seqlen_k, mask_at)

    @cuda.jit(device=True, inline="always")
    def column_gradients(s, dp, key_lo, m0, mask, stats, lse_row, delta_row, tile_scale,
                         pre, slope, offset, seqlen_k, mask_at):
        if mask == MASK_ALL:
            column_gradients_with(s, dp, key_lo, m0, mask, True, stats, lse_row, delta_row,
                                  tile_scale, pre, slope, offset, seqlen_k, mask_at)
        else:
            column_gradients_with(s, dp, key_lo, m0, mask, False, stats, lse_row, delta_row,
                                  tile_scale, pre, slope, offset, seqlen_k, mask_at)

    return row_gradients, column_gradients


@functools.lru_cache(maxsize=None)
def make_pack_chunk(bf16):
    """pack_chunk(p, sl, kc) -> the 4 uint32 A-fragment registers of keys 16·kc.. of slice sl
    of a float32 tile p (its 8-column blocks 2·kc and 2·kc + 1), rounded to 16 bits."""
    pack = _pack(bf16)

    @cuda.jit(device=True, inline="always")
    def pack_chunk(p, sl, kc):
        return (pack(p[sl, 2 * kc, 0], p[sl, 2 * kc, 1]), pack(p[sl, 2 * kc, 2], p[sl, 2 * kc, 3]),
                pack(p[sl, 2 * kc + 1, 0], p[sl, 2 * kc + 1, 1]),
                pack(p[sl, 2 * kc + 1, 2], p[sl, 2 * kc + 1, 3]))

    return pack_chunk


@functools.lru_cache(maxsize=None)
def make_fragment_store(bf16, db_count, float32_out=False):
    """store(dst, acc, sl, b, row_lo, h, col0, nrows, scale_lo, scale_hi): the lane's parts of
    rows row_lo and row_lo + 8, columns col0.. of dst[b, :, h, :] (16-bit; with float32_out,
    float32: partial sums that another kernel rounds) from slice sl of an accumulator, times
    the row's scale; array rows below 0 (a tile laid from the end of Q,
    block_range.make_query_tile_start; never varlen) or at or past nrows are not written."""
    store_pair = make_pair_store(bf16, float32_out)

    @cuda.jit(device=True, inline="always")
    def store(dst, acc, sl, b, row_lo, h, col0, nrows, scale_lo, scale_hi):
        t = cuda.threadIdx.x % 4
        for half in range(2):
            row = row_lo + 8 * half
            scale = scale_hi if half else scale_lo
            if 0 <= row < nrows:
                for db in range(db_count):
                    store_pair(dst, b, row, h, col0 + 8 * db + 2 * t,
                               acc[sl, db, 2 * half] * scale, acc[sl, db, 2 * half + 1] * scale)

    return store


@functools.lru_cache(maxsize=None)
def make_pair_store(bf16, float32_out=False):
    """store_pair(dst, b, row, h, col, low, high): dst[b, row, h, col] = low and [..., col + 1]
    = high, rounded to 16-bit patterns (bf16 or float16), or with float32_out as float32."""
    pack = _pack(bf16)

    @cuda.jit(device=True, inline="always")
    def store_pair(dst, b, row, h, col, low, high):
        if float32_out:
            dst[b, row, h, col] = low
            dst[b, row, h, col + 1] = high
        else:
            word = pack(low, high)
            dst[b, row, h, col] = uint16(word & 0xFFFF)
            dst[b, row, h, col + 1] = uint16(word >> 16)

    return store_pair
