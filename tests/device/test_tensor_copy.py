"""The copy engine's intrinsics (device/intrinsics/tensor_copy.py): a map made on the device
from the host's template, published to a global slot, and 4-D box copies completing on an
mbarrier, against NumPy: under the simulator (the twins) and, with `-m gpu`, on an sm_90 GPU,
where the hardware's 128-byte swizzle and zero fill must match the twin's. Boxes inside the
tensor, at its last rows (zero-filled past them), in another head and batch entry; and through
a map narrowed to rows start.. start + rows - 1 (varlen's maps per sequence:
tensor_map_rows), zero-filled past them."""
import sys

import numpy as np
import pytest
from numba import cuda
from numba.core.types import uint16, uint64
from ptx_cases import compile_cases

from numba_flash.backends.numba.device.intrinsics import (
    fence_mbarrier_init, global_address, map_slot, mbarrier_expect_tx, mbarrier_init,
    mbarrier_wait, shared_base, syncwarp, tensor_copy_4d, tensor_map_acquire, tensor_map_address,
    tensor_map_publish, tensor_map_rows, tensor_map_store, tensor_map_template)

MODES = ["simulator", pytest.param("gpu", marks=pytest.mark.gpu)]
ROWS = 24  # the box's rows (a multiple of 8: each copy starts on a 1024-byte atom)
TILE_ITEMS = ROWS * 64  # 16-bit items of one box (64 columns: 128 bytes a row)


def tensor_copy_kernel(src, out, maps, template, coordinates, start, rows):
    """One warp: lane 0 makes src's map (from row `start`; with rows > 0, of `rows` rows),
    the warp publishes it; then, copy by copy, lane 0 brings the box at coordinates[i] into
    shared memory and every lane, once the barrier's phase completes, writes the tile as it
    lies there into out[i]."""
    smem = cuda.shared.array(0, uint16)
    words = cuda.shared.array(2 * 16, uint64)
    barrier_word = cuda.shared.array(1, uint64)
    lane = cuda.threadIdx.x
    tile, origin = shared_base(smem, 1024), shared_base(smem, 1)
    scratch, bar = shared_base(words, 128), shared_base(barrier_word, 8)
    if lane == 0:
        mbarrier_init(bar, 1)
        fence_mbarrier_init()
        tensor_map_store(scratch, template)
        tensor_map_address(scratch, global_address(src, 0, start, 0, 0))
        if rows > 0:
            tensor_map_rows(scratch, rows)
    syncwarp()
    tensor_map_publish(map_slot(maps, 0), scratch)
    if lane == 0:
        tensor_map_acquire(map_slot(maps, 0))
    for i in range(coordinates.shape[0]):
        if lane == 0:
            mbarrier_expect_tx(bar, TILE_ITEMS * 2)
            tensor_copy_4d(tile, map_slot(maps, 0), coordinates[i, 0], coordinates[i, 1],
                           coordinates[i, 2], coordinates[i, 3], bar)
        mbarrier_wait(bar, i % 2)
        for e in range(lane, TILE_ITEMS, 32):
            out[i, e] = smem[(tile - origin) // 2 + e]
        syncwarp()  # why: every lane has read the tile before the next copy overwrites it


def expected_tile(src, c0, c1, c2, c3):
    """The box as the 128-byte swizzle lays it out: item e of row r at chunk (e // 8) ^ (r % 8)
    of the row; zeros outside src."""
    tile = np.zeros((ROWS, 64), np.uint16)
    for r in range(ROWS):
        row = c2 + r
        if 0 <= c3 < src.shape[0] and 0 <= row < src.shape[1] and 0 <= c1 < src.shape[2]:
            for e in range(64):
                if 0 <= c0 + e < src.shape[3]:
                    tile[r, (((e // 8) ^ (r % 8)) * 8) + e % 8] = src[c3, row, c1, c0 + e]
    return tile.reshape(-1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("start, rows", [(0, 0), (5, 30)])  # (0: the whole tensor's rows)
def test_boxes_land_swizzled_and_zero_filled(rng, mode, start, rows):
    if mode == "gpu" and cuda.get_current_device().compute_capability < (9, 0):
        pytest.skip("the copy engine needs compute capability 9.0")
    src = rng.integers(1, 2**16, (2, 50, 3, 128)).astype(np.uint16)  # (never 0: fills show)
    coordinates = np.array([(0, 0, 0, 0), (64, 2, 8, 1), (0, 1, 40, 1), (64, 0, 50, 0),
                            (0, 2, 26, 0), (0, 1, 20, 1)], np.int32)  # (rows 40.., 50..:
    #                                  past the end; 20.. and 26..: past a narrowed map's)
    out = np.zeros((len(coordinates), TILE_ITEMS), np.uint16)
    template = tensor_map_template(src.shape, src.strides, 2, ROWS)
    maps = np.zeros((1, 16), np.int64)
    kernel = cuda.jit(tensor_copy_kernel)
    kernel[1, 32, 0, TILE_ITEMS * 2 + 1024](src, out, maps, template, coordinates, start, rows)
    seen = src[:, start:start + rows] if rows else src
    for i, (c0, c1, c2, c3) in enumerate(coordinates):
        np.testing.assert_array_equal(out[i], expected_tile(seen, c0, c1, c2, c3),
                                      err_msg=f"box at {tuple(coordinates[i])}")


def test_templates_refuse_strides_the_copy_engine_cannot_read():
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        tensor_map_template((1, 8, 2, 64), (8 * 2 * 136, 2 * 136, 136, 2), 2, 8)
    with pytest.raises(ValueError, match="1 to 256 rows"):
        tensor_map_template((1, 8, 2, 64), (8 * 256, 256, 128, 2), 2, 300)
    with pytest.raises(ValueError, match="16-bit items of a non-empty array"):
        tensor_map_template((1, 0, 2, 64), (256, 256, 128, 2), 2, 8)
    with pytest.raises(ValueError, match="16-bit items of a non-empty array"):
        tensor_map_template((1, 8, 2, 64), (8 * 512, 512, 256, 4), 4, 8)
    # a dimension of one element: its stride is never used, so any stride passes
    assert len(tensor_map_template((1, 8, 1, 64), (3, 128, 5, 2), 2, 8)) == 16


#: for compile_cases: the kernel, its signature, the instructions its PTX must hold
PTX_CASES = [(tensor_copy_kernel, "(uint16[:, :, :, ::1], uint16[:, ::1], int64[:, ::1], "
              "UniTuple(uint64, 16), int32[:, ::1], int64, int64)",
              ["cp.async.bulk.tensor.4d", "tensormap.replace.tile.global_address",
               "tensormap.replace.tile.global_dim",
               "tensormap.cp_fenceproxy", "fence.proxy.tensormap", "mbarrier.arrive.expect_tx"])]


def test_the_copy_engine_kernel_compiles_for_sm_90a():
    for name, _, missing, local, target in compile_cases(sys.modules[__name__], [(9, 0, "a")]):
        assert not missing, f"{name}: PTX lacks {missing}"
        assert not local, f"{name}: uses local memory"
        assert target.startswith(".target sm_90a"), f"{name}: not compiled for sm_90a"
