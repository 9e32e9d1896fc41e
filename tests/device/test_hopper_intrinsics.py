"""The Hopper intrinsics (wgmma from shared-memory descriptors and from registers, the
128-byte swizzle, mbarriers, cp.async to shared addresses, named barriers and the consumers'
turns, setmaxnreg) against NumPy: under the simulator (their twins) and, with `-m gpu`, on an
sm_90 GPU. Plus: each kernel compiles for sm_90a to the intended instructions, with no local
memory and no ptxas warning."""

import hopper_kernels as kernels
import numpy as np
import pytest
from numba import cuda
from ptx_cases import compile_cases
from test_intrinsics import _bits16, _from_bits16, a_fragments

from numba_flash.backends.numba.device.intrinsics import SIMULATED

MODES = ["simulator", pytest.param("gpu", marks=pytest.mark.gpu)]
SHARED = 40 * 1024  # dynamic shared memory of the product kernels (tiles + the alignment)


def _rounded(x, dtype):
    return _from_bits16(_bits16(x, dtype), dtype).reshape(x.shape)


def _needs_hopper(mode):
    if mode == "gpu" and cuda.get_current_device().compute_capability < (9, 0):
        pytest.skip("wgmma needs compute capability 9.0")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wgmma_scores_from_swizzled_k_major_tiles(rng, mode, dtype):
    _needs_hopper(mode)
    a = rng.standard_normal((64, kernels.D)).astype(np.float32)
    b = rng.standard_normal((kernels.N, kernels.D)).astype(np.float32)
    out = np.full((64, kernels.N), np.nan, np.float32)
    kernel = cuda.jit(kernels.make_scores_kernel(dtype == "bfloat16"))
    kernel[1, 128, 0, SHARED](_bits16(a, dtype).astype(np.uint16).reshape(a.shape),
                              _bits16(b, dtype).astype(np.uint16).reshape(b.shape), out)
    want = _rounded(a, dtype).astype(np.float64) @ _rounded(b, dtype).astype(np.float64).T
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wgmma_p_from_registers_times_mn_major_v(rng, mode, dtype):
    _needs_hopper(mode)
    p = rng.uniform(0, 1, (64, kernels.KEYS)).astype(np.float32)
    v = rng.standard_normal((kernels.KEYS, kernels.N)).astype(np.float32)
    p_bits = _bits16(p, dtype).reshape(p.shape)
    fragments = np.zeros((kernels.KEYS // 16, 128, 4), np.uint32)
    for kc in range(kernels.KEYS // 16):
        for warp in range(4):  # warp w's A fragments are rows 16w.. of the chunk
            fragments[kc, 32 * warp:32 * warp + 32] = a_fragments(
                p_bits[16 * warp:16 * warp + 16, 16 * kc:16 * kc + 16])
    out = np.full((64, kernels.N), np.nan, np.float32)
    kernel = cuda.jit(kernels.make_pv_kernel(dtype == "bfloat16"))
    kernel[1, 128, 0, SHARED](fragments, _bits16(v, dtype).astype(np.uint16).reshape(v.shape),
                              out)
    want = _rounded(p, dtype).astype(np.float64) @ _rounded(v, dtype).astype(np.float64)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_mbarrier_pipeline_streams_every_tile(rng, mode):
    _needs_hopper(mode)
    tiles = 5  # odd, and more than twice the stages: phases of both parities, stages reused
    src = rng.integers(0, 2**16, (tiles, kernels.TILE_ROWS, 1, kernels.TILE_COLS)).astype(
        np.uint16)
    out = np.zeros_like(src)
    shared = kernels.STAGES * kernels.TILE_ROWS * kernels.TILE_COLS * 2 + 128
    options = {} if SIMULATED else {"launch_bounds": (256, 1)}
    cuda.jit(kernels.pipeline_kernel, **options)[1, 256, 0, shared](src, out)
    assert np.array_equal(out, src)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("consumers", [2, 3])
def test_warpgroups_take_turns(mode, consumers):
    """The ping-pong's named barriers pass the turn round the warpgroups, consumer 0 first,
    and leave no arrival unmatched (a second launch on the same barriers runs the same)."""
    _needs_hopper(mode)
    for _ in range(2):
        log, count = np.full(5 * consumers, -1, np.int32), np.zeros(1, np.int32)
        cuda.jit(kernels.turns_kernel)[1, 128 * consumers](log, count)
        assert count[0] == 5 * consumers and log.tolist() == list(range(consumers)) * 5


@pytest.mark.skipif(not SIMULATED, reason="on a GPU this kernel is a race")
def test_twin_wgmma_reads_shared_memory_at_the_wait(rng):
    """The simulated product reads its operands when a wait covers it, and leaves the
    accumulator alone until then, as the hardware may: a kernel that overwrites a stage
    before waiting for the products that read it gets garbage under the simulator too."""
    a, b, b_later = (rng.standard_normal(shape).astype(np.float32) for shape in
                     ((64, kernels.D), (kernels.N, kernels.D), (kernels.N, kernels.D)))
    bits = [_bits16(x, "float16").astype(np.uint16).reshape(x.shape) for x in (a, b, b_later)]
    before, out = (np.full((64, kernels.N), np.nan, np.float32) for _ in range(2))
    cuda.jit(kernels.late_operand_kernel)[1, 128, 0, SHARED](*bits, before, out)
    assert np.all(before == -1.0)
    rounded = [_rounded(x[:, :16], "float16").astype(np.float64) for x in (a, b_later)]
    np.testing.assert_allclose(out, rounded[0] @ rounded[1].T, rtol=1e-5, atol=1e-4)


def test_hopper_intrinsics_compile_for_sm_90a():
    for name, _, missing, local, target in compile_cases(kernels, [(9, 0, "a")]):
        assert not missing, f"{name}: PTX lacks {missing}"
        assert not local, f"{name}: uses local memory"
        assert target.startswith(".target sm_90a"), f"{name}: not compiled for sm_90a"
