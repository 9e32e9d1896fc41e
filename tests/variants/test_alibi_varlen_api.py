"""ALiBi and varlen (packed sequences) at the API: each bad argument gets a TypeError or
ValueError naming it before any backend is chosen; ALiBi is the bias added to the scores of a
hand-written float64 softmax, and its backward the derivative; a varlen call is the dense call
on each sequence alone; the numba-simt kernels agree with the numpy backend on one case."""
import numpy as np
import pytest
from central_differences import assert_is_the_derivative

import numba_flash
from numba_flash import registry

NHEADS, NHEADS_KV, HEAD_DIM = 4, 2, 8
LENGTHS_Q, LENGTHS_K = (5, 0, 4, 7), (6, 3, 0, 7)  # a sequence without queries, one without keys


@pytest.fixture
def no_backend(monkeypatch):
    """Fail the test if a backend is chosen (the error must come first)."""
    def refuse(*args):
        raise AssertionError("a backend was chosen for a call with a bad argument")
    monkeypatch.setattr(registry, "resolve", refuse)


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _dense(rng, batch=2, seqlen_q=5, seqlen_k=6, dtype=np.float32):
    q = rng.standard_normal((batch, seqlen_q, NHEADS, HEAD_DIM)).astype(dtype)
    k, v = (rng.standard_normal((batch, seqlen_k, NHEADS_KV, HEAD_DIM)).astype(dtype)
            for _ in range(2))
    return q, k, v


def _packed(rng, lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K, nheads=NHEADS, nheads_kv=NHEADS_KV,
            head_dim=HEAD_DIM, dtype=np.float32):
    q = rng.standard_normal((sum(lengths_q), nheads, head_dim)).astype(dtype)
    k, v = (rng.standard_normal((sum(lengths_k), nheads_kv, head_dim)).astype(dtype)
            for _ in range(2))
    return q, k, v


# ---- 1. bad input: named, before any backend ---------------------------------------------

SLOPE_SHAPE = (r"alibi_slopes must have shape \(nheads,\) = \(4,\) or \(batch, nheads\) = "
               r"\(2, 4\); got ")
BAD_SLOPES = [  # (slopes, error, message) for batch 2, nheads 4
    (np.ones(3, np.float32), ValueError, SLOPE_SHAPE + r"\(3,?\)"),
    (np.ones((4, 2), np.float32), ValueError, SLOPE_SHAPE + r"\(4, 2\)"),
    (np.ones((3, 4), np.float32), ValueError, SLOPE_SHAPE + r"\(3, 4\)"),
    (np.ones((2, 4, 1), np.float32), ValueError, SLOPE_SHAPE + r"\(2, 4, 1\)"),
    (np.ones((1, 4), np.float32), ValueError, SLOPE_SHAPE + r"\(1, 4\)"),
    (np.array(0.5, np.float32), ValueError, SLOPE_SHAPE + r"\(\)"),
    (np.ones(4, np.float64), TypeError, "alibi_slopes must be float32; got float64"),
    (np.ones((2, 4), np.float16), TypeError, "alibi_slopes must be float32; got float16"),
    (np.ones(4, np.int32), TypeError, "alibi_slopes must be float32; got int32"),
    ([0.5] * 4, TypeError, r"alibi_slopes must be an array \(float32, \(nheads,\) or \(batch, "
                           r"nheads\)\); got list"),
    (0.5, TypeError, "alibi_slopes must be an array .*; got float"),
    (np.float32(0.5), TypeError, "alibi_slopes must be an array .*; got float32"),
    ("0.5", TypeError, "alibi_slopes must be an array .*; got str"),
]


