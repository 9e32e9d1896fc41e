"""Warp shuffles and the warp barrier. The shuffle twin exchanges values among the warp's
lanes (every lane of the warp calls it together); the syncwarp twin waits for the lanes of
the caller's warp only, as on the GPU."""
from . import sim_warp
from ._llvm import SIMULATED


def _shfl_xor_python(value, lane_mask):
    values = sim_warp.warp_exchange(value)
    return values[sim_warp.lane_id() ^ lane_mask]


def _make_shfl_xor():
    from numba import cuda

    @cuda.jit(device=True, inline="always")
    def shfl_xor(value, lane_mask):
        return cuda.shfl_xor_sync(0xFFFFFFFF, value, lane_mask)

    return shfl_xor


def _make_syncwarp():
    from numba import cuda

    @cuda.jit(device=True, inline="always")
    def syncwarp():
        cuda.syncwarp(0xFFFFFFFF)

    return syncwarp


if SIMULATED:
    shfl_xor = _shfl_xor_python
    syncwarp = sim_warp.warp_barrier
else:
    shfl_xor = _make_shfl_xor()
    syncwarp = _make_syncwarp()
