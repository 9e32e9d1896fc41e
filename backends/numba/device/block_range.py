"""Which tiles exist: the key tiles a query tile visits, the query tiles a key tile visits,
and the class of a visited tile.

Tiles wholly masked are never visited (the key tiles wholly in a query tile's future under
causal, or out of its window); a visited tile is PARTIAL when some of its elements are masked
(it straddles a window's edge, e.g. the causal diagonal, or overhangs the end of K; every tile
is, under a boolean attn_mask, which is read per element) and FULL otherwise, so that full
tiles skip the element predicate (mask.py). The ranges are in rows: a kernel loops
`range(begin, end, BLOCK)`; they may be empty (no query of the tile sees a key).
"""
import functools

from numba import cuda, int32, uint32

EMPTY, PARTIAL, FULL = 0, 1, 2


def longest_last(spec):
    """Whether a spec's last query tiles see the most keys: causal alone (a window's tiles all
    see about as many)."""
    return spec.window_right >= 0 and spec.window_left < 0


@functools.lru_cache(maxsize=None)
def make_block_range(spec, block_m, block_n, key_bound=True, tiles_along_y=False):
    """Device functions for query tiles of block_m rows and key tiles of block_n keys:

    key_range(m0, seqlen_q, seqlen_k) -> (n_begin, n_end): the keys query tile m0 visits
        (n_begin a multiple of block_n).
    query_range(n0, seqlen_q, seqlen_k) -> (m_begin, m_end): the queries key tile n0 visits
        (m_begin a multiple of block_m).
    tile_class(m0, n0, seqlen_q, seqlen_k) -> EMPTY, PARTIAL or FULL.
    is_partial(m0, n0, seqlen_q, seqlen_k) -> whether a visited tile is PARTIAL: what the
        kernels' loops ask (they visit no empty tile, and the empty test would cost them
        registers).
    query_tile_index() -> the query tile of this block (blockIdx.x; with tiles_along_y,
        blockIdx.y), longest first.

    key_bound=False (with mask.make_mask's key_bound=False): a key tile that overhangs seqlen_k
    is not partial for that alone, for kernels whose rows past seqlen_k are never stored
    (dK/dV), so that their tiles skip the predicate there too. The ranges are exact: a kernel
    that loops over them meets no empty tile, so its loops ask is_partial only.

    Query row i sees keys [i + offset - left, i + offset + right] (offset = seqlen_k -
    seqlen_q; mask.py), so a tile's rows see one interval of keys, from its first row's left
    edge to its last row's right edge, and a key tile one interval of queries.
    """
    left, right, masked = spec.window_left, spec.window_right, spec.bool_mask
    query_tile_index = make_query_tile_index(spec, tiles_along_y)

    @cuda.jit(device=True, inline="always")
    def key_range(m0, seqlen_q, seqlen_k):
        offset = seqlen_k - seqlen_q
        n_begin, n_end = 0, seqlen_k
        if right >= 0:  # to the last row's right edge, m0 + block_m - 1 + offset + right
            n_end = max(0, min(seqlen_k, m0 + block_m + offset + right))
        if left >= 0:  # from the tile holding the first row's left edge, m0 + offset - left
            n_begin = max(0, m0 + offset - left) // block_n * block_n
        return n_begin, n_end

    @cuda.jit(device=True, inline="always")
    def query_range(n0, seqlen_q, seqlen_k):
        offset = seqlen_k - seqlen_q
        m_begin, m_end = 0, seqlen_q
        if right >= 0:  # from the tile of the first query that sees key n0, n0 - offset - right
            m_begin = max(0, n0 - offset - right) // block_m * block_m
        if left >= 0:  # to the last query that sees the tile's last key (before seqlen_k)
            m_end = max(0, min(seqlen_q, min(n0 + block_n, seqlen_k) - offset + left))
        return m_begin, m_end

    @cuda.jit(device=True, inline="always")
    def is_partial(m0, n0, seqlen_q, seqlen_k):
        offset = seqlen_k - seqlen_q
        partial = masked or (key_bound and n0 + block_n > seqlen_k)
        if right >= 0:  # the first row does not see the tile's last key
            partial = partial or n0 + block_n - 1 > m0 + offset + right
        if left >= 0:  # the last row does not see the tile's first key
            partial = partial or n0 < m0 + block_m - 1 + offset - left
        return partial

    @cuda.jit(device=True, inline="always")
    def tile_class(m0, n0, seqlen_q, seqlen_k):
        offset = seqlen_k - seqlen_q
        if right >= 0 and n0 > m0 + block_m - 1 + offset + right:
            return EMPTY
        if left >= 0 and n0 + block_n - 1 < m0 + offset - left:
            return EMPTY
        return PARTIAL if is_partial(m0, n0, seqlen_q, seqlen_k) else FULL

    return key_range, query_range, tile_class, is_partial, query_tile_index