@pytest.mark.parametrize("slopes, error, message", BAD_SLOPES)
def test_bad_alibi_slopes_are_named_before_any_backend_runs(rng, no_backend, slopes, error,
                                                            message):
    q, k, v = _dense(rng)
    with pytest.raises(error, match=message):
        numba_flash.forward(q, k, v, alibi_slopes=slopes)
    with pytest.raises(error, match=message):
        numba_flash.attention(q, k, v, alibi_slopes=slopes, causal=True)
    lse = np.zeros((2, NHEADS, 5), np.float32)
    with pytest.raises(error, match=message):
        numba_flash.backward(q, q, k, v, q, lse, alibi_slopes=slopes)


def _varlen_calls(q, k, v, cu_q, cu_k, max_q, max_k, **options):
    """forward_varlen and backward_varlen with these arguments, as functions of no argument,
    so that the caller's pytest.raises wraps each call alone."""
    out = np.zeros_like(q)
    lse = options.pop("lse", np.zeros((NHEADS, 16), np.float32))
    yield lambda: numba_flash.forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **options)
    yield lambda: numba_flash.backward_varlen(out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                                              **options)


CU_Q, CU_K = _cu(LENGTHS_Q), _cu(LENGTHS_K)  # (0, 5, 5, 9, 16), (0, 6, 9, 9, 16)
BAD_VARLEN = [  # (changes to the good call, error, message)
    (dict(cu_q=CU_Q.astype(np.int64)), TypeError, "cu_seqlens_q must be int32; got int64"),
    (dict(cu_k=CU_K.astype(np.uint32)), TypeError, "cu_seqlens_k must be int32; got uint32"),
    (dict(cu_q=CU_Q.astype(np.float32)), TypeError, "cu_seqlens_q must be int32; got float32"),
    (dict(cu_q=list(CU_Q)), TypeError,
     r"cu_seqlens_q must be an int32 array of shape \(batch \+ 1,\); got list"),
    (dict(cu_k=None), TypeError,
     r"cu_seqlens_k must be an int32 array of shape \(batch \+ 1,\); got NoneType"),
    (dict(cu_q=CU_Q[None]), ValueError,
     r"cu_seqlens_q must have shape \(batch \+ 1,\) with batch >= 1; got \(1, 5\)"),
    (dict(cu_k=CU_K.reshape(5, 1)), ValueError,
     r"cu_seqlens_k must have shape \(batch \+ 1,\) with batch >= 1; got \(5, 1\)"),
    (dict(cu_q=np.array([16], np.int32), cu_k=np.array([16], np.int32)), ValueError,
     r"cu_seqlens_q must have shape \(batch \+ 1,\) with batch >= 1; got \(1,?\)"),
    (dict(cu_q=np.zeros(0, np.int32)), ValueError,
     r"cu_seqlens_q must have shape \(batch \+ 1,\) with batch >= 1; got \(0,?\)"),
    (dict(cu_q=np.array([1, 5, 5, 9, 16], np.int32)), ValueError,
     "cu_seqlens_q must start at 0; got 1"),
    (dict(cu_k=np.array([-1, 6, 9, 9, 16], np.int32)), ValueError,
     "cu_seqlens_k must start at 0; got -1"),
    (dict(cu_q=np.array([0, 5, 3, 9, 16], np.int32)), ValueError,
     "cu_seqlens_q must be non-decreasing; got 5 then 3 at positions 1, 2"),
    (dict(cu_k=np.array([0, 6, 9, 9, 8, 16], np.int32)), ValueError,
     "cu_seqlens_k must be non-decreasing; got 9 then 8 at positions 3, 4"),
    (dict(cu_q=np.array([0, 5, 5, 9, 15], np.int32)), ValueError,
     "cu_seqlens_q must end at the total number of tokens, 16; got 15"),
    (dict(cu_k=np.array([0, 6, 9, 9, 17], np.int32), max_k=8), ValueError,
     "cu_seqlens_k must end at the total number of tokens, 16; got 17"),
    (dict(cu_k=np.array([0, 6, 16], np.int32), max_k=10), ValueError,
     r"cu_seqlens_q and cu_seqlens_k must have the same length \(batch \+ 1\); got 5 and 3"),
    (dict(cu_q=np.array([0, 16], np.int32), max_q=16), ValueError,
     r"cu_seqlens_q and cu_seqlens_k must have the same length \(batch \+ 1\); got 2 and 5"),
    (dict(max_q=6), ValueError,
     "max_seqlen_q = 6 is less than the longest sequence in cu_seqlens_q, 7"),
    (dict(max_k=5), ValueError,
     "max_seqlen_k = 5 is less than the longest sequence in cu_seqlens_k, 7"),
    (dict(max_q=7.0), TypeError, r"max_seqlen_q must be an int >= 1 .*; got 7\.0"),
    (dict(max_k="7"), TypeError, r"max_seqlen_k must be an int >= 1 .*; got '7'"),
    (dict(max_q=None), TypeError, "max_seqlen_q must be an int >= 1 .*; got None"),
    (dict(max_q=True), TypeError, "max_seqlen_q must be an int >= 1 .*; got True"),
    (dict(max_k=False), TypeError, "max_seqlen_k must be an int >= 1 .*; got False"),
    (dict(max_q=0), ValueError, "max_seqlen_q must be an int >= 1 .*; got 0"),
    (dict(max_k=-3), ValueError, "max_seqlen_k must be an int >= 1 .*; got -3"),
    (dict(alibi_slopes=np.ones((5, NHEADS), np.float32)), ValueError,
     r"alibi_slopes must have shape \(nheads,\) = \(4,\) or \(batch, nheads\) = \(4, 4\); "
     r"got \(5, 4\)"),
    (dict(alibi_slopes=np.ones((16, NHEADS), np.float32)), ValueError,  # not total_q
     r"alibi_slopes must have shape .* = \(4, 4\); got \(16, 4\)"),
    (dict(alibi_slopes=np.ones(NHEADS, np.float64)), TypeError,
     "alibi_slopes must be float32; got float64"),
    (dict(alibi_slopes=np.ones((4, NHEADS), np.int32)), TypeError,
     "alibi_slopes must be float32; got int32"),
    (dict(alibi_slopes=(0.5,) * NHEADS), TypeError,
     "alibi_slopes must be an array .*; got tuple"),
    (dict(window_size=(-2, 1)), ValueError, r"window_size must be a pair of ints \(left, right\)"),
    (dict(softcap=-1.0), ValueError, "softcap must be a finite number >= 0"),
]


