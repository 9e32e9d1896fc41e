"""Device functions shared by the SIMT kernels: tile loads, register-tiled products, stores.

Every factory is cached on its compile-time constants, so each kernel closes over device
functions specialised to its tile shape.

Shared tiles are float32, 16-byte aligned, rows of the padded head dim + 4 floats, so that four
consecutive columns are one 16-byte load (intrinsics.load_f32x4) and row r starts 4
banks after row r-1: eight lanes reading 16 bytes from eight consecutive rows hit all 32 banks
once.

The kernels' warps own bands of rows; a warp's lanes are 4 row groups (ty) x 8 column groups
(tx). A thread owns, of a score tile, rows ty + 4*i of its warp's band and columns tx + 8*j;
of an output tile (width: the padded head dim), the same rows and the columns of 4-wide chunks
interleaved over the column groups, (8*c + tx)*4 + e, so that the 8 lanes reading one chunk
each read 128 consecutive bytes (one shared-memory wavefront).
"""
import functools

from numba import cuda, float32

from ..device.bits16 import bf16_bits_to_float32, float32_to_bf16_bits, unchanged
from ..device.intrinsics import load_f32x4
from ..device.tile_copy import make_cp_async_loader

LANE_ROWS, LANE_COLS = 4, 8  # a warp's lanes: 4 row groups x 8 column groups


