"""The tensor-core forward kernel (backends/numba/mma/fwd.py) against the float64 reference:
under the simulator at small sizes, and with `-m gpu` on the GPU."""
import numpy as np
import pytest
from inputs import simulator_and_gpu_cases
from mma_cases import run_forward

from numba_flash.backends.numba.mma.config import MmaConfig
from numba_flash.spec import AttentionSpec


SHAPES = [(1, 17, 17, 1, 16), (1, 37, 20, 2, 32)]
GPU_SHAPES = [(2, 20, 45, 2, 64), (1, 70, 9, 2, 32), (1, 40, 80, 2, 128), (1, 33, 33, 2, 96),
              (1, 20, 17, 2, 256)]
KINDS = [("float16", 1), ("bfloat16", 1), ("float16", 2)]  # (dtype, slices)
SIM_D128 = (1, 5, 40, 1, 128)


def _cases():
    """Every kind, causal and not, at each shape; head dim 128 under the simulator (its 8
    k-steps are slow there) in two of them, the GPU taking every kind at 128 and beyond."""
    for case in simulator_and_gpu_cases(SHAPES, GPU_SHAPES):
        for causal in (False, True):
            for dtype, slices in KINDS:
                yield pytest.param(*case.values, causal, dtype, slices, marks=case.marks,
                                   id=f"{case.id}-{causal}-{dtype}-{slices}")
    for causal, dtype, slices in ((True, "float16", 2), (False, "bfloat16", 1)):
        yield pytest.param("simulator", SIM_D128, causal, dtype, slices,
                           id=f"sim-1x5x40x1x128-{causal}-{dtype}-{slices}")


CASES = list(_cases())


@pytest.mark.parametrize("mode, shape, causal, dtype, slices", CASES)
def test_mma_forward_matches_reference(rng, mode, shape, causal, dtype, slices):
    """slices=2: each warp owns two 16-row slices (a tuning option of MmaConfig)."""
    batch, seqlen_q, seqlen_k, nheads, head_dim = shape
    if mode == "gpu":  # real sizes on the GPU
        shape = (batch, 16 * seqlen_q + 3, 16 * seqlen_k + 5, nheads, head_dim)
    # The simulator runs a small config (fewer Python threads); the GPU the real one, or for
    # two slices a config ptxas accepts without spills.
    if mode == "simulator":
        config = MmaConfig(block_n=32, warps=2 // slices, slices=slices)
    else:
        config = None if slices == 1 else MmaConfig(block_n=32 if head_dim <= 64 else 16,
                                                    warps=4, slices=slices)
    run_forward(rng, shape, causal, dtype, config)


def test_configs_beyond_the_shared_memory_limit_are_refused():
    from numba_flash.backends.numba.mma.fwd import mma_forward_kernel_function
    # Q: 8 warps x 3 slices x 16 = 384 rows; K and V: 64 rows each; rows of 128 + 8 halves.
    with pytest.raises(ValueError, match=r"slices=3\) at head_dim 128 needs 139264 bytes of "
                                         r"shared memory; tensor-core configs may take at most "
                                         r"101376"):
        mma_forward_kernel_function(MmaConfig(64, 8, 3), AttentionSpec(128, "float16"))
    with pytest.raises(ValueError, match="slices and warps must be >= 1"):
        mma_forward_kernel_function(MmaConfig(32, 4, 0), AttentionSpec(64, "float16"))


def test_launch_refuses_a_strided_last_dimension():
    from numba_flash.backends.numba.mma.fwd import launch_mma_forward
    q = np.zeros((1, 16, 1, 128), np.uint16)[..., ::2]  # 64 columns, 4 bytes apart
    out = np.zeros((1, 16, 1, 64), np.uint16)
    lse = np.zeros((1, 1, 16), np.float32)
    with pytest.raises(ValueError, match="q: the last dimension must be contiguous; its stride "
                                         "is 4 bytes"):
        launch_mma_forward(AttentionSpec(64, "float16", softmax_scale=0.1), q, out, out, out, lse)
