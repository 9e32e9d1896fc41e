"""The numba backward kernels under the CUDA simulator against the float64 reference."""
import numpy as np
import pytest
from error_rule import assert_within_rule
from inputs import random_qkv

import numba_flash
from numba_flash.reference import attention_backward, attention_forward
from numba_flash.spec import make_spec

SHAPES = [
    (1, 1, 1, 1, 8),
    (2, 17, 17, 1, 32),
    (1, 37, 64, 1, 64),
    (1, 64, 37, 2, 64),
    (1, 29, 18, 1, 96),
    (1, 21, 21, 1, 128),
    (1, 13, 9, 1, 256),
]


def _forward_for_backward(q, k, v, causal, scale, dtype):
    """out, lse from the float64 reference, stored like forward would return them."""
    spec = make_spec(q, causal=causal, softmax_scale=scale)
    out, lse = attention_forward(np, q, k, v, spec, np.float64)
    return np.ascontiguousarray(out, dtype), np.ascontiguousarray(lse, np.float32)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_backward_matches_reference(rng, poisoned_outputs, shape, causal, dtype):
    q, k, v = random_qkv(rng, *shape, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    scale = float(rng.uniform(0.05, 0.5))
    out, lse = _forward_for_backward(q, k, v, causal, scale, dtype)
    grads = numba_flash.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale,
                                 backend="numba")
    spec = make_spec(q, causal=causal, softmax_scale=scale)
    refs = attention_backward(np, dout, q, k, v, out, lse, spec, np.float64)
    bases = attention_backward(np, dout, q, k, v, out, lse, spec, np.dtype(dtype).type)
    for name, got, base, ref, x in zip(("dq", "dk", "dv"), grads, bases, refs, (q, k, v)):
        assert got.shape == x.shape and got.dtype == np.dtype(dtype)
        assert_within_rule(name, got, base, ref, dtype)


def test_forward_then_backward_with_numba_outputs(rng):
    q, k, v = random_qkv(rng, 1, 30, 26, 2, 64, "float32")
    dout = rng.standard_normal(q.shape).astype("float32")
    out, lse = numba_flash.forward(q, k, v, causal=True, backend="numba")
    dq, dk, dv = numba_flash.backward(dout, q, k, v, out, lse, causal=True, backend="numba")
    spec = make_spec(q, causal=True, softmax_scale=64 ** -0.5)
    refs = attention_backward(np, dout, q, k, v, *attention_forward(np, q, k, v, spec, np.float64),
                              spec, np.float64)
    for got, ref in zip((dq, dk, dv), refs):
        assert np.abs(got - ref).max() < 1e-4


def test_rows_that_see_no_key_get_zero_gradients(rng, poisoned_outputs):
    q, k, v = random_qkv(rng, 1, 40, 10, 1, 32, "float32")
    dout = rng.standard_normal(q.shape).astype("float32")
    out, lse = _forward_for_backward(q, k, v, True, 0.2, "float32")
    assert np.isneginf(lse[:, :, :30]).all()
    dq, dk, dv = numba_flash.backward(dout, q, k, v, out, lse, causal=True, softmax_scale=0.2,
                                      backend="numba")
    assert np.all(dq[:, :30] == 0.0)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    spec = make_spec(q, causal=True, softmax_scale=0.2)
    refs = attention_backward(np, dout, q, k, v, out, lse, spec, np.float64)
    for got, ref in zip((dq, dk, dv), refs):
        assert np.abs(got - ref).max() < 1e-4


def test_backward_is_bitwise_deterministic(rng):
    q, k, v = random_qkv(rng, 1, 33, 40, 1, 32, "float32")
    dout = rng.standard_normal(q.shape).astype("float32")
    out, lse = _forward_for_backward(q, k, v, False, 0.3, "float32")
    first = numba_flash.backward(dout, q, k, v, out, lse, softmax_scale=0.3, backend="numba")
    second = numba_flash.backward(dout, q, k, v, out, lse, softmax_scale=0.3, backend="numba")
    for a, b in zip(first, second):
        assert np.array_equal(a, b)
