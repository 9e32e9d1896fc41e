"""Device functions shared by the SIMT kernels: tile loads and register-tiled tile products.

Every factory is cached on its compile-time constants, so each kernel closes over device
functions specialised to its tile shape. Shared tiles are float32 `[rows][padded_head_dim + 1]`:
the +1 column makes a column walk (thread t reading row t) hit 32 different banks.

Thread (ty, tx) of a threads_y x threads_x block owns register-tile element (i, j) at tile row
ty + threads_y*i and tile column tx + threads_x*j (interleaved, so that neighbouring lanes read
neighbouring shared-memory words).
"""
import functools

from numba import cuda, float32


@functools.lru_cache(maxsize=None)
def make_load_tile(rows, head_dim, padded_head_dim, threads):
    """load_tile(tile, src, b, row0, h, nrows, scale): tile[r, d] = src[b, row0+r, h, d] * scale,
    zero for r >= nrows - row0 or d >= head_dim. Consecutive threads read consecutive d
    (coalesced in the (batch, seqlen, nheads, headdim) layout)."""
    count = rows * padded_head_dim

    @cuda.jit(device=True, inline="always")
    def load_tile(tile, src, b, row0, h, nrows, scale):
        for idx in range(cuda.threadIdx.x, count, threads):
            r = idx // padded_head_dim
            d = idx % padded_head_dim
            value = float32(0.0)
            if row0 + r < nrows and d < head_dim:
                value = float32(src[b, row0 + r, h, d]) * scale
            tile[r, d] = value

    return load_tile


@functools.lru_cache(maxsize=None)
def make_tile_dot(rows_per_thread, cols_per_thread, threads_y, threads_x, head_dim):
    """tile_dot(s, a_tile, b_tile, ty, tx): s[i, j] = sum_d a_tile[ty + TY*i, d] * b_tile[tx + TX*j, d]
    (a register tile of A·Bᵀ, e.g. the scores q_tile·k_tileᵀ)."""

    @cuda.jit(device=True, inline="always")
    def tile_dot(s, a_tile, b_tile, ty, tx):
        a = cuda.local.array(rows_per_thread, float32)
        bt = cuda.local.array(cols_per_thread, float32)
        for i in range(rows_per_thread):
            for j in range(cols_per_thread):
                s[i, j] = float32(0.0)
        for d in range(head_dim):
            for i in range(rows_per_thread):
                a[i] = a_tile[ty + threads_y * i, d]
            for j in range(cols_per_thread):
                bt[j] = b_tile[tx + threads_x * j, d]
            for i in range(rows_per_thread):
                for j in range(cols_per_thread):
                    s[i, j] += a[i] * bt[j]

    return tile_dot


@functools.lru_cache(maxsize=None)
def make_tile_accumulate(rows_per_thread, cols_per_thread, threads_y, threads_x, inner):
    """tile_accumulate(acc, p_tile, b_tile, ty, tx): acc[i, j] += sum_n p_tile[ty + TY*i, n] *
    b_tile[n, tx + TX*j] for n < inner (a register tile of P·B, e.g. P·V)."""

    @cuda.jit(device=True, inline="always")
    def tile_accumulate(acc, p_tile, b_tile, ty, tx):
        p = cuda.local.array(rows_per_thread, float32)
        bt = cuda.local.array(cols_per_thread, float32)
        for n in range(inner):
            for i in range(rows_per_thread):
                p[i] = p_tile[ty + threads_y * i, n]
            for j in range(cols_per_thread):
                bt[j] = b_tile[n, tx + threads_x * j]
            for i in range(rows_per_thread):
                for j in range(cols_per_thread):
                    acc[i, j] += p[i] * bt[j]

    return tile_accumulate


@functools.lru_cache(maxsize=None)
def make_store_tile(rows_per_thread, cols_per_thread, threads_y, threads_x, head_dim):
    """store_tile(dst, acc, b, row0, h, nrows, ty, tx, scale): dst[b, row0 + ty + TY*i, h,
    tx + TX*j] = acc[i, j] * scale for rows < nrows and columns < head_dim."""

    @cuda.jit(device=True, inline="always")
    def store_tile(dst, acc, b, row0, h, nrows, ty, tx, scale):
        for i in range(rows_per_thread):
            row = row0 + ty + threads_y * i
            if row < nrows:
                for j in range(cols_per_thread):
                    col = tx + threads_x * j
                    if col < head_dim:
                        dst[b, row, h, col] = acc[i, j] * scale

    return store_tile