@pytest.mark.parametrize("changes, error, message", BAD_VARLEN)
def test_bad_varlen_arguments_are_named_before_any_backend_runs(rng, no_backend, changes, error,
                                                                message):
    q, k, v = _packed(rng)
    arguments = dict(cu_q=CU_Q, cu_k=CU_K, max_q=7, max_k=7)
    arguments.update(changes)
    for call in _varlen_calls(q, k, v, **arguments):
        with pytest.raises(error, match=message):
            call()


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("rank", [2, 4])
def test_varlen_arrays_must_be_3d(rng, no_backend, which, rank):
    arrays = dict(zip("qkv", _packed(rng)))
    x = arrays[which]
    arrays[which] = x[None] if rank == 4 else x.reshape(x.shape[0], -1)
    shape = ", ".join(str(s) for s in arrays[which].shape)
    message = (rf"{which} must be 3-D \(total, nheads, headdim\); got shape \({shape}\)")
    for call in _varlen_calls(arrays["q"], arrays["k"], arrays["v"], CU_Q, CU_K, 7, 7):
        with pytest.raises(ValueError, match=message):
            call()


def test_dense_calls_take_no_packed_arrays(rng, no_backend):
    q, k, v = _packed(rng)
    with pytest.raises(ValueError, match=r"q must be 4-D \(batch, seqlen, nheads, headdim\); "
                                         r"got shape \(16, 4, 8\)"):
        numba_flash.forward(q, k, v)


@pytest.mark.parametrize("lse_shape", [(1, NHEADS, 16), (16, NHEADS), (NHEADS, 15),
                                       (NHEADS, 16, 1), (NHEADS * 16,)])
