"""Device functions shared by the SIMT kernels: tile loads/stores and register-tiled products.

Every factory is cached on its compile-time constants, so each kernel closes over device
functions specialised to its tile shape.

Shared tiles are float32 `[rows][row_stride(...)]`, 16-byte aligned, so that four consecutive
columns are one 16-byte load (numba_flash.intrinsics.load_f32x4). The row stride is the padded
head dim + 4: row r then starts 4 banks after row r-1, so eight lanes reading 16 bytes from eight
different rows hit all 32 banks once.

Thread (ty, tx) of a threads_y x threads_x block owns, of a score tile, rows ty + threads_y*i
and columns tx + threads_x*j; of an output tile (width head_dim), rows ty + threads_y*i and the
contiguous columns tx*cols_per_thread + j (so it reads them from shared memory 16 bytes at a
time).
"""
import functools

from numba import cuda, float32

from numba_flash.intrinsics import load_f32x4

from .numba_bits16 import bf16_bits_to_float32, float32_to_bf16_bits, unchanged


def row_stride(padded_head_dim):
    """Floats per shared-memory row of a Q/K/V/dO tile."""
    return padded_head_dim + 4


@functools.lru_cache(maxsize=None)
def make_load_tile(rows, head_dim, padded_head_dim, threads, bf16=False):
    """load_tile(tile, src, b, row0, h, nrows, scale): tile[r, d] = src[b, row0+r, h, d] * scale,
    zero for r >= nrows - row0 or d >= head_dim. Consecutive threads read consecutive d
    (coalesced in the (batch, seqlen, nheads, headdim) layout). With bf16, src holds bfloat16
    bit patterns."""
    count = rows * padded_head_dim
    to_float32 = bf16_bits_to_float32 if bf16 else float32

    @cuda.jit(device=True, inline="always")
    def load_tile(tile, src, b, row0, h, nrows, scale):
        for idx in range(cuda.threadIdx.x, count, threads):
            r = idx // padded_head_dim
            d = idx % padded_head_dim
            value = float32(0.0)
            if row0 + r < nrows and d < head_dim:
                value = to_float32(src[b, row0 + r, h, d]) * scale
            tile[r, d] = value

    return load_tile


@functools.lru_cache(maxsize=None)
def make_tile_dot(rows_per_thread, cols_per_thread, threads_y, threads_x, padded_head_dim):
    """tile_dot(s, a_tile, b_tile, ty, tx): s[i, j] = sum_d a_tile[ty + TY*i, d] *
    b_tile[tx + TX*j, d] (a register tile of A·Bᵀ, e.g. the scores q_tile·k_tileᵀ).
    d runs over the padded head dim four columns at a time: one 16-byte load per row."""
    A_SHAPE = (rows_per_thread, 4)

    @cuda.jit(device=True, inline="always")
    def tile_dot(s, a_tile, b_tile, ty, tx):
        a = cuda.local.array(A_SHAPE, float32)
        for i in range(rows_per_thread):
            for j in range(cols_per_thread):
                s[i, j] = float32(0.0)
        for d in range(0, padded_head_dim, 4):
            for i in range(rows_per_thread):
                a[i, 0], a[i, 1], a[i, 2], a[i, 3] = load_f32x4(a_tile, ty + threads_y * i, d)
            for j in range(cols_per_thread):
                b0, b1, b2, b3 = load_f32x4(b_tile, tx + threads_x * j, d)
                for i in range(rows_per_thread):
                    s[i, j] += a[i, 0] * b0 + a[i, 1] * b1 + a[i, 2] * b2 + a[i, 3] * b3

    return tile_dot


@functools.lru_cache(maxsize=None)
def make_tile_accumulate(rows_per_thread, cols_per_thread, threads_y, inner):
    """tile_accumulate(acc, p_tile, b_tile, ty, tx): acc[i, j] += sum_n p_tile[ty + TY*i, n] *
    b_tile[n, tx*cols_per_thread + j] for n < inner (a register tile of P·B, e.g. P·V).
    Both operands are read 16 bytes at a time; each B vector serves all of the thread's rows."""
    P_SHAPE = (rows_per_thread, 4)

    @cuda.jit(device=True, inline="always")
    def tile_accumulate(acc, p_tile, b_tile, ty, tx):
        p = cuda.local.array(P_SHAPE, float32)
        col0 = tx * cols_per_thread
        for n in range(0, inner, 4):
            for i in range(rows_per_thread):
                p[i, 0], p[i, 1], p[i, 2], p[i, 3] = load_f32x4(p_tile, ty + threads_y * i, n)
            for k in range(4):
                for j in range(0, cols_per_thread, 4):
                    b0, b1, b2, b3 = load_f32x4(b_tile, n + k, col0 + j)
                    for i in range(rows_per_thread):
                        acc[i, j] += p[i, k] * b0
                        acc[i, j + 1] += p[i, k] * b1
                        acc[i, j + 2] += p[i, k] * b2
                        acc[i, j + 3] += p[i, k] * b3

    return tile_accumulate


@functools.lru_cache(maxsize=None)
def make_chunked_accumulate(rows_per_thread, chunks, threads_y, threads_x, inner):
    """accumulate(acc, p_tile, b_tile, ty, tx): acc[i, 4c + e] += sum_n p_tile[ty + TY*i, n] *
    b_tile[n, (threads_x*c + tx)*4 + e] for n < inner, c < chunks, e < 4 (a register tile of
    P·B whose columns come in 4-wide chunks interleaved over the threads_x column groups, so
    that 8 lanes reading one chunk each read 128 consecutive bytes: one shared-memory
    wavefront, where contiguous per-thread columns take two)."""
    P_SHAPE = (rows_per_thread, 4)

    @cuda.jit(device=True, inline="always")
    def accumulate(acc, p_tile, b_tile, ty, tx):
        p = cuda.local.array(P_SHAPE, float32)
        for n in range(0, inner, 4):
            for i in range(rows_per_thread):
                p[i, 0], p[i, 1], p[i, 2], p[i, 3] = load_f32x4(p_tile, ty + threads_y * i, n)
            for k in range(4):
                for c in range(chunks):
                    b0, b1, b2, b3 = load_f32x4(b_tile, n + k, (threads_x * c + tx) * 4)
                    for i in range(rows_per_thread):
                        acc[i, 4 * c] += p[i, k] * b0
                        acc[i, 4 * c + 1] += p[i, k] * b1
                        acc[i, 4 * c + 2] += p[i, k] * b2
                        acc[i, 4 * c + 3] += p[i, k] * b3

    return accumulate


@functools.lru_cache(maxsize=None)
def make_store_tile(rows_per_thread, cols_per_thread, threads_y, head_dim, bf16=False):
    """store_tile(dst, acc, b, row0, h, nrows, ty, tx, scale): dst[b, row0 + ty + TY*i, h,
    tx*cols_per_thread + j] = acc[i, j] * scale for rows < nrows and columns < head_dim. With
    bf16, dst takes bfloat16 bit patterns."""
    encode = float32_to_bf16_bits if bf16 else unchanged

    @cuda.jit(device=True, inline="always")
    def store_tile(dst, acc, b, row0, h, nrows, ty, tx, scale):
        for i in range(rows_per_thread):
            row = row0 + ty + threads_y * i
            if row < nrows:
                for j in range(cols_per_thread):
                    col = tx * cols_per_thread + j
                    if col < head_dim:
                        dst[b, row, h, col] = encode(acc[i, j] * scale)

    return store_tile
