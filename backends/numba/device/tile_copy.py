"""Tile copies from global to shared memory by cp.async, for every kernel family, and the
fences that close and wait for them."""
import functools

from numba import cuda

from .intrinsics import cp_async_16, cp_async_commit, cp_async_wait


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


@cuda.jit(device=True, inline="always")
def _commit_copies():
    cp_async_commit()


@cuda.jit(device=True, inline="always")
def _wait_copies():
    cp_async_wait(0)


@cuda.jit(device=True, inline="always")
def _wait_older_copies():
    cp_async_wait(1)


@cuda.jit(device=True, inline="always")
def _nothing():
    pass


def copy_fences(async_copy, keep_newest=False):
    """(commit, wait): close the group of cp.async copies issued since the last commit; wait
    until every committed group has landed (keep_newest: all but the newest, for a pipeline
    whose next tile is in flight). With plain loads (no cp.async: GPUs before sm_80 among
    them) both do nothing."""
    if not async_copy:
        return _nothing, _nothing
    return _commit_copies, _wait_older_copies if keep_newest else _wait_copies