def test_backward_varlen_takes_the_packed_lse(rng, no_backend, lse_shape):
    q, k, v = _packed(rng)
    lse = np.zeros(lse_shape, np.float32)
    got = ", ".join(str(s) for s in lse_shape) + ("(,)?" if len(lse_shape) == 1 else "")
    message = (rf"lse must have shape \(nheads, total_q\) = \(4, 16\); got \({got}\)")
    with pytest.raises(ValueError, match=message):
        numba_flash.backward_varlen(q, q, k, v, q, lse, CU_Q, CU_K, 7, 7)
    with pytest.raises(TypeError, match="lse must be float32"):
        numba_flash.backward_varlen(q, q, k, v, q, np.zeros((NHEADS, 16)), CU_Q, CU_K, 7, 7)


def test_host_cu_seqlens_beside_gpu_arrays_are_checked_then_copied_once(monkeypatch):
    """With q on a GPU (stood in for here), host cu_seqlens are checked as arrays and copied
    there, one copy where q's and k's are one array, their values kept for the value checks
    (a copy: the caller may change its array); a bad one is refused before anything is
    copied. (The
    GPU suite runs the calls: test_gpu_variants.py.)"""
    from numba_flash import _arrays, _checks
    copies = []
    monkeypatch.setattr(_arrays, "is_device_kind", lambda kind: True)
    monkeypatch.setattr(_arrays, "device_copy_like",
                        lambda values, ref: copies.append(values.copy()) or object())
    q = np.zeros((16, NHEADS, HEAD_DIM), np.float32)
    cu = CU_Q.copy()
    cu_q, cu_k, known = _checks.offsets_to_device(q, cu, cu)
    assert len(copies) == 1 and cu_q is cu_k and not isinstance(cu_q, np.ndarray)
    cu[1] = 3
    assert known[0] is known[1] and np.array_equal(known[0], CU_Q)
    _, _, known = _checks.offsets_to_device(q, CU_Q, CU_K)
    assert len(copies) == 3 and np.array_equal(known[1], CU_K)
    with pytest.raises(TypeError, match="cu_seqlens_k must be int32; got int64"):
        _checks.offsets_to_device(q, CU_Q, CU_K.astype(np.int64))
    assert len(copies) == 3


def test_good_varlen_arguments_pass_the_checks(rng):
    """The checks above are not refusing everything: numpy ints and spare max_seqlen pass."""
    q, k, v = _packed(rng)
    out, lse = numba_flash.forward_varlen(q, k, v, CU_Q, CU_K, np.int64(7), 100,
                                          alibi_slopes=np.ones(NHEADS, np.float32),
                                          backend="numpy")
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (NHEADS, 16) and lse.dtype == np.float32
    grads = numba_flash.backward_varlen(q, q, k, v, out, lse, CU_Q, CU_K, 7, np.int32(7),
                                        backend="numpy")
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


# ---- 2. ALiBi's meaning ------------------------------------------------------------------

