"""The tensor-core forward kernel (backends/numba_mma_fwd.py) against the float64 reference:
under the simulator at small sizes, and with `-m gpu` on the GPU."""
import numpy as np
import pytest
from error_rule import assert_within_rule
from inputs import simulator_and_gpu_cases

from numba_flash.backends.numba_mma_fwd import launch_mma_forward
from numba_flash.config import MmaConfig
from numba_flash.standard_attention import attention_forward



def to_bf16_bits(x):
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF).astype(np.uint16)


def from_bf16_bits(bits):
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def encode(x, dtype):
    """(16-bit patterns, the float32 values they hold)."""
    if dtype == "float16":
        half = x.astype(np.float16)
        return half.view(np.uint16), half.astype(np.float32)
    bits = to_bf16_bits(x)
    return bits, from_bf16_bits(bits)


def decode(bits, dtype):
    return bits.view(np.float16).astype(np.float32) if dtype == "float16" else from_bf16_bits(bits)


def plain_baseline(q, k, v, causal, scale, dtype):
    """Standard attention as a 16-bit implementation computes it: float32 scores and softmax,
    P rounded to the 16-bit type before P·V, the output rounded."""
    s = np.einsum("bqhd,bkhd->bhqk", q, k).astype(np.float32) * np.float32(scale)
    if causal:
        nq, nk = q.shape[1], k.shape[1]
        s = np.where(np.arange(nk)[None] > np.arange(nq)[:, None] + nk - nq, -np.inf, s)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isneginf(m), 0, m))
    l = p.sum(-1, keepdims=True)
    p16 = decode(encode(p, dtype)[0], dtype)
    out = np.einsum("bhqk,bkhd->bqhd", p16, v) / np.where(l == 0, 1, l).transpose(0, 2, 1, 3)
    return decode(encode(out.astype(np.float32), dtype)[0], dtype)


SHAPES = [(1, 17, 17, 1, 16), (1, 37, 20, 2, 32), (1, 5, 40, 1, 128)]
GPU_SHAPES = [(2, 20, 45, 2, 64), (1, 70, 9, 2, 32), (1, 40, 80, 2, 128), (1, 33, 33, 2, 96)]


CASES = simulator_and_gpu_cases(SHAPES, GPU_SHAPES)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode, shape", CASES)
def test_mma_forward_matches_reference(rng, mode, shape, causal, dtype):
    batch, seqlen_q, seqlen_k, nheads, head_dim = shape
    if mode == "gpu":  # real sizes on the GPU
        seqlen_q, seqlen_k = 16 * seqlen_q + 3, 16 * seqlen_k + 5
    draw = lambda n: rng.standard_normal((batch, n, nheads, head_dim))  # noqa: E731
    (qb, q), (kb, k), (vb, v) = (encode(draw(n), dtype) for n in (seqlen_q, seqlen_k, seqlen_k))
    out = np.full(qb.shape, 0x7E00, np.uint16)  # NaN in float16 and a NaN-ish bf16 pattern
    lse = np.full((batch, nheads, seqlen_q), np.nan, np.float32)
    scale = head_dim ** -0.5
    # The simulator runs a small config (fewer Python threads); the GPU the real one.
    config = MmaConfig(block_n=32, warps=2) if mode == "simulator" else None
    launch_mma_forward(qb, kb, vb, out, lse, causal, scale, dtype == "bfloat16", config=config)
    ref_out, ref_lse = attention_forward(np, q, k, v, causal, scale, np.float64)
    base_out = plain_baseline(q, k, v, causal, scale, dtype)
    assert_within_rule("out", decode(out, dtype), base_out, ref_out, "float16")
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    assert np.abs(lse[finite] - ref_lse[finite]).max() < 1e-4 * max(1, np.abs(ref_lse[finite]).max())
