"""A call's mask_mod in the kernels: the user's function, compiled into them, and its tile
table.

mask_mod(b, h, q_idx, kv_idx) -> bool (spec.mask_mod) is compiled as a device function of
the kernel that calls it and called for the elements of partial tiles, only with indices
inside the bounds (q_idx < seqlen_q, kv_idx < seqlen_k: a function that indexes an array by
them never reads past it); a row or key past the end asks about the nearest one inside and is
not seen, whatever the answer. b is the block's sequence (blockIdx.z: the batch entry, or
varlen's sequence), h its query head, both passed in `mask_at` (device/attn_mask.py), whose
last item is the tuple of the arrays mask_mod captures (numba_flash/mask_mod.py: spec.mask_mod
is its MaskModProgram, the function taking them after the four indices; a kernel argument).

Which tiles need it says the tile table (backends/numba/tile_classes.py builds it before the
attention kernels run, for their tile shape): `tiles = (classes, spans)`, classes[b, h,
query tile, key tile] one of block_range's EMPTY, PARTIAL, FULL for mask_mod alone, and
spans[b, h, tile] the [first, end) tiles along the other axis that are not empty (for the
dK/dV kernels, per key tile and key/value head, over the query heads of its GQA group). A
kernel narrows its tile range to the span, skips empty tiles inside it and calls the
predicate where mask_mod or block_range says partial.
"""
import functools

from numba import cuda

from .block_range import EMPTY, FULL


@functools.lru_cache(maxsize=None)
def make_mask_mod_reader(spec):
    """mod_allows(mask_at, row, col, seqlen_q, seqlen_k) -> whether mask_mod lets query row
    see key col (True without a mask_mod; False outside the bounds)."""
    mask_mod = spec.mask_mod
    if mask_mod is None:
        @cuda.jit(device=True, inline="always")
        def mod_allows(mask_at, row, col, seqlen_q, seqlen_k):
            return True
        return mod_allows

    # Numba's inliner takes no *args: the call names each captured array (written out for
    # this program's count of them)
    arrays = "".join(f", captured[{i}]" for i in range(len(mask_mod.captured)))
    source = ("def mod_allows(mask_at, row, col, seqlen_q, seqlen_k):\n"
              "    _, b, h, captured = mask_at\n"
              "    inside = (row < seqlen_q) & (col < seqlen_k)\n"
              "    return inside & bool(user_mask(b, h, min(row, seqlen_q - 1), "
              f"min(col, seqlen_k - 1){arrays}))\n")
    namespace = {"user_mask": cuda.jit(device=True, inline="always")(mask_mod.function)}
    exec(compile(source, __file__, "exec"), namespace)
    return cuda.jit(device=True, inline="always")(namespace["mod_allows"])


@functools.lru_cache(maxsize=None)
def make_tile_table(spec, block_m, block_n):
    """Readers of the tile table of tiles of block_m queries x block_n keys:

    narrow(tiles, b, h, tile, begin, end, block) -> (begin, end): a range of rows (multiples
        of `block`, the other axis' tile) cut to the span of tile `tile` of head h;
    mod_class(tiles, b, h, m0, n0) -> mask_mod's class of the tile at rows m0, n0 (FULL
        without a mask_mod).
    Without a mask_mod neither reads anything: narrow returns the range as it is."""
    active = spec.mask_mod is not None

    @cuda.jit(device=True, inline="always")
    def narrow(tiles, b, h, tile, begin, end, block):
        if not active:
            return begin, end
        spans = tiles[1]
        return (max(begin, int(spans[b, h, tile, 0]) * block),
                min(end, int(spans[b, h, tile, 1]) * block))

    @cuda.jit(device=True, inline="always")
    def mod_class(tiles, b, h, m0, n0):
        if not active:
            return FULL
        return int(tiles[0][b, h, m0 // block_m, n0 // block_n])

    return narrow, mod_class


@functools.lru_cache(maxsize=None)
def make_next_key_tile(spec, block_m, block_n):
    """next_key_tile(tiles, b, h, m0, n_begin, tile, n_tiles) -> the first key tile from
    `tile` on (tile t starts at key n_begin + t·block_n) that some row of the query tile at
    m0 sees, n_tiles if none: the next one a kernel that skips EMPTY tiles visits."""
    mod_class = make_tile_table(spec, block_m, block_n)[1]

    @cuda.jit(device=True, inline="always")
    def next_key_tile(tiles, b, h, m0, n_begin, tile, n_tiles):
        while tile < n_tiles and mod_class(tiles, b, h, m0, n_begin + tile * block_n) == EMPTY:
            tile += 1
        return tile

    return next_key_tile
