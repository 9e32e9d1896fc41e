"""Which tiles exist: the key tiles a query tile visits, the query tiles a key tile visits,
and the class of a visited tile.

Tiles wholly masked are never visited (causal: the key tiles wholly in a query tile's future);
a visited tile is PARTIAL when some of its elements are masked (it straddles the causal
diagonal, or overhangs the end of K) and FULL otherwise, so that full tiles skip the element
predicate (mask.py). The ranges are in rows: a kernel loops `range(begin, end, BLOCK)`.
"""
import functools

from numba import cuda

EMPTY, PARTIAL, FULL = 0, 1, 2


@functools.lru_cache(maxsize=None)
def make_block_range(spec, block_m, block_n, key_bound=True):
    """Device functions for query tiles of block_m rows and key tiles of block_n keys:

    key_range(m0, seqlen_q, seqlen_k) -> (n_begin, n_end): the keys query tile m0 visits.
    query_range(n0, seqlen_q, seqlen_k) -> (m_begin, m_end): the queries key tile n0 visits
        (m_begin a multiple of block_m).
    tile_class(m0, n0, seqlen_q, seqlen_k) -> EMPTY, PARTIAL or FULL.
    is_partial(m0, n0, seqlen_q, seqlen_k) -> whether a visited tile is PARTIAL: what the
        kernels' loops ask (they visit no empty tile, and the empty test would cost them
        registers).
    query_tile_index() -> the query tile of this block (blockIdx.x), longest first.

    key_bound=False (with mask.make_mask's key_bound=False): a key tile that overhangs seqlen_k
    is not partial for that alone, for kernels whose rows past seqlen_k are never stored
    (dK/dV), so that their tiles skip the predicate there too. The ranges are exact: a kernel
    that loops over them meets no empty tile, so its loops ask is_partial only.
    """
    causal = spec.causal

    @cuda.jit(device=True, inline="always")
    def key_range(m0, seqlen_q, seqlen_k):
        if causal:  # keys up to the last row's diagonal, m0 + block_m - 1 + offset
            return 0, max(0, min(seqlen_k, m0 + block_m + seqlen_k - seqlen_q))
        return 0, seqlen_k

    @cuda.jit(device=True, inline="always")
    def query_range(n0, seqlen_q, seqlen_k):
        if causal:  # from the tile of the first query that sees key n0, n0 - offset
            return max(0, n0 - (seqlen_k - seqlen_q)) // block_m * block_m, seqlen_q
        return 0, seqlen_q

    @cuda.jit(device=True, inline="always")
    def is_partial(m0, n0, seqlen_q, seqlen_k):
        offset = seqlen_k - seqlen_q
        overhangs = key_bound and n0 + block_n > seqlen_k
        return overhangs or (causal and n0 + block_n - 1 > m0 + offset)

    @cuda.jit(device=True, inline="always")
    def tile_class(m0, n0, seqlen_q, seqlen_k):
        offset = seqlen_k - seqlen_q
        if causal and n0 > m0 + block_m - 1 + offset:
            return EMPTY
        return PARTIAL if is_partial(m0, n0, seqlen_q, seqlen_k) else FULL

    @cuda.jit(device=True, inline="always")
    def query_tile_index():
        # Under causal masking the last query tiles see the most keys; they get the first block
        # indices, which the GPU starts first, so the grid ends on short blocks.
        return cuda.gridDim.x - 1 - cuda.blockIdx.x if causal else cuda.blockIdx.x

    return key_range, query_range, tile_class, is_partial, query_tile_index
