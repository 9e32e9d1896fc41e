"""Where the Hopper kernels keep their tiles: 16-bit tiles in the 128-byte swizzle that wgmma
reads through matrix descriptors (device/intrinsics/wgmma.py), brought from global memory by
the copy engine (whose 128-byte swizzle places chunks the same way: make_tile_copy) or by the
producer warpgroup's cp.async copies (make_tile_loader), and the descriptors of each product's
operands.

A tile of `rows` rows and head_dim columns is stored as 64-column blocks (128 bytes of a row
each), block c at byte c · rows · 128; in a block, row r at byte 128 · r, its 16-byte chunk j
(columns 8j..8j+7 of the block) at chunk j ^ (r % 8). Tiles start on 1024-byte atoms.
K-major operands (Q, K: rows are M or N, k16 steps along the columns): a k16 step kk is 32
bytes into block kk // 4; 8-row groups 1024 bytes apart. The MN-major operand V (rows are the
product's K, columns its N): 16 keys are 2048 bytes; blocks `rows · 128` bytes apart.
"""
import functools

from numba import cuda, uint32

from ..device.intrinsics import advance, cp_async_16_from, global_address, tensor_copy_4d
from .config import WARPGROUP, column_blocks

ROW_BYTES = 128
ATOM_BYTES = 8 * ROW_BYTES
#: a K-major descriptor's leading byte offset: unused by the 128-byte swizzle (a k16 step
#: stays inside one 128-byte row), given as one 16-byte unit
K_MAJOR_LEADING = 16


@cuda.jit(device=True, inline="always")
def chunk_offset(row, chunk, rows):
    """Byte offset of the 16-byte chunk `chunk` (columns 8·chunk..) of `row` in a tile of
    `rows` rows."""
    return (chunk // 8) * rows * ROW_BYTES + row * ROW_BYTES + ((chunk % 8) ^ (row % 8)) * 16


@cuda.jit(device=True, inline="always")
def k_step(kk, rows):
    """Byte offset of k16 step kk in a K-major tile of `rows` rows: 32 bytes into 64-column
    block kk // 4 (a constant in the kernels' unrolled loops)."""
    return (kk // 4) * rows * ROW_BYTES + 32 * (kk % 4)


@functools.lru_cache(maxsize=None)
def make_tile_loader(head_dim, rows):
    """load(tile, src, b, row0, h, nrows): cp.async rows [row0, row0 + rows) of src[b, :, h, :]
    into the tile at shared address `tile`, rows at or past nrows zero-filled; called by the
    128 threads of the producer warpgroup (head_dim 64, 128 or 256: a row's 16-byte chunks
    divide the warpgroup).

    Thread t copies chunk t % chunks of rows t // chunks + i · STEP (STEP = 128 // chunks): a
    warp reads whole 128-byte segments and writes each 128-byte row of a block (its chunks
    permuted), free of bank conflicts. Its source address advances by STEP rows per copy
    (`advance`), so that the compiler keeps one address per thread instead of
    precomputing one per copy (held across the producer's loop, those took more registers
    than it keeps after setmaxnreg.dec, and spilled)."""
    chunks = head_dim // 8
    if WARPGROUP % chunks:
        raise ValueError(f"the tile loader takes head dims of 64, 128 or 256; got {head_dim}")
    STEP = WARPGROUP // chunks
    COPIES = rows // STEP

    @cuda.jit(device=True, inline="always")
    def load(tile, src, b, row0, h, nrows):
        t = uint32(cuda.threadIdx.x % WARPGROUP)  # (unsigned: its row's % 8 is a mask, the
        row, chunk = t // chunks, t % chunks  # same for every copy, STEP a multiple of 8)
        first = global_address(src, b, row0, h, 8 * chunk)  # (valid: row0 < nrows)
        source = global_address(src, b, row0 + row, h, 8 * chunk)
        step = src.strides[1] * STEP
        for i in range(COPIES):
            valid = row0 + row + i * STEP < nrows
            cp_async_16_from(tile + chunk_offset(row + uint32(i * STEP), chunk, rows),
                             source if valid else first, 16 if valid else 0)
            source = advance(source, step)

    return load


@functools.lru_cache(maxsize=None)
def make_tile_copy(head_dim, rows):
    """copy(tile, slot, h, row0, b, barrier): the copy engine's copies of rows [row0, row0 +
    rows) of head h of batch entry b, through the tensor map at `slot` (its box: 64 columns
    of `rows` rows), into the tile at shared address `tile`, one copy per 64-column block,
    each completing on `barrier`; rows past the tensor's seqlen arrive as zeros. Called by
    the one thread that issues the copies, after an arrive.expect_tx of tile_bytes(rows,
    head_dim) on `barrier` (or its share of one)."""
    COLUMN_BLOCKS = column_blocks(head_dim)

    @cuda.jit(device=True, inline="always")
    def copy(tile, slot, h, row0, b, barrier):
        for c in range(COLUMN_BLOCKS):
            tensor_copy_4d(tile + c * rows * ROW_BYTES, slot, 64 * c, h, row0, b, barrier)

    return copy
