"""The tensor-core backward kernels (backends/numba/mma/bwd.py) against the float64 reference:
under the simulator at small sizes, and with `-m gpu` on the GPU."""
import dataclasses

import numpy as np
import pytest
from inputs import simulator_and_gpu_cases
from mma_cases import run_backward

from numba_flash.backends.numba.mma.bwd import launch_mma_backward
from numba_flash.backends.numba.mma.config import MmaBackwardConfig, mma_backward_config
from numba_flash.spec import AttentionSpec


SHAPES = [(1, 17, 17, 1, 16), (1, 37, 20, 1, 32)]
GPU_SHAPES = [(2, 20, 45, 2, 64), (1, 70, 9, 2, 32), (1, 40, 80, 2, 128)]
CASES = simulator_and_gpu_cases(SHAPES, GPU_SHAPES)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode, shape", CASES)
def test_mma_backward_matches_reference(rng, mode, shape, causal, dtype):
    if mode == "gpu":
        batch, seqlen_q, seqlen_k, nheads, head_dim = shape
        shape = (batch, 16 * seqlen_q + 3, 16 * seqlen_k + 5, nheads, head_dim)
    # The simulator runs a small config (fewer Python threads); the GPU the real one.
    config = MmaBackwardConfig(block_m=32, block_n=32, warps=2) if mode == "simulator" else None
    run_backward(rng, shape, causal, dtype, config)


def _config(mode, shape, simulator_config, **gpu_changes):
    """The simulator's small config, or on the GPU the head dim's own with `gpu_changes`."""
    if mode == "simulator":
        return simulator_config
    return dataclasses.replace(mma_backward_config(shape[-1]), **gpu_changes)


PIPELINED_CASES = simulator_and_gpu_cases([(1, 53, 41, 1, 16)],
                                          [(2, 333, 725, 2, 64), (1, 725, 333, 2, 128)])


@pytest.mark.parametrize("causal, dtype", [(False, "float16"), (True, "bfloat16")])
@pytest.mark.parametrize("mode, shape", PIPELINED_CASES)
def test_two_stage_backward_matches_reference(rng, mode, shape, causal, dtype):
    """stages = 2: each loop loads its next tile into the other buffer while it computes.
    The simulator's 16-row tiles give 4 query tiles per key tile and 3 key tiles per query
    tile, so both buffers are used and refilled; the GPU runs the default tiles."""
    config = _config(mode, shape, MmaBackwardConfig(block_m=16, block_n=16, warps=1, stages=2),
                     stages=2)
    run_backward(rng, shape, causal, dtype, config)


SPLIT_CASES = simulator_and_gpu_cases([(1, 21, 27, 2, 32)],
                                      [(1, 300, 277, 2, 256), (2, 333, 725, 2, 64)])


@pytest.mark.parametrize("causal, dtype", [(False, "bfloat16"), (True, "float16")])
@pytest.mark.parametrize("mode, shape", SPLIT_CASES)
def test_head_dim_split_backward_matches_reference(rng, mode, shape, causal, dtype):
    """d_split = 2: two blocks per tile, each writing one half of the head dim's columns of
    dK, dV (or dQ) from the whole Sᵀ, dPᵀ. Head dim 256 takes it by default; the others force
    it (a column offset of the wrong block shows as half the columns wrong or unwritten)."""
    config = _config(mode, shape, MmaBackwardConfig(block_m=16, block_n=16, warps=1, d_split=2),
                     d_split=2)
    run_backward(rng, shape, causal, dtype, config)


def test_two_stage_backward_with_unequal_tiles(rng):
    """block_m, block_n and the 16·warps rows of the fixed tiles all differ, so a buffer
    offset computed from the wrong one of them reads the wrong rows; 2 query tiles per key tile
    and 2 key tiles per query tile use both buffers."""
    run_backward(rng, (1, 40, 60, 1, 16), True, "float16",
                 MmaBackwardConfig(block_m=32, block_n=48, warps=1, stages=2))


def test_configs_beyond_the_shared_memory_limit_are_refused_before_a_launch():
    # dK/dV: K, V tiles of 8 warps x 16 = 128 keys and Q, dO tiles of 128 queries, rows of
    # 256 + 8 halves, plus 128 lse and 128 D values.
    q = np.zeros((1, 16, 1, 256), np.uint16)
    lse = np.zeros((1, 1, 16), np.float32)
    with pytest.raises(ValueError, match=r"MmaBackwardConfig\(block_m=128, block_n=16, warps=8, "
                                         r"stages=1, d_split=1\) at head_dim 256 needs 271360 "
                                         r"bytes of "
                                         r"shared memory"):
        launch_mma_backward(AttentionSpec(256, "float16", softmax_scale=0.1), q, q, q, q, q, lse,
                            lse, q, q, q, config=MmaBackwardConfig(128, 16, 8))


def test_only_one_or_two_stages():
    from numba_flash.backends.numba.mma.bwd import mma_dq_kernel_function
    with pytest.raises(ValueError, match="stages must be 1 or 2; got 3"):
        mma_dq_kernel_function(MmaBackwardConfig(16, 16, 4, stages=3), AttentionSpec(64, "float16"))
    with pytest.raises(ValueError, match="d_split must be >= 1 and divide head_dim into "
                                         "multiples of 16; got 2 for head_dim 48"):
        mma_dq_kernel_function(MmaBackwardConfig(16, 16, 4, d_split=2),
                               AttentionSpec(48, "float16"))