def tile_columns(padded_head_dim, head_dim):
    """(D4, CHUNKS, ROW) of a kernel's tiles: D4, the columns the scores read (head_dim in
    whole 16-byte vectors); CHUNKS, the 4-wide output column chunks per thread; ROW, floats per
    shared row (padded_head_dim + 4: 8 lanes reading 8 rows hit 32 distinct banks). The
    products with V (dO, Q, K in the backward) read up to padded_head_dim; the columns past D4
    are never loaded, but they reach only output columns that are never stored."""
    return -(-head_dim // 4) * 4, padded_head_dim // (4 * LANE_COLS), padded_head_dim + 4


@functools.lru_cache(maxsize=None)
def make_plain_loader(rows, head_dim, loaded_cols, threads, bf16=False):
    """load(tile, tile_row0, src, b, row0, h, nrows): tile[tile_row0 + r, d] =
    src[b, row0 + r, h, d] for r < rows and d < loaded_cols, zero for rows at or past nrows and
    columns at or past head_dim. Consecutive threads read consecutive d (coalesced in the
    (batch, seqlen, nheads, headdim) layout). With bf16, src holds bfloat16 bit patterns."""
    count = rows * loaded_cols
    to_float32 = bf16_bits_to_float32 if bf16 else float32

    @cuda.jit(device=True, inline="always")
    def load(tile, tile_row0, src, b, row0, h, nrows):
        for idx in range(cuda.threadIdx.x, count, threads):
            r = idx // loaded_cols
            d = idx % loaded_cols
            value = float32(0.0)
            if row0 + r < nrows and d < head_dim:
                value = to_float32(src[b, row0 + r, h, d])
            tile[tile_row0 + r, d] = value

    return load


@functools.lru_cache(maxsize=None)
def make_tile_loader(rows, head_dim, loaded_cols, threads, bf16, async_copy):
    """load(tile, tile_row0, src, b, row0, h, nrows): as make_plain_loader; with async_copy by
    cp.async (float32 rows of head_dim = loaded_cols floats, 16-byte aligned), complete only
    after the wait of copy_fences."""
    if async_copy and (bf16 or head_dim % 4):
        raise ValueError(f"cp.async loads take float32 rows of a multiple of 4 floats; got "
                         f"head_dim {head_dim}{' in bfloat16' if bf16 else ''}")
    if not async_copy:
        return make_plain_loader(rows, head_dim, loaded_cols, threads, bf16)
    copy = make_cp_async_loader(head_dim, threads, itemsize=4)

    @cuda.jit(device=True, inline="always")
    def load(tile, tile_row0, src, b, row0, h, nrows):
        copy(tile, tile_row0, src, b, row0, h, nrows, rows)

    return load


@functools.lru_cache(maxsize=None)
def make_tile_dot(rows_per_thread, cols_per_thread, threads_y, threads_x, inner):
    """tile_dot(s, a_tile, b_tile, ty, tx): s[i, j] = sum_d a_tile[ty + TY*i, d] *
    b_tile[tx + TX*j, d] (a register tile of A·Bᵀ, e.g. the scores q_tile·k_tileᵀ; an offset
    added to tx picks a B tile further down b_tile). d runs over `inner` columns (a multiple
    of 4, D4 of tile_columns) four at a time: one 16-byte load per row."""
    A_SHAPE = (rows_per_thread, 4)

    @cuda.jit(device=True, inline="always")
    def tile_dot(s, a_tile, b_tile, ty, tx):
        a = cuda.local.array(A_SHAPE, float32)
        for i in range(rows_per_thread):
            for j in range(cols_per_thread):
                s[i, j] = float32(0.0)
        for d in range(0, inner, 4):
            for i in range(rows_per_thread):
                a[i, 0], a[i, 1], a[i, 2], a[i, 3] = load_f32x4(a_tile, ty + threads_y * i, d)
            for j in range(cols_per_thread):
                b0, b1, b2, b3 = load_f32x4(b_tile, tx + threads_x * j, d)
                for i in range(rows_per_thread):
                    s[i, j] += a[i, 0] * b0 + a[i, 1] * b1 + a[i, 2] * b2 + a[i, 3] * b3

    return tile_dot


@functools.lru_cache(maxsize=None)
def make_chunked_accumulate(rows_per_thread, chunks, threads_y, threads_x, inner):
    """accumulate(acc, p_tile, b_tile, ty, tx, b_row0): acc[i, 4c + e] += sum_n p_tile[ty +
    TY*i, n] * b_tile[b_row0 + n, (threads_x*c + tx)*4 + e] for n < inner, c < chunks, e < 4
    (b_row0: where the B tile starts in b_tile, e.g. one of two stages; a register tile of
    P·B whose columns come in 4-wide chunks interleaved over the threads_x column groups)."""
    P_SHAPE = (rows_per_thread, 4)

    @cuda.jit(device=True, inline="always")
    def accumulate(acc, p_tile, b_tile, ty, tx, b_row0):
        p = cuda.local.array(P_SHAPE, float32)
        for n in range(0, inner, 4):
            for i in range(rows_per_thread):
                p[i, 0], p[i, 1], p[i, 2], p[i, 3] = load_f32x4(p_tile, ty + threads_y * i, n)
            for k in range(4):
                for c in range(chunks):
                    b0, b1, b2, b3 = load_f32x4(b_tile, b_row0 + n + k,
                                                (threads_x * c + tx) * 4)
                    for i in range(rows_per_thread):
                        acc[i, 4 * c] += p[i, k] * b0
                        acc[i, 4 * c + 1] += p[i, k] * b1
                        acc[i, 4 * c + 2] += p[i, k] * b2
                        acc[i, 4 * c + 3] += p[i, k] * b3

    return accumulate


@functools.lru_cache(maxsize=None)
def make_chunked_store(rows_per_thread, chunks, threads_y, threads_x, head_dim, bf16=False,
                       per_row_scale=False):
    """store(dst, acc, b, row0, h, nrows, ty, tx, scale): dst[b, row0 + ty + TY*i, h,
    (threads_x*c + tx)*4 + e] = acc[i, 4c + e] * scale for rows < nrows and columns < head_dim
    (the layout of make_chunked_accumulate); with per_row_scale, scale[i] for row i. With
    bf16, dst takes bfloat16 bit patterns."""
    encode = float32_to_bf16_bits if bf16 else unchanged

    if per_row_scale:
        @cuda.jit(device=True, inline="always")
        def row_scale(scale, i):
            return scale[i]
    else:
        @cuda.jit(device=True, inline="always")
        def row_scale(scale, i):
            return scale

    @cuda.jit(device=True, inline="always")
    def store(dst, acc, b, row0, h, nrows, ty, tx, scale):
        for i in range(rows_per_thread):
            row = row0 + ty + threads_y * i
            if row < nrows:
                for c in range(chunks):
                    for e in range(4):
                        col = (threads_x * c + tx) * 4 + e
                        if col < head_dim:
                            dst[b, row, h, col] = encode(acc[i, 4 * c + e] * row_scale(scale, i))

    return store
