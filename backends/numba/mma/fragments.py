"""Pieces shared by the tensor-core kernels: cp.async tile loads, the lanes' ldmatrix addresses
(x4_address, b_address) and the backward's warp-level mma loops, which read at such an address
plus constant byte offsets.

Tiles are 16-bit patterns (uint16) carved out of the kernel's dynamic shared memory (so that
a config may use more than the 48 KiB a block gets without opting in), rows padded by
numba_flash.config.ROW_PAD halves.
"""
import functools

from numba import cuda, float32, uint16

from numba_flash.config import MMA_SHARED_MEMORY_BYTES
from numba_flash.intrinsics import (cp_async_16, ldmatrix_x4_at, ldmatrix_x4_trans_at,
                                    shared_address)


WARP = 32


def check_shared_bytes(shared_bytes, what):
    if shared_bytes > MMA_SHARED_MEMORY_BYTES:
        raise ValueError(f"{what} needs {shared_bytes} bytes of shared memory; tensor-core "
                         f"configs may take at most {MMA_SHARED_MEMORY_BYTES}")


def check_rows_contiguous(**arrays):
    """The kernels' cp.async copies take each array's last dimension to be contiguous
    (intrinsics.cp_async_16); the backend copies other views first (numba_backend.is_tile_ready)."""
    for name, x in arrays.items():
        if x.strides[-1] != x.dtype.itemsize:
            raise ValueError(f"{name}: the last dimension must be contiguous; its stride is "
                             f"{x.strides[-1]} bytes")


