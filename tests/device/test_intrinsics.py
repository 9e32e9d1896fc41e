"""The tensor-core and warp intrinsics against NumPy: under the simulator (their Python twins)
and, with `-m gpu`, on the GPU (the PTX). Plus: each compiles to the intended PTX instructions
for sm_80 and sm_90."""

import intrinsic_kernels as kernels
import numpy as np
import pytest
from numba import cuda
from ptx_cases import compile_cases

MODES = ["simulator", pytest.param("gpu", marks=pytest.mark.gpu)]


def _bits16(x, dtype):
    """16-bit patterns of float32 values rounded to float16 or bfloat16 (round to nearest even)."""
    x = np.asarray(x, np.float32)
    if dtype == "float16":
        return x.astype(np.float16).view(np.uint16).astype(np.uint32)
    bits = x.view(np.uint32).astype(np.uint64)
    return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF).astype(np.uint32)


def _from_bits16(bits, dtype):
    bits = np.asarray(bits, np.uint32)
    if dtype == "float16":
        return bits.astype(np.uint16).view(np.float16).astype(np.float32)
    return (bits << 16).astype(np.uint32).view(np.float32)


def _pair(bits, i0, i1):
    return bits[i0] | (bits[i1] << 16)


def a_fragments(a_bits):
    """The mma A fragments (32 lanes x 4 words) of a 16x16 matrix of 16-bit patterns."""
    frags = np.zeros((32, 4), np.uint32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        frags[lane] = [a_bits[g, 2 * t] | (a_bits[g, 2 * t + 1] << 16),
                       a_bits[g + 8, 2 * t] | (a_bits[g + 8, 2 * t + 1] << 16),
                       a_bits[g, 2 * t + 8] | (a_bits[g, 2 * t + 9] << 16),
                       a_bits[g + 8, 2 * t + 8] | (a_bits[g + 8, 2 * t + 9] << 16)]
    return frags


def b_fragments(b_bits):
    """The mma B fragments (32 lanes x 2 words) of a 16x8 (K x N) matrix."""
    frags = np.zeros((32, 2), np.uint32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        frags[lane] = [b_bits[2 * t, g] | (b_bits[2 * t + 1, g] << 16),
                       b_bits[2 * t + 8, g] | (b_bits[2 * t + 9, g] << 16)]
    return frags


def c_fragments(c):
    frags = np.zeros((32, 4), np.float32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        frags[lane] = [c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]]
    return frags


def c_from_fragments(frags):
    c = np.zeros((16, 8), np.float32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1] = frags[lane]
    return c


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mma_m16n8k16(rng, mode, dtype):
    warps = 2  # two warps, two different products: lanes must not mix across warps
    a = rng.standard_normal((warps, 16, 16)).astype(np.float32)
    b = rng.standard_normal((warps, 16, 8)).astype(np.float32)
    c = rng.standard_normal((warps, 16, 8)).astype(np.float32)
    a_bits, b_bits = _bits16(a, dtype), _bits16(b, dtype)
    a_frags = np.stack([a_fragments(a_bits[w]) for w in range(warps)])
    b_frags = np.stack([b_fragments(b_bits[w]) for w in range(warps)])
    c_frags = np.stack([c_fragments(c[w]) for w in range(warps)])
    d_frags = np.full((warps, 32, 4), np.nan, np.float32)
    kernel = kernels.mma_f16_kernel if dtype == "float16" else kernels.mma_bf16_kernel
    cuda.jit(kernel)[1, 32 * warps](a_frags, b_frags, c_frags, d_frags)
    for w in range(warps):
        expected = (_from_bits16(a_bits[w], dtype).astype(np.float64) @
                    _from_bits16(b_bits[w], dtype).astype(np.float64) + c[w])
        got = c_from_fragments(d_frags[w])
        assert np.abs(got - expected).max() < 1e-4 * max(1.0, np.abs(expected).max())


@pytest.mark.parametrize("mode", MODES)
def test_ldmatrix_gives_mma_fragments(rng, mode):
    matrix = rng.standard_normal((16, 16)).astype(np.float16)
    regs = np.zeros((32, 4), np.uint32)
    regs_trans = np.zeros((32, 4), np.uint32)
    cuda.jit(kernels.ldmatrix_kernel)[1, 32](matrix, regs, regs_trans)
    bits = matrix.view(np.uint16).astype(np.uint32)
    # Plain: the A fragments of the 16x16 tile.
    assert np.array_equal(regs, a_fragments(bits))
    # .trans: words 0, 1 are the B fragments of columns 0..7 (K = tile rows), words 2, 3 those
    # of columns 8..15: how P·V reads V stored [key][headdim].
    assert np.array_equal(regs_trans[:, 0:2], b_fragments(bits[:, 0:8]))
    assert np.array_equal(regs_trans[:, 2:4], b_fragments(bits[:, 8:16]))


@pytest.mark.parametrize("mode", MODES)
def test_ldmatrix_at_an_address_plus_offset(rng, mode):
    matrix = rng.standard_normal((32, 24)).astype(np.float16)
    regs = np.zeros((2, 32, 4), np.uint32)
    regs_trans = np.zeros((2, 32, 4), np.uint32)
    cuda.jit(kernels.ldmatrix_at_kernel)[1, 32](matrix, regs, regs_trans)
    for it in range(2):
        bits = matrix[16 * it:16 * it + 16, 8 * it:8 * it + 16].view(np.uint16).astype(np.uint32)
        assert np.array_equal(regs[it], a_fragments(bits))
        assert np.array_equal(regs_trans[it, :, 0:2], b_fragments(bits[:, 0:8]))
        assert np.array_equal(regs_trans[it, :, 2:4], b_fragments(bits[:, 8:16]))


@pytest.mark.parametrize("mode", MODES)
def test_cp_async_copies_and_zero_fills(rng, mode):
    src = rng.standard_normal((1, 16, 1, 16)).astype(np.float16)
    dst = np.full((16, 16), np.nan, np.float16)
    cuda.jit(kernels.cp_async_kernel)[1, 32](src, dst, 11)
    assert np.array_equal(dst[:11], src[0, :11, 0])
    assert np.all(dst[11:] == 0)


@pytest.mark.parametrize("mode", MODES)
def test_shfl_xor_butterfly_sum(rng, mode):
    values = rng.standard_normal(64).astype(np.float32)
    sums = np.full(64, np.nan, np.float32)
    cuda.jit(kernels.shfl_sum_kernel)[1, 64](values, sums)
    for w in range(2):
        warp = values[32 * w:32 * w + 32].astype(np.float64)
        # a 5-level float32 tree is within 5 unit roundoffs of sum |x| (a relative tolerance
        # on the total fails by chance when the values cancel)
        bound = 5 * 2.0 ** -24 * np.abs(warp).sum()
        assert np.abs(sums[32 * w:32 * w + 32] - warp.sum()).max() <= bound


@pytest.mark.parametrize("mode", MODES)
def test_pack_and_unpack(rng, mode):
    x = (rng.standard_normal((32, 2)) * 10).astype(np.float32)
    f16, bf16 = np.zeros(32, np.uint32), np.zeros(32, np.uint32)
    f16_back = np.full((32, 2), np.nan, np.float32)
    bf16_back = np.full((32, 2), np.nan, np.float32)
    cuda.jit(kernels.pack_kernel)[1, 32](x, f16, bf16, f16_back, bf16_back)
    for words, back, dtype in ((f16, f16_back, "float16"), (bf16, bf16_back, "bfloat16")):
        bits = _bits16(x, dtype)
        assert np.array_equal(words, bits[:, 0] | (bits[:, 1] << 16)), dtype
        assert np.array_equal(back, _from_bits16(bits, dtype)), dtype


@pytest.mark.parametrize("mode", MODES)
def test_float32_from_bits_is_the_bit_pattern(rng, mode):
    """float32_from_bits and its inverse bits_of_float32."""
    x = np.concatenate([rng.standard_normal(28) * 1e3, [0.0, -0.0, np.inf, -np.inf]])
    bits = x.astype(np.float32).view(np.uint32)
    y = np.full(32, np.nan, np.float32)
    back = np.zeros(32, np.uint32)
    cuda.jit(kernels.bitcast_kernel)[1, 32](bits, y, back)
    assert np.array_equal(y.view(np.uint32), bits)
    assert np.array_equal(back, bits)


@pytest.mark.parametrize("mode", MODES)
def test_exp2_flushes_like_ex2_approx_ftz(rng, mode):
    x = np.concatenate([rng.uniform(-30, 30, 28), [0.0, -np.inf, -130.0, -200.0]])
    x = x.astype(np.float32)
    y = np.full(32, np.nan, np.float32)
    cuda.jit(kernels.exp2_kernel)[1, 32](x, y)
    want = np.exp2(x.astype(np.float64))
    assert np.allclose(y[:29], want[:29], rtol=1e-6, atol=0)  # ex2.approx: 2 ulp
    assert np.array_equal(y[29:], [0.0, 0.0, 0.0])  # -inf, and results below 2**-126: zero


@pytest.mark.parametrize("mode", MODES)
def test_reciprocal_is_within_an_ulp_and_flushes_like_rcp_approx_ftz(rng, mode):
    x = np.concatenate([rng.uniform(1, 1e6, 14), -rng.uniform(1e-3, 1e3, 14),
                        [1.0, np.inf, 3e38, -np.inf]]).astype(np.float32)
    y = np.full(32, np.nan, np.float32)
    cuda.jit(kernels.reciprocal_kernel)[1, 32](x, y)
    want = 1.0 / x[:29].astype(np.float64)
    assert np.all(np.abs(y[:29] - want) <= np.spacing(np.abs(want).astype(np.float32)))
    assert np.array_equal(y[29:], [0.0, 0.0, 0.0])  # 1/inf; 1/3e38 < 2**-126: flushed
    assert np.array_equal(np.signbit(y[29:]), [False, False, True])


@pytest.mark.parametrize("mode", MODES)
def test_shared_tile_views_dynamic_shared_memory(rng, mode):
    halves = rng.integers(0, 2**16, (4, 24)).astype(np.uint16)
    words = rng.standard_normal((2, 8)).astype(np.float32)
    halves_out = np.zeros((4, 24), np.uint16)
    words_out = np.full((2, 8), np.nan, np.float32)
    cuda.jit(kernels.shared_tile_kernel)[1, 4, 0, 256](halves, words, halves_out, words_out)
    assert np.array_equal(halves_out, halves)
    assert np.array_equal(words_out, words)


def test_intrinsics_compile_to_the_intended_ptx():
    for name, cc, missing, local, _ in compile_cases(kernels, [(8, 0), (9, 0)]):
        assert not missing, f"{name} sm_{cc[0]}{cc[1]}: PTX lacks {missing}"
        assert not local, f"{name} sm_{cc[0]}{cc[1]}: uses local memory"


def test_twins_refuse_misaligned_addresses():
    """The hardware requires 16-byte alignment for ldmatrix and cp.async; so do the twins."""
    from numba_flash.backends.numba.device.intrinsics import cp_async, ldmatrix, shared
    tile = np.zeros((16, 16), np.float16)
    src = np.zeros((1, 16, 1, 16), np.float16)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        cp_async._cp_async_16_python(tile, 0, 4, src, 0, 0, 0, 0, 16)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        cp_async._cp_async_16_python(tile, 0, 0, src, 0, 0, 0, 3, 16)
    cp_async._cp_async_16_python(tile, 0, 8, src + 1, 0, 0, 0, 8, 6)  # 3 halves, then zeros
    cp_async._cp_async_commit_python()
    cp_async._cp_async_wait_python(0)
    assert np.array_equal(tile[0, 8:16], [1, 1, 1, 0, 0, 0, 0, 0])
    base = shared._shared_address_python(tile, 0, 8)
    ldmatrix_at = ldmatrix._ldmatrix_at_python(transpose=False)
    for offset in (2, -32, 2 * 16 * 16):  # mid-row; before the tile; past its last row
        with pytest.raises(ValueError, match="is not the start of 8 elements of a row"):
            ldmatrix_at(base, offset)


def test_cp_async_twin_lands_copies_only_at_the_wait_that_covers_them():
    """Until a wait covers a copy its 16 bytes hold NaN, so a kernel that reads a tile too
    early fails under the simulator as it could on the GPU; wait(n) leaves the newest n
    committed groups in flight, and copies not yet committed are not waited for."""
    from numba_flash.backends.numba.device.intrinsics import cp_async
    tile = np.zeros((3, 4), np.float32)
    src = np.arange(1, 13, dtype=np.float32).reshape(1, 3, 1, 4)
    cp_async._cp_async_16_python(tile, 0, 0, src, 0, 0, 0, 0, 16)
    cp_async._cp_async_commit_python()
    cp_async._cp_async_16_python(tile, 1, 0, src, 0, 1, 0, 0, 16)
    cp_async._cp_async_commit_python()
    cp_async._cp_async_16_python(tile, 2, 0, src, 0, 2, 0, 0, 16)  # not committed
    assert np.isnan(tile).all()
    cp_async._cp_async_wait_python(1)
    assert np.array_equal(tile[0], [1, 2, 3, 4]) and np.isnan(tile[1:]).all()
    cp_async._cp_async_wait_python(0)
    assert np.array_equal(tile[1], [5, 6, 7, 8]) and np.isnan(tile[2]).all()
    cp_async._cp_async_commit_python()
    cp_async._cp_async_wait_python(0)
    assert np.array_equal(tile[2], [9, 10, 11, 12])
