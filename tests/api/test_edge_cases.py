"""Edge cases of the numba kernels (simulator): extreme values, NaN/inf, strided inputs."""
import numpy as np
import pytest
from error_rule import assert_within_rule
from inputs import random_qkv

import numba_flash
from numba_flash.reference import attention_backward, attention_forward
from numba_flash.spec import make_spec


def _check_forward(q, k, v, causal, dtype="float32"):
    scale = q.shape[-1] ** -0.5
    out, lse = numba_flash.forward(q, k, v, causal=causal, backend="numba")
    spec = make_spec(q, causal=causal, softmax_scale=scale)
    ref_out, ref_lse = attention_forward(np, q, k, v, spec, np.float64)
    base_out, base_lse = attention_forward(np, q, k, v, spec, np.dtype(dtype).type)
    assert_within_rule("out", out, base_out, ref_out, dtype)
    assert_within_rule("lse", lse, base_lse, ref_lse, dtype)
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
def test_very_large_logits(rng, causal):
    q, k, v = random_qkv(rng, 1, 19, 23, 1, 32, "float32")
    out, lse = _check_forward(q * 1e3, k * 1e3, v, causal)
    assert np.isfinite(out).all() and np.isfinite(lse).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN arithmetic
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nan_and_inf_propagate_like_the_reference(rng, where, value):
    q, k, v = random_qkv(rng, 1, 13, 17, 1, 16, "float32")
    arrays = {"q": q, "k": k, "v": v}
    arrays[where][0, 5, 0, 3] = value
    out, _ = _check_forward(arrays["q"], arrays["k"], arrays["v"], causal=False)
    assert not np.isfinite(out).all()  # it did reach the output


def test_seqlen_q_much_longer_than_seqlen_k_causal(rng):
    q, k, v = random_qkv(rng, 1, 64, 3, 1, 16, "float32")
    out, lse = _check_forward(q, k, v, causal=True)
    assert np.isneginf(lse[0, 0, :61]).all() and np.isfinite(lse[0, 0, 61:]).all()


def test_seqlen_k_much_longer_than_seqlen_q_causal(rng):
    q, k, v = random_qkv(rng, 1, 3, 70, 2, 16, "float32")
    _check_forward(q, k, v, causal=True)


def test_slices_of_a_packed_qkv_tensor(rng):
    qkv = rng.standard_normal((2, 21, 3, 2, 24)).astype("float32")
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.flags.c_contiguous
    _check_forward(q, k, v, causal=True)


def test_transposed_bhnd_views(rng):
    q, k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in
               random_qkv(rng, 1, 18, 26, 3, 16, "float32"))  # stored (B, H, N, D)
    views = [x.transpose(0, 2, 1, 3) for x in (q, k, v)]  # seen as (B, N, H, D)
    _check_forward(*views, causal=False)
    dout = rng.standard_normal(views[0].shape).astype("float32")
    out, lse = numba_flash.forward(*views, backend="numba")
    grads = numba_flash.backward(dout, *views, out, lse, backend="numba")
    refs = attention_backward(np, dout, *views, out, lse, make_spec(views[0]), np.float64)
    for got, ref in zip(grads, refs):
        assert np.abs(got - ref).max() < 1e-4