def hand_attention(q, k, v, scale, slopes, causal=False, softcap=0.0):
    """(out, lse) in float64: softmax over the keys of scale · q·k (softcapped), plus
    -slope · |i + seqlen_k - seqlen_q - j|, causal bottom-right aligned."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, group = k.shape[1], nheads // k.shape[2]
    k, v = (np.repeat(x, group, axis=2) for x in (k, v))
    s = np.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    i, j = np.arange(seqlen_q)[:, None], np.arange(seqlen_k)[None, :]
    diagonal = i + seqlen_k - seqlen_q
    slopes = np.asarray(slopes, np.float64).reshape(-1, nheads)[:, :, None, None]
    s = s - slopes * np.abs(diagonal - j)
    if causal:
        s = np.where(j <= diagonal, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    seen = np.isfinite(m)
    p = np.exp(s - np.where(seen, m, 0.0))
    l = p.sum(axis=-1, keepdims=True)
    out = np.where(seen, np.einsum("bhij,bjhd->bhid", p, v) / np.where(seen, l, 1.0), 0.0)
    lse = np.where(seen, m + np.log(np.where(seen, l, 1.0)), -np.inf)[..., 0]
    return out.transpose(0, 2, 1, 3), lse


ALIBI_CASES = [  # (seqlen_q, seqlen_k, causal, softcap, slopes per batch entry)
    (5, 9, False, 0.0, False),
    (5, 9, True, 0.0, True),
    (9, 6, True, 0.0, False),  # the first three queries see no key
    (7, 4, False, 0.0, True),
    (6, 6, True, 1.3, True),  # ALiBi is added after the softcap
    (3, 8, False, 0.9, False),
]


def _slopes(rng, batch, per_batch):
    shape = (batch, NHEADS) if per_batch else (NHEADS,)
    return rng.uniform(0.1, 1.5, shape).astype(np.float32)


@pytest.mark.parametrize("seqlen_q, seqlen_k, causal, softcap, per_batch", ALIBI_CASES)
def test_alibi_adds_the_distance_bias_to_the_scores(rng, seqlen_q, seqlen_k, causal, softcap,
                                                    per_batch):
    q, k, v = _dense(rng, 2, seqlen_q, seqlen_k, np.float64)
    slopes = _slopes(rng, 2, per_batch)
    options = dict(causal=causal, softcap=softcap, softmax_scale=0.7)
    out, lse = numba_flash.forward(q, k, v, alibi_slopes=slopes, backend="numpy", **options)
    want_out, want_lse = hand_attention(q, k, v, 0.7, slopes, causal, softcap)
    assert out.dtype == np.float64 and lse.dtype == np.float32
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=2e-7, atol=1e-7)
    assert np.isneginf(lse).sum() == (2 * NHEADS * max(seqlen_q - seqlen_k, 0) if causal else 0)
    # the bias took effect, and attention() is forward's out
    plain = numba_flash.forward(q, k, v, backend="numpy", **options)[0]
    assert np.abs(plain - out).max() > 1e-2
    np.testing.assert_array_equal(
        numba_flash.attention(q, k, v, alibi_slopes=slopes, backend="numpy", **options), out)


def test_per_batch_slopes_apply_to_their_batch_entry(rng):
    q, k, v = _dense(rng, 3, 4, 7, np.float64)
    slopes = _slopes(rng, 3, True)
    out, lse = numba_flash.forward(q, k, v, alibi_slopes=slopes, backend="numpy")
    for b in range(3):
        one, one_lse = numba_flash.forward(q[b:b + 1], k[b:b + 1], v[b:b + 1],
                                           alibi_slopes=slopes[b], backend="numpy")
        np.testing.assert_array_equal(out[b:b + 1], one)
        np.testing.assert_array_equal(lse[b:b + 1], one_lse)
    swapped = numba_flash.forward(q, k, v, alibi_slopes=slopes[::-1].copy(), backend="numpy")[0]
    assert np.abs(swapped - out).max() > 1e-3


@pytest.mark.parametrize("seqlen_q, seqlen_k, causal, softcap, per_batch",
                         [(5, 7, True, 0.0, True), (6, 4, False, 1.1, False)])
def test_alibi_backward_is_the_derivative(rng, seqlen_q, seqlen_k, causal, softcap, per_batch):
    """Central differences of sum(out · dout) at random entries of q, k and v."""
    q, k, v = _dense(rng, 2, seqlen_q, seqlen_k, np.float64)
    slopes = _slopes(rng, 2, per_batch)
    options = dict(causal=causal, softcap=softcap, alibi_slopes=slopes, backend="numpy")
    dout = rng.standard_normal(q.shape)
    out, lse = numba_flash.forward(q, k, v, **options)
    grads = numba_flash.backward(dout, q, k, v, out, lse, **options)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]

    def loss(*arrays):
        return float((hand_attention(*arrays, HEAD_DIM ** -0.5, slopes, causal, softcap)[0]
                      * dout).sum())
    assert_is_the_derivative(rng, grads, loss, (q, k, v))
    # and the bias reaches the gradients
    options.pop("alibi_slopes")
    plain = numba_flash.backward(dout, q, k, v, *numba_flash.forward(q, k, v, **options),
                                 **options)
    assert np.abs(plain[0] - grads[0]).max() > 1e-3


# ---- 3. varlen: each sequence alone ------------------------------------------------------

VARLEN_OPTIONS = [
    dict(),
    dict(causal=True),
    dict(window_size=(2, 1)),
    dict(softcap=1.2),
    dict(alibi="batch"),
    dict(alibi="heads", causal=True),
    dict(causal=True, window_size=(3, -1), softcap=2.0, alibi="batch", softmax_scale=0.6),
]


def _varlen_case(rng, options, lengths_q, lengths_k):
    options = dict(options)
    alibi = options.pop("alibi", None)
    batch = len(lengths_q)
    if alibi is not None:
        options["alibi_slopes"] = _slopes(rng, batch, alibi == "batch")
    return _packed(rng, lengths_q, lengths_k, dtype=np.float64), options


def _one_sequence_options(options, b):
    slopes = options.get("alibi_slopes")
    if slopes is None or slopes.ndim == 1:
        return options
    return dict(options, alibi_slopes=slopes[b])


@pytest.mark.parametrize("options", VARLEN_OPTIONS)
def test_varlen_is_each_sequence_alone(rng, options):
    (q, k, v), options = _varlen_case(rng, options, LENGTHS_Q, LENGTHS_K)
    cu_q, cu_k = _cu(LENGTHS_Q), _cu(LENGTHS_K)
    dout = rng.standard_normal(q.shape)
    out, lse = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, 7, 9, backend="numpy", **options)
    dq, dk, dv = numba_flash.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, 7, 9,
                                             backend="numpy", **options)
    assert out.shape == q.shape and lse.shape == (NHEADS, q.shape[0])
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    for b in range(len(LENGTHS_Q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if LENGTHS_K[b] == 0:  # no key: out 0, lse -inf, no gradient
            assert LENGTHS_Q[b] > 0
            np.testing.assert_array_equal(out[rows], 0.0)
            np.testing.assert_array_equal(lse[:, rows], -np.inf)
            np.testing.assert_array_equal(dq[rows], 0.0)
            continue
        if LENGTHS_Q[b] == 0:  # no query: its keys get no gradient
            np.testing.assert_array_equal(dk[keys], 0.0)
            np.testing.assert_array_equal(dv[keys], 0.0)
            continue
        one = _one_sequence_options(options, b)
        want_out, want_lse = numba_flash.forward(q[None, rows], k[None, keys], v[None, keys],
                                                 backend="numpy", **one)
        np.testing.assert_allclose(out[rows], want_out[0], rtol=1e-12, atol=1e-13)
        np.testing.assert_array_equal(lse[:, rows], want_lse[0])
        want = numba_flash.backward(dout[None, rows], q[None, rows], k[None, keys],
                                    v[None, keys], want_out, want_lse, backend="numpy", **one)
        for got, part, w in zip((dq, dk, dv), (rows, keys, keys), want):
            np.testing.assert_allclose(got[part], w[0], rtol=1e-12, atol=1e-13)


def test_varlen_sequences_do_not_see_each_other(rng):
    """Two sequences packed equal the first alone even when the second is changed."""
    lengths_q, lengths_k = (4, 6), (5, 3)
    q, k, v = _packed(rng, lengths_q, lengths_k, dtype=np.float64)
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    out, lse = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, 6, 5, backend="numpy")
    k2, v2 = k.copy(), v.copy()
    k2[5:], v2[5:] = 10 * k[5:], -v[5:]
    out2, lse2 = numba_flash.forward_varlen(q, k2, v2, cu_q, cu_k, 6, 5, backend="numpy")
    np.testing.assert_array_equal(out2[:4], out[:4])
    np.testing.assert_array_equal(lse2[:, :4], lse[:, :4])
    assert np.abs(out2[4:] - out[4:]).max() > 1e-2
    # against the hand formula for the first sequence, with no slope
    want_out, want_lse = hand_attention(q[None, :4], k[None, :5], v[None, :5],
                                        HEAD_DIM ** -0.5, np.zeros(NHEADS))
    np.testing.assert_allclose(out[:4], want_out[0], rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse[:, :4], want_lse[0], rtol=2e-7)


# ---- 4. the numba-simt kernels (simulator: one case) ---------------------------------------

def test_simt_forward_varlen_matches_numpy(rng):
    lengths_q, lengths_k = (5, 0, 9), (7, 4, 9)
    q, k, v = _packed(rng, lengths_q, lengths_k, nheads=2, nheads_kv=2, head_dim=8)
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    slopes = rng.uniform(0.1, 1.0, (3, 2)).astype(np.float32)
    options = dict(causal=True, alibi_slopes=slopes)
    out, lse = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, 9, 9, backend="numba-simt",
                                          **options)
    want_out, want_lse = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, 9, 9, backend="numpy",
                                                    **options)
    assert out.dtype == np.float32 and lse.shape == (2, 14)
    np.testing.assert_allclose(out, want_out, atol=1e-4, rtol=0)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], atol=1e-4, rtol=0)


def test_select_backend_takes_alibi_slopes(rng):
    """select_backend answers for a call with ALiBi as forward would run it."""
    q = rng.standard_normal((1, 5, 2, 8)).astype(np.float32)
    k = rng.standard_normal((1, 7, 2, 8)).astype(np.float32)
    slopes = np.array([0.5, 0.25], np.float32)
    plain = numba_flash.select_backend(q, k, k, causal=True)
    with_alibi = numba_flash.select_backend(q, k, k, causal=True, alibi_slopes=slopes)
    assert with_alibi.name == plain.name and with_alibi.name is not None


@pytest.mark.parametrize("batch", [1, 2])
def test_simt_forward_with_per_head_slopes_matches_numpy(rng, batch):
    """(nheads,) slopes reach the kernels broadcast over the batch (a batch of one too, whose
    broadcast view is contiguous but read-only)."""
    q = rng.standard_normal((batch, 9, 2, 8)).astype(np.float32)
    k, v = (rng.standard_normal((batch, 11, 1, 8)).astype(np.float32) for _ in range(2))
    slopes = np.array([0.3, 0.7], np.float32)
    got_out, got_lse = numba_flash.forward(q, k, v, causal=True, alibi_slopes=slopes,
                                           backend="numba-simt")
    want_out, want_lse = numba_flash.forward(q, k, v, causal=True, alibi_slopes=slopes,
                                             backend="numpy")
    assert np.abs(got_out - want_out).max() < 1e-5
    assert np.abs(got_lse - want_lse).max() < 1e-5


def test_more_sequences_than_the_grid_takes_get_a_clear_error(rng):
    """grid.z holds the sequences: a plain batch past the limit moves "auto" on (and names the
    reason when the Numba backend is asked for); a varlen batch past it is refused before any
    launch."""
    from numba_flash.backends.numba.backend import MAX_SEQUENCES
    q = rng.standard_normal((MAX_SEQUENCES + 1, 1, 1, 4)).astype(np.float32)
    with pytest.raises(ValueError, match=f"at most {MAX_SEQUENCES} sequences; got batch"):
        numba_flash.forward(q, q, q, backend="numba-simt")
    assert numba_flash.select_backend(q, q, q).name == "numpy"
    cu = np.arange(MAX_SEQUENCES + 2, dtype=np.int32)
    with pytest.raises(ValueError, match=f"at most {MAX_SEQUENCES} sequences; got cu_seqlens_q"):
        numba_flash.forward_varlen(q[:, 0], q[:, 0], q[:, 0], cu, cu, 1, 1, backend="numba-simt")
