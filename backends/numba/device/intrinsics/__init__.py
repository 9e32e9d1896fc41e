"""Device intrinsics that Numba has no API for, one module per PTX family, each binding beside
its pure-Python twin for the simulator.

Under NUMBA_ENABLE_CUDASIM=1 kernels run as Python, where an @intrinsic cannot be called, so
every public name is bound at import time to either the compiled intrinsic (PTX through
llvmlite inline assembly) or its twin; kernels call the name and run unchanged in both.
Warp-collective twins (mma, ldmatrix, shuffles) exchange lane values among the warp's threads
(sim_warp), warpgroup-collective ones (wgmma) among the warpgroup's: in kernels every thread
of the warp (warpgroup) calls them together, as on the GPU.
"""
from ._llvm import SHARED_ALIGN, SIMULATED
from .bitcast import bits_of_float32, float32_from_bits
from .cp_async import (advance, cp_async_16, cp_async_16_from, cp_async_commit,
                       cp_async_wait, global_address)
from .ex2 import exp2
from .ldmatrix import ldmatrix_x4, ldmatrix_x4_at, ldmatrix_x4_trans, ldmatrix_x4_trans_at
from .mbarrier import (fence_mbarrier_init, fence_proxy_async, mbarrier_arrive,
                       mbarrier_expect_tx, mbarrier_init, mbarrier_wait)
from .mma import mma_bf16, mma_f16, pack_bf16x2, pack_f16x2, unpack_bf16x2, unpack_f16x2
from .rcp import reciprocal
from .shared import load_f32x4, opaque, shared_address, shared_base, shared_tile
from .tensor_copy import (MAP_WORDS, TensorMapRefused, map_slot, tensor_copy_4d, tensor_map_acquire,
                          tensor_map_address, tensor_map_publish, tensor_map_rows,
                          tensor_map_store, tensor_map_template)
from .warp import shfl_xor, syncwarp
from .warpgroup import (named_barrier_arrive, named_barrier_sync, setmaxnreg_dec,
                        setmaxnreg_inc)
from .wgmma import (descriptor_at, make_descriptor, make_fence_operands, make_wgmma,
                    wgmma_commit, wgmma_fence, wgmma_wait)

if SIMULATED:  # (every kernel family imports this package before it launches)
    from .sim_block import install as _install_block_scheduler
    _install_block_scheduler()

__all__ = ["advance", "bits_of_float32", "cp_async_16", "cp_async_16_from", "cp_async_commit",
           "cp_async_wait", "descriptor_at", "exp2", "fence_mbarrier_init", "fence_proxy_async",
           "float32_from_bits", "global_address", "ldmatrix_x4", "ldmatrix_x4_at",
           "ldmatrix_x4_trans", "ldmatrix_x4_trans_at", "load_f32x4", "make_descriptor",
           "make_fence_operands", "make_wgmma", "map_slot", "MAP_WORDS", "mbarrier_arrive",
           "mbarrier_expect_tx", "mbarrier_init", "mbarrier_wait", "mma_bf16", "mma_f16",
           "named_barrier_arrive", "named_barrier_sync", "opaque", "pack_bf16x2", "pack_f16x2",
           "reciprocal", "setmaxnreg_dec", "setmaxnreg_inc", "shared_address", "SHARED_ALIGN",
           "shared_base", "shared_tile", "shfl_xor", "SIMULATED", "syncwarp", "tensor_copy_4d",
           "tensor_map_acquire", "tensor_map_address", "tensor_map_publish",
           "tensor_map_rows", "tensor_map_store", "tensor_map_template", "TensorMapRefused",
           "unpack_bf16x2", "unpack_f16x2",
           "wgmma_commit", "wgmma_fence", "wgmma_wait"]
