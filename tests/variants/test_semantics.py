"""What each variant means: the float64 reference (numba_flash/reference.py, the truth every
kernel is checked against) against a brute-force loop written from the API's own words, and
its backward against finite differences; the numpy backend serves every variant."""
import itertools
import math

import numpy as np
import pytest
from central_differences import assert_is_the_derivative

import numba_flash
from numba_flash.reference import attention_backward, attention_forward
from numba_flash.spec import make_spec

CASES = [  # (seqlen_q, seqlen_k, nheads, nheads_kv, options)
    (7, 9, 4, 2, dict(window_size=(2, 1))),
    (9, 6, 2, 1, dict(causal=True, window_size=(1, -1))),  # the first rows see no key
    (6, 6, 8, 1, dict(softcap=0.7)),
    (5, 11, 4, 4, dict(window_size=(-1, 3), softcap=2.5)),
    (8, 8, 2, 2, dict(causal=True, softcap=1.0, window_size=(30, 30))),  # wider than N
]


def brute_force(q, k, v, scale, causal=False, window_size=(-1, -1), softcap=0.0):
    """(out, lse) one query at a time, from forward's docstring."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    left, right = window_size
    right = 0 if causal else right
    out = np.zeros(q.shape)
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    for b, h, i in itertools.product(range(batch), range(nheads), range(seqlen_q)):
        hk = h // (nheads // nheads_kv)
        d = i + seqlen_k - seqlen_q
        keys = [j for j in range(seqlen_k)
                if (left == -1 or j >= d - left) and (right == -1 or j <= d + right)]
        if not keys:
            continue
        s = np.array([scale * q[b, i, h] @ k[b, j, hk] for j in keys])
        if softcap:
            s = softcap * np.tanh(s / softcap)
        w = np.exp(s - s.max())
        out[b, i, h] = (w / w.sum()) @ v[b, keys, hk]
        lse[b, h, i] = s.max() + math.log(w.sum())
    return out, lse


def _inputs(rng, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim=5):
    q = rng.standard_normal((2, seqlen_q, nheads, head_dim))
    k, v = (rng.standard_normal((2, seqlen_k, nheads_kv, head_dim)) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("seqlen_q, seqlen_k, nheads, nheads_kv, options", CASES)
def test_reference_is_the_documented_meaning(rng, seqlen_q, seqlen_k, nheads, nheads_kv,
                                             options):
    q, k, v = _inputs(rng, seqlen_q, seqlen_k, nheads, nheads_kv)
    spec = make_spec(q, k, softmax_scale=0.8, **options)
    out, lse = attention_forward(np, q, k, v, spec, np.float64)
    want_out, want_lse = brute_force(q, k, v, 0.8, **options)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-12)


@pytest.mark.parametrize("seqlen_q, seqlen_k, nheads, nheads_kv, options", CASES)
def test_reference_backward_is_the_derivative(rng, seqlen_q, seqlen_k, nheads, nheads_kv,
                                              options):
    """Central differences of sum(out · dout) at random entries of q, k, v."""
    q, k, v = _inputs(rng, seqlen_q, seqlen_k, nheads, nheads_kv)
    dout = rng.standard_normal(q.shape)
    spec = make_spec(q, k, softmax_scale=0.8, **options)
    out, lse = attention_forward(np, q, k, v, spec, np.float64)
    grads = attention_backward(np, dout, q, k, v, out, lse, spec, np.float64)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]  # dk, dv: k's heads

    def loss(*arrays):
        return float((attention_forward(np, *arrays, spec, np.float64)[0] * dout).sum())
    assert_is_the_derivative(rng, grads, loss, (q, k, v), samples=6)


def test_the_numpy_backend_serves_every_variant(rng):
    q, k, v = (x.astype(np.float32) for x in _inputs(rng, 9, 6, 4, 2))
    options = dict(causal=True, window_size=(2, -1), softcap=3.0)
    out, lse = numba_flash.forward(q, k, v, backend="numpy", **options)
    want_out, want_lse = brute_force(q.astype(np.float64), k.astype(np.float64),
                                     v.astype(np.float64), q.shape[-1] ** -0.5, **options)
    np.testing.assert_allclose(out, want_out, atol=1e-6)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    dq, dk, dv = numba_flash.backward(q, q, k, v, out, lse, backend="numpy", **options)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
