"""The tensor-core forward kernel (backends/numba_mma_fwd.py) against the float64 reference:
under the simulator at small sizes, and with `-m gpu` on the GPU."""
import numpy as np
import pytest
from error_rule import assert_within_rule
from inputs import simulator_and_gpu_cases

from numba_flash.backends.numba_mma_fwd import launch_mma_forward
from numba_flash.config import MmaConfig
from numba_flash.standard_attention import attention_forward
from numba_flash.testing import bf16_bits, bf16_values, plain16_forward


def encode(x, dtype):
    """(16-bit patterns, the float32 values they hold)."""
    if dtype == "float16":
        half = x.astype(np.float16)
        return half.view(np.uint16), half.astype(np.float32)
    bits = bf16_bits(np, x)
    return bits, bf16_values(np, bits)


def decode(bits, dtype):
    return bits.view(np.float16).astype(np.float32) if dtype == "float16" else bf16_values(np, bits)


SHAPES = [(1, 17, 17, 1, 16), (1, 37, 20, 2, 32), (1, 5, 40, 1, 128)]
GPU_SHAPES = [(2, 20, 45, 2, 64), (1, 70, 9, 2, 32), (1, 40, 80, 2, 128), (1, 33, 33, 2, 96)]


CASES = simulator_and_gpu_cases(SHAPES, GPU_SHAPES)


@pytest.mark.parametrize("dtype, slices", [("float16", 1), ("bfloat16", 1), ("float16", 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode, shape", CASES)
def test_mma_forward_matches_reference(rng, mode, shape, causal, dtype, slices):
    """slices=2: each warp owns two 16-row slices (a tuning option of MmaConfig)."""
    batch, seqlen_q, seqlen_k, nheads, head_dim = shape
    if mode == "gpu":  # real sizes on the GPU
        seqlen_q, seqlen_k = 16 * seqlen_q + 3, 16 * seqlen_k + 5
    draw = lambda n: rng.standard_normal((batch, n, nheads, head_dim))  # noqa: E731
    (qb, q), (kb, k), (vb, v) = (encode(draw(n), dtype) for n in (seqlen_q, seqlen_k, seqlen_k))
    out = np.full(qb.shape, 0x7E00, np.uint16)  # NaN in float16 and a NaN-ish bf16 pattern
    lse = np.full((batch, nheads, seqlen_q), np.nan, np.float32)
    scale = head_dim ** -0.5
    # The simulator runs a small config (fewer Python threads); the GPU the real one, or for
    # two slices a config ptxas accepts without spills.
    if mode == "simulator":
        config = MmaConfig(block_n=32, warps=2 // slices, slices=slices)
    else:
        config = None if slices == 1 else MmaConfig(block_n=32 if head_dim <= 64 else 16,
                                                    warps=4, slices=slices)
    launch_mma_forward(qb, kb, vb, out, lse, causal, scale, dtype == "bfloat16", config=config)
    ref_out, ref_lse = attention_forward(np, q, k, v, causal, scale, np.float64)
    base_out, _ = plain16_forward(np, q, k, v, causal, scale, dtype)
    assert_within_rule("out", decode(out, dtype), base_out, ref_out, "float16")
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    scale = max(1, np.abs(ref_lse[finite]).max())
    assert np.abs(lse[finite] - ref_lse[finite]).max() < 1e-4 * scale


def test_configs_beyond_the_shared_memory_limit_are_refused():
    from numba_flash.backends.numba_mma_fwd import mma_forward_kernel_function
    # Q: 8 warps x 3 slices x 16 = 384 rows; K and V: 64 rows each; rows of 128 + 8 halves.
    with pytest.raises(ValueError, match=r"slices=3\) at head_dim 128 needs 139264 bytes of "
                                         r"shared memory; tensor-core configs may take at most "
                                         r"101376"):
        mma_forward_kernel_function(64, 8, 128, False, False, 3)
    with pytest.raises(ValueError, match="slices and warps must be >= 1"):
        mma_forward_kernel_function(32, 4, 64, False, False, 0)


def test_launch_refuses_a_strided_last_dimension():
    from numba_flash.backends.numba_mma_fwd import launch_mma_forward
    q = np.zeros((1, 16, 1, 128), np.uint16)[..., ::2]  # 64 columns, 4 bytes apart
    out = np.zeros((1, 16, 1, 64), np.uint16)
    lse = np.zeros((1, 1, 16), np.float32)
    with pytest.raises(ValueError, match="q: the last dimension must be contiguous; its stride "
                                         "is 4 bytes"):
        launch_mma_forward(q, out, out, out, lse, False, 0.1, False)
