"""Device intrinsics that Numba has no API for, one module per PTX family, each binding beside
its pure-Python twin for the simulator.

Under NUMBA_ENABLE_CUDASIM=1 kernels run as Python, where an @intrinsic cannot be called, so
every public name is bound at import time to either the compiled intrinsic (PTX through
llvmlite inline assembly) or its twin; kernels call the name and run unchanged in both.
Warp-collective twins (mma, ldmatrix, shuffles) exchange lane values through block barriers
(sim_warp), so in kernels they must be called by every thread of the block together, like
syncthreads().
"""
from ._llvm import SHARED_ALIGN, SIMULATED
from .bitcast import bits_of_float32, float32_from_bits
from .cp_async import cp_async_16, cp_async_commit, cp_async_wait
from .ex2 import exp2
from .ldmatrix import ldmatrix_x4, ldmatrix_x4_at, ldmatrix_x4_trans, ldmatrix_x4_trans_at
from .mma import mma_bf16, mma_f16, pack_bf16x2, pack_f16x2, unpack_bf16x2, unpack_f16x2
from .rcp import reciprocal
from .shared import load_f32x4, opaque, shared_address, shared_tile
from .warp import shfl_xor, syncwarp

__all__ = ["SHARED_ALIGN", "SIMULATED", "bits_of_float32", "cp_async_16", "cp_async_commit",
           "cp_async_wait", "exp2", "float32_from_bits", "ldmatrix_x4", "ldmatrix_x4_at",
           "ldmatrix_x4_trans", "ldmatrix_x4_trans_at", "mma_bf16", "mma_f16", "pack_bf16x2",
           "pack_f16x2", "unpack_bf16x2", "unpack_f16x2", "load_f32x4", "opaque", "reciprocal",
           "shared_address", "shared_tile", "shfl_xor", "syncwarp"]
