"""The numba forward kernel under the CUDA simulator against the float64 reference."""
import numpy as np
import pytest
from error_rule import assert_within_rule
from inputs import random_qkv

import numba_flash
from numba_flash.reference import attention_forward
from numba_flash.spec import make_spec
from numba_flash.testing import max_error

# (batch, seqlen_q, seqlen_k, nheads, headdim): odd sizes, seqlen_q != seqlen_k both ways,
# lengths that are not multiples of any tile, head dims from every config bucket.
SHAPES = [
    (1, 1, 1, 1, 16),
    (2, 17, 17, 2, 32),
    (1, 37, 64, 1, 64),
    (1, 64, 37, 2, 64),
    (1, 70, 5, 1, 40),
    (1, 3, 45, 1, 100),
    (1, 33, 33, 1, 128),
    (1, 19, 23, 1, 256),
    (1, 9, 11, 1, 1),
]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_matches_reference(rng, poisoned_outputs, shape, causal, dtype):
    q, k, v = random_qkv(rng, *shape, dtype)
    scale = float(rng.uniform(0.05, 0.5))
    out, lse = numba_flash.forward(q, k, v, causal=causal, softmax_scale=scale, backend="numba")
    assert out.dtype == np.dtype(dtype) and lse.dtype == np.float32
    spec = make_spec(q, causal=causal, softmax_scale=scale)
    ref_out, ref_lse = attention_forward(np, q, k, v, spec, np.float64)
    base_out, base_lse = attention_forward(np, q, k, v, spec, np.dtype(dtype).type)
    assert_within_rule("out", out, base_out, ref_out, dtype)
    assert_within_rule("lse", lse, base_lse, ref_lse, dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_default_scale_is_inverse_sqrt_headdim(rng, causal):
    q, k, v = random_qkv(rng, 1, 20, 24, 1, 48, "float32")
    out, lse = numba_flash.forward(q, k, v, causal=causal, backend="numba")
    spec = make_spec(q, causal=causal, softmax_scale=48 ** -0.5)
    ref_out, ref_lse = attention_forward(np, q, k, v, spec, np.float64)
    assert np.abs(out - ref_out).max() < 1e-5
    assert np.abs(lse - ref_lse).max() < 1e-5


def test_rows_that_see_no_key_get_zero_and_minus_inf(rng, poisoned_outputs):
    # causal with seqlen_q > seqlen_k: query i sees keys j <= i - 30, so rows 0..29 see none.
    q, k, v = random_qkv(rng, 1, 40, 10, 2, 32, "float32")
    out, lse = numba_flash.forward(q, k, v, causal=True, backend="numba")
    assert np.all(out[:, :30] == 0.0)
    assert np.all(np.isneginf(lse[:, :, :30]))
    assert np.all(np.isfinite(lse[:, :, 30:])) and not np.isnan(out).any()
    spec = make_spec(q, causal=True, softmax_scale=32 ** -0.5)
    ref_out, _ = attention_forward(np, q, k, v, spec, np.float64)
    assert np.abs(out - ref_out).max() < 1e-5


def test_large_logits_do_not_overflow(rng):
    q, k, v = random_qkv(rng, 1, 21, 21, 1, 32, "float32")
    q *= 30.0
    k *= 30.0
    out, lse = numba_flash.forward(q, k, v, backend="numba")
    spec = make_spec(q, causal=False, softmax_scale=32 ** -0.5)
    ref_out, ref_lse = attention_forward(np, q, k, v, spec, np.float64)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    # Scores of ~1e3 carry float32 rounding of ~1e-4 into every exponent, and near-ties
    # between the top scores amplify it by how the dot products happen to round: the bound
    # is the plain float32 implementation's error, as everywhere, at its worst over a few
    # summation orders of the head dimension (one order alone is sometimes 20x luckier).
    orders = [np.arange(32)] + [rng.permutation(32) for _ in range(3)]
    baselines = [attention_forward(np, np.ascontiguousarray(q[..., p]),
                                   np.ascontiguousarray(k[..., p]), v, spec, np.float32)
                 for p in orders]
    base_out = max((b[0] for b in baselines), key=lambda b: max_error(b, ref_out))
    base_lse = max((b[1] for b in baselines), key=lambda b: max_error(b, ref_lse))
    assert_within_rule("out", out, base_out, ref_out, "float32")
    assert_within_rule("lse", lse, base_lse, ref_lse, "float32")
