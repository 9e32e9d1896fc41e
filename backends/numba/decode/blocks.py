"""What every decode kernel's block does around its key loop: which keys of its split it reads,
and how its warps' partial softmaxes become the split's float32 output and lse.

A decode block serves one (key split, row tile, key/value head, sequence): its rows are the
seqlen_q x GROUP (query token, query head of the key/value head's group) pairs, token-major,
`rows` at a time; row r is token r // GROUP of query head h_kv·GROUP + r % GROUP.
"""
import functools

from numba import cuda, float32

from ..device.constants import NEG_INF, ZERO
from ..device.intrinsics import exp2
from ..device.softmax import finalize


@functools.lru_cache(maxsize=None)
def make_block_work(spec, rows, unit):
    """block_work(q, cache_seqlens, fixed_seqlen, new_tokens, splits) -> (split, b, h_kv, r0,
    n_rows, seqlen_k, offset, n_begin, n_end, n_tiles) of the calling block (grid: (splits x
    row tiles, nheads_kv, batch)): its rows r0 .. r0 + rows - 1 of n_rows, its sequence's
    seqlen_k = cache_seqlens[b] (or fixed_seqlen when >= 0) + new_tokens and offset =
    seqlen_k - seqlen_q; the keys its rows can see (causal and windows bound them), cut into
    tiles of `unit` keys from a multiple of `unit` on, and this split's share of those tiles
    (every split but the last the same number)."""
    GROUP, LEFT, RIGHT = spec.group, spec.window_left, spec.window_right

    @cuda.jit(device=True, inline="always")
    def block_work(q, cache_seqlens, fixed_seqlen, new_tokens, splits):
        row_tiles = cuda.gridDim.x // splits
        split, row_tile = cuda.blockIdx.x // row_tiles, cuda.blockIdx.x % row_tiles
        h_kv, b = cuda.blockIdx.y, cuda.blockIdx.z
        seqlen_q = q.shape[1]
        seqlen_k = (fixed_seqlen if fixed_seqlen >= 0 else cache_seqlens[b]) + new_tokens
        offset = seqlen_k - seqlen_q
        r0 = row_tile * rows
        t_first, t_last = r0 // GROUP, min(seqlen_q - 1, (r0 + rows - 1) // GROUP)
        lo = max(0, t_first + offset - LEFT) if LEFT >= 0 else 0
        hi = min(seqlen_k, t_last + offset + RIGHT + 1) if RIGHT >= 0 else seqlen_k
        n_lo = lo // unit * unit
        tiles = max(0, -(-(hi - n_lo) // unit))
        per_split = -(-tiles // splits)
        n_begin = n_lo + split * per_split * unit
        n_end = min(hi, n_begin + per_split * unit)
        n_tiles = max(0, -(-(n_end - n_begin) // unit))
        return (split, b, h_kv, r0, seqlen_q * GROUP, seqlen_k, offset, n_begin, n_end,
                n_tiles)

    return block_work


@functools.lru_cache(maxsize=None)
def make_row_store(head_dim, group):
    """store_row(out_part, lse_part, split, b, h_kv, row, values, i, inv_l, lse_row, lane):
    the block's row `row` of this split's output, values[i, c] · inv_l for the lane's columns
    lane + 32·c, and (lane 0) its lse."""
    OUT_COLS = -(-head_dim // 32)

    @cuda.jit(device=True, inline="always")
    def store_row(out_part, lse_part, split, b, h_kv, row, values, i, inv_l, lse_row, lane):
        t_row, h = row // group, h_kv * group + row % group
        for c in range(OUT_COLS):
            col = lane + 32 * c
            if col < head_dim:
                out_part[split, b, t_row, h, col] = values[i, c] * inv_l
        if lane == 0:
            lse_part[split, b, h, t_row] = lse_row

    return store_row


@functools.lru_cache(maxsize=None)
def make_partials_merge(head_dim, group, rows, key_warps, warps):
    """merge_rows(out_part, lse_part, split, b, h_kv, r0, n_rows, merged_m, merged_l,
    merged_acc, values): the block's warps have read disjoint keys for the same rows and left
    their partial results in shared memory (merged_m[w, r], merged_l[w, r]: key warp w's
    running max in log2 units and row sum for row r; merged_acc[w·rows + r, col]: its
    unnormalised output row); warp `warp` merges rows warp, warp + warps, .. by their maxes
    and stores them (store_row). `values` is a (1, ceil(head_dim / 32)) float32 scratch."""
    OUT_COLS = -(-head_dim // 32)
    store_row = make_row_store(head_dim, group)

    @cuda.jit(device=True, inline="always")
    def merge_rows(out_part, lse_part, split, b, h_kv, r0, n_rows, merged_m, merged_l,
                   merged_acc, values):
        lane, warp = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
        for r in range(warp, rows, warps):
            if r0 + r < n_rows:
                m_row = NEG_INF
                for w in range(key_warps):
                    m_row = max(m_row, merged_m[w, r])
                m_ref = m_row if m_row != NEG_INF else ZERO  # (no key seen: weights 0)
                l_row = ZERO
                for w in range(key_warps):
                    l_row += merged_l[w, r] * exp2(merged_m[w, r] - m_ref)
                inv_l, lse_row = finalize(l_row, m_row)
                for c in range(OUT_COLS):
                    col = lane + 32 * c
                    value = float32(0.0)
                    if col < head_dim:
                        for w in range(key_warps):
                            value += merged_acc[w * rows + r, col] * exp2(merged_m[w, r] - m_ref)
                    values[0, c] = value
                store_row(out_part, lse_part, split, b, h_kv, r0 + r, values, 0, inv_l, lse_row,
                          lane)

    return merge_rows