@functools.lru_cache(maxsize=None)
def make_cp_async_loader(head_dim, threads, itemsize=2):
    """load_tile(tile, tile_row0, src, b, row0, h, nrows, rows): cp.async rows [row0, row0 +
    rows) of src[b, :, h, :] into tile rows from tile_row0 on, 16 bytes per copy; rows at or
    past nrows are zero-filled. Elements are `itemsize` bytes (2: the tensor-core kernels'
    16-bit tiles; 4: the SIMT kernels' float32 ones); head_dim is a multiple of 16 bytes.

    `rows` is a constant of the calling kernel, so the loop below has a constant trip count:
    it unrolls, and each thread's chunk positions depend on its thread index only, so the
    compiler computes them once per kernel instead of once per tile (a loop starting at the
    thread index cost about 100 integer instructions per copy)."""
    per_copy = 16 // itemsize
    chunks = head_dim // per_copy

    @cuda.jit(device=True, inline="always")
    def load_tile(tile, tile_row0, src, b, row0, h, nrows, rows):
        total = rows * chunks
        for i in range((total + threads - 1) // threads):
            c = cuda.threadIdx.x + i * threads
            if total % threads == 0 or c < total:
                r = c // chunks
                col = (c % chunks) * per_copy
                valid = row0 + r < nrows
                cp_async_16(tile, tile_row0 + r, col, src, b, row0 + r if valid else 0, h, col,
                            16 if valid else 0)

    return load_tile


def _mma_and_pack(bf16):
    from numba_flash.intrinsics import mma_bf16, mma_f16, pack_bf16x2, pack_f16x2
    return (mma_bf16, pack_bf16x2) if bf16 else (mma_f16, pack_f16x2)


@cuda.jit(device=True, inline="always")
def x4_address(tile, row0):
    """The lane's ldmatrix address for the 16x16 block of `tile` at rows row0.., column 0: as
    an A fragment (ldmatrix_x4_at), or as two B fragments of a [k][n] tile (.trans)."""
    lane = cuda.threadIdx.x % WARP
    return shared_address(tile, row0 + lane % 16, 8 * (lane // 16))


@cuda.jit(device=True, inline="always")
def b_address(tile, row0):
    """The lane's ldmatrix address for the B fragments of two 8-row blocks of an [n][k] tile
    (rows row0.., column 0), as K is stored for S = Q Kᵀ."""
    lane = cuda.threadIdx.x % WARP
    return shared_address(tile, row0 + lane % 8 + 8 * (lane // 16), 8 * ((lane // 8) % 2))


# The loops below read at a lane address (x4_address, b_address) plus constant byte offsets;
# the caller passes each address through intrinsics.opaque once per iteration of its own loop
# (see the comment above intrinsics._LDMATRIX_AT: otherwise every read's address holds a
# register).

@functools.lru_cache(maxsize=None)
def make_warp_scores(bf16, nb_count, kd_count, row_halves):
    """scores(acc, a_at, b_at): for the warp's 16 rows, acc[nb, :] = A Bᵀ with A the 16 x
    16·kd_count block at a_at (x4_address) and B the rows 8·nb.. of the block at b_at
    (b_address; B stored row = n, as K for S = Q Kᵀ); tiles have rows of row_halves halves."""
    mma, _ = _mma_and_pack(bf16)

    @cuda.jit(device=True, inline="always")
    def scores(acc, a_at, b_at):
        for nb in range(nb_count):
            for r in range(4):
                acc[nb, r] = float32(0.0)
        for kd in range(kd_count):
            a = ldmatrix_x4_at(a_at, 2 * 16 * kd)  # (byte offsets: 2 per half)
            for nb in range(0, nb_count, 2):  # one ldmatrix.x4 gives B for two 8-row blocks
                f = ldmatrix_x4_at(b_at, 2 * (8 * nb * row_halves + 16 * kd))
                for half in range(2):
                    d = mma(a[0], a[1], a[2], a[3], f[2 * half], f[2 * half + 1],
                            acc[nb + half, 0], acc[nb + half, 1], acc[nb + half, 2],
                            acc[nb + half, 3])
                    for r in range(4):
                        acc[nb + half, r] = d[r]

    return scores


@functools.lru_cache(maxsize=None)
def make_warp_accumulate(bf16, kc_count, db_count, row_halves):
    """accumulate(acc, p, b_at): acc[db, :] += P B for P the warp's 16 x 16·kc_count
    register tile p[nb, :] (an accumulator of `scores`, packed here to 16 bits; the layout of
    two 8-column blocks is the A-fragment layout of a 16-wide chunk) and B the 16·kc_count x
    8·db_count block at b_at (x4_address; B stored row = k, as V for O = P V)."""
    mma, pack = _mma_and_pack(bf16)

    @cuda.jit(device=True, inline="always")
    def accumulate(acc, p, b_at):
        for kc in range(kc_count):
            a0 = pack(p[2 * kc, 0], p[2 * kc, 1])
            a1 = pack(p[2 * kc, 2], p[2 * kc, 3])
            a2 = pack(p[2 * kc + 1, 0], p[2 * kc + 1, 1])
            a3 = pack(p[2 * kc + 1, 2], p[2 * kc + 1, 3])
            for db in range(0, db_count, 2):  # one ldmatrix.x4.trans gives B for two d-blocks
                f = ldmatrix_x4_trans_at(b_at, 2 * (16 * kc * row_halves + 8 * db))
                for half in range(2):
                    d = mma(a0, a1, a2, a3, f[2 * half], f[2 * half + 1], acc[db + half, 0],
                            acc[db + half, 1], acc[db + half, 2], acc[db + half, 3])
                    for r in range(4):
                        acc[db + half, r] = d[r]

    return accumulate


@functools.lru_cache(maxsize=None)
def make_warp_store(bf16, db_count):
    """store(dst, acc, b, row_lo, h, col0, nrows, scale_lo, scale_hi): the lane's parts of
    rows row_lo and row_lo + 8, columns col0.. of dst[b, :, h, :] (16-bit) from an
    accumulator, times the row's scale; rows at or past nrows are not written."""
    _, pack = _mma_and_pack(bf16)

    @cuda.jit(device=True, inline="always")
    def store(dst, acc, b, row_lo, h, col0, nrows, scale_lo, scale_hi):
        t = cuda.threadIdx.x % 4
        for half in range(2):
            row = row_lo + 8 * half
            scale = scale_hi if half else scale_lo
            if row < nrows:
                for db in range(db_count):
                    word = pack(acc[db, 2 * half] * scale, acc[db, 2 * half + 1] * scale)
                    dst[b, row, h, col0 + 8 * db + 2 * t] = uint16(word & 0xFFFF)
                    dst[b, row, h, col0 + 8 * db + 2 * t + 1] = uint16(word >> 16)

    return store