@functools.lru_cache(maxsize=None)
def make_query_tile_index(spec, along_y=False):
    """query_tile_index() -> the query tile of this block (blockIdx.x, or with along_y
    blockIdx.y), longest first."""
    longest = longest_last(spec)

    @cuda.jit(device=True, inline="always")
    def query_tile_index():
        # When the last query tiles see the most keys they get the first block indices,
        # which the GPU starts first, so the grid ends on short blocks.
        if along_y:
            return cuda.gridDim.y - 1 - cuda.blockIdx.y if longest else cuda.blockIdx.y
        return cuda.gridDim.x - 1 - cuda.blockIdx.x if longest else cuda.blockIdx.x

    return query_tile_index


@functools.lru_cache(maxsize=None)
def make_query_tile_start(spec, block_m, from_end, along_y=False):
    """query_tile_start(seqlen_q) -> the first row of this block's query tile (a grid of
    ceil(seqlen_q / block_m) tiles along grid.x, or with along_y grid.y, longest first).

    from_end (for kernels that read rows below 0 as zeros and store none of them): under
    causal alone the tiles are laid from the end of Q, so that the one tile that overhangs
    is the first, which sees the fewest keys, rather than the last, which sees them all
    (at seqlen 4096 and 192-row tiles its 128 rows of padding were 6 % of the causal work)."""
    query_tile_index = make_query_tile_index(spec, along_y)
    FROM_END = from_end and longest_last(spec)

    @cuda.jit(device=True, inline="always")
    def query_tile_start(seqlen_q):
        m0 = query_tile_index() * block_m
        if FROM_END:
            tiles = cuda.gridDim.y if along_y else cuda.gridDim.x
            return m0 - (tiles * block_m - seqlen_q)
        return m0

    return query_tile_start


@functools.lru_cache(maxsize=None)
def make_group_walk(spec, block_m, heads=None):
    """How a dK/dV block walks the query tiles of its key tile for each of `heads` query heads
    (by default its whole GQA group: spec.group heads share one key/value head) in one loop,
    so that the copy of the next tile runs behind this one across heads too:

        m_stop, span = group_walk(m_begin, m_end)        # query_range's rows
        for step in range(m_begin, m_stop, block_m):
            head, m0 = walk_position(step, m_begin, span)  # the group's head, the tile's row

    span is the rows one head's walk covers (a multiple of block_m); with one head the loop is
    range(m_begin, m_end, block_m) itself (head 0, m0 = step)."""
    group = spec.group if heads is None else heads

    @cuda.jit(device=True, inline="always")
    def group_walk(m_begin, m_end):
        if group == 1:
            return m_end, 0
        span = max(0, m_end - m_begin + block_m - 1) // block_m * block_m
        return m_begin + group * span, span

    @cuda.jit(device=True, inline="always")
    def walk_position(step, m_begin, span):
        if group == 1:
            return 0, step
        # (in 32 bits: a 64-bit division each step held registers the dK/dV consumers lack)
        head = int32(uint32(step - m_begin) // uint32(span))
        return head, step - head * span

    return group_walk, walk_position
