"""attn_mask at the API: bad masks get a TypeError or ValueError naming attn_mask before any
backend is chosen; a mask means what PyTorch SDPA's means (checked against a hand-written
float64 softmax and against torch's SDPA itself), in each broadcast form; its backward is the
derivative; the numba-simt kernels agree with the numpy backend; the kernels' view of a mask
broadcasts through strides of 0, copying nothing."""
import numpy as np
import pytest
from central_differences import assert_is_the_derivative

import numba_flash
from numba_flash import registry

BATCH, SEQLEN_Q, SEQLEN_K, NHEADS, NHEADS_KV, HEAD_DIM = 2, 5, 7, 4, 2, 8
FULL = (BATCH, NHEADS, SEQLEN_Q, SEQLEN_K)


@pytest.fixture
def no_backend(monkeypatch):
    def refuse(*args):
        raise AssertionError("a backend was chosen for a call with a bad argument")
    monkeypatch.setattr(registry, "resolve", refuse)


def _qkv(rng, dtype=np.float64, seqlen_q=SEQLEN_Q, seqlen_k=SEQLEN_K):
    q = rng.standard_normal((BATCH, seqlen_q, NHEADS, HEAD_DIM)).astype(dtype)
    k, v = (rng.standard_normal((BATCH, seqlen_k, NHEADS_KV, HEAD_DIM)).astype(dtype)
            for _ in range(2))
    return q, k, v


# ---- 1. bad masks: named, before any backend ----------------------------------------------

BROADCAST = (r"attn_mask must broadcast to \(batch, nheads, seqlen_q, seqlen_k\) = "
             r"\(2, 4, 5, 7\) \(each dimension 1 or that size\); got ")
BAD_MASKS = [  # (mask, error, message) for float32 q of FULL's shape
    (np.ones((5, 6), bool), ValueError, BROADCAST + r"\(5, 6\)"),
    (np.ones((2, 4, 7, 5), bool), ValueError, BROADCAST + r"\(2, 4, 7, 5\)"),
    (np.ones((3, 1, 5, 7), bool), ValueError, BROADCAST + r"\(3, 1, 5, 7\)"),
    (np.ones((1, 2, 1, 7), bool), ValueError, BROADCAST + r"\(1, 2, 1, 7\)"),  # nheads_kv
    (np.ones((1, 2, 4, 5, 7), bool), ValueError, BROADCAST + r"\(1, 2, 4, 5, 7\)"),
    (np.ones((2, 4, 5, 7), np.int32), TypeError,
     r"attn_mask must be boolean \(True: the query sees the key\) or floating \(added to the "
     r"scores\); got int32"),
    (np.ones((5, 7), np.uint8), TypeError, "attn_mask must be boolean .*; got uint8"),
    (np.ones((5, 7), np.float64), TypeError,
     "a floating attn_mask must have q's dtype float32 or float32; got float64"),
    (np.ones((5, 7), np.float16), TypeError,
     "a floating attn_mask must have q's dtype float32 or float32; got float16"),
    ([[True] * 7] * 5, TypeError,
     r"attn_mask must be an array \(boolean or floating, broadcastable to \(batch, nheads, "
     r"seqlen_q, seqlen_k\)\) or None; got list"),
    (True, TypeError, "attn_mask must be an array .*; got bool"),
    ("causal", TypeError, "attn_mask must be an array .*; got str"),
]


@pytest.mark.parametrize("mask, error, message", BAD_MASKS)
def test_bad_masks_are_named_before_any_backend_runs(rng, no_backend, mask, error, message):
    q, k, v = _qkv(rng, np.float32)
    with pytest.raises(error, match=message):
        numba_flash.forward(q, k, v, attn_mask=mask)
    with pytest.raises(error, match=message):
        numba_flash.attention(q, k, v, attn_mask=mask, causal=True)
    lse = np.zeros((BATCH, NHEADS, SEQLEN_Q), np.float32)
    with pytest.raises(error, match=message):
        numba_flash.backward(q, q, k, v, q, lse, attn_mask=mask)


def test_select_backend_takes_a_mask(rng):
    q, k, v = _qkv(rng, np.float32)
    chosen = numba_flash.select_backend(q, k, v, attn_mask=np.ones((SEQLEN_Q, SEQLEN_K), bool))
    assert chosen.name == numba_flash.select_backend(q, k, v).name
    with pytest.raises(TypeError, match="attn_mask must be boolean"):
        numba_flash.select_backend(q, k, v, attn_mask=np.ones((SEQLEN_Q, SEQLEN_K), np.int8))


def test_varlen_calls_take_no_mask(rng):
    q = rng.standard_normal((6, NHEADS, HEAD_DIM)).astype(np.float32)
    cu = np.array([0, 6], np.int32)
    with pytest.raises(TypeError, match="attn_mask"):
        numba_flash.forward_varlen(q, q, q, cu, cu, 6, 6, attn_mask=np.ones((6, 6), bool))


# ---- 2. the meaning: SDPA's ---------------------------------------------------------------

def hand_attention(q, k, v, scale, mask=None, bias=None, causal=False):
    """(out, lse) in float64 of softmax(scale · q·k + bias) over the keys the boolean mask
    (and causal, bottom-right aligned) leaves; a row that sees no key gets 0 and -inf."""
    group = q.shape[2] // k.shape[2]
    k, v = (np.repeat(x, group, axis=2) for x in (k, v))
    s = np.einsum("bihd,bjhd->bhij", q, k) * scale
    if bias is not None:
        s = s + bias
    seen = np.ones(s.shape, bool)
    if mask is not None:
        seen = seen & mask
    if causal:
        i, j = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None, :]
        seen = seen & (j <= i + k.shape[1] - q.shape[1])
    s = np.where(seen, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    any_key = np.isfinite(m)
    p = np.exp(s - np.where(any_key, m, 0.0))
    l = p.sum(axis=-1, keepdims=True)
    out = np.where(any_key, np.einsum("bhij,bjhd->bhid", p, v) / np.where(any_key, l, 1), 0.0)
    lse = np.where(any_key, m + np.log(np.where(any_key, l, 1.0)), -np.inf)[..., 0]
    return out.transpose(0, 2, 1, 3), lse


MASK_SHAPES = [FULL, (SEQLEN_Q, SEQLEN_K), (SEQLEN_K,), (BATCH, 1, 1, SEQLEN_K),
               (1, NHEADS, SEQLEN_Q, 1), (NHEADS, 1, SEQLEN_K), (1, 1, 1, 1)]


def _bool_mask(rng, shape):
    mask = rng.random(shape) < 0.6
    mask.reshape(-1)[0] = True  # (a mask of one element must let the row see something)
    if mask.size > 1:
        mask.reshape(-1)[-1] = False  # (and a larger one must hide something: seven keys
        #                                drawn all True one time in twenty)
    return mask


def _assert_attention(out, lse, want_out, want_lse):
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=2e-7, atol=1e-7)


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_mask_means_what_sdpa_says_in_every_broadcast_form(rng, shape, kind):
    q, k, v = _qkv(rng)
    if kind == "bool":
        mask = _bool_mask(rng, shape)
        want = hand_attention(q, k, v, 0.6, mask=np.broadcast_to(mask, FULL))
    else:
        mask = rng.standard_normal(shape) * 3
        want = hand_attention(q, k, v, 0.6, bias=np.broadcast_to(mask, FULL))
    out, lse = numba_flash.forward(q, k, v, attn_mask=mask, softmax_scale=0.6, backend="numpy")
    _assert_attention(out, lse, *want)
    expanded = numba_flash.forward(q, k, v, attn_mask=np.broadcast_to(mask, FULL).copy(),
                                   softmax_scale=0.6, backend="numpy")
    np.testing.assert_array_equal(out, expanded[0])
    if np.size(mask) > 1 or kind == "float":  # the mask took effect (a bias constant along
        #                                       the keys changes the lse only)
        plain_out, plain_lse = numba_flash.forward(q, k, v, softmax_scale=0.6, backend="numpy")
        assert max(np.abs(plain_out - out).max(), np.abs(plain_lse - lse).max()) > 1e-3


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_mask_agrees_with_torch_sdpa(rng, kind):
    torch = pytest.importorskip("torch")
    q, k, v = _qkv(rng)
    if kind == "bool":
        mask = _bool_mask(rng, (BATCH, 1, SEQLEN_Q, SEQLEN_K))
        mask[..., 0] = True  # (SDPA gives NaN for a row that sees no key; we give 0)
    else:
        mask = rng.standard_normal((NHEADS, SEQLEN_Q, SEQLEN_K))
        mask[rng.random(mask.shape) < 0.2] = -np.inf
        mask[..., 0] = 0.0
    out = numba_flash.attention(q, k, v, attn_mask=mask, backend="numpy")
    heads = [torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))) for x in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(
        *heads, attn_mask=torch.from_numpy(mask), enable_gqa=True)
    np.testing.assert_allclose(out, want.numpy().transpose(0, 2, 1, 3), rtol=1e-12, atol=1e-13)


def test_a_bool_mask_combines_with_causal_and_rows_may_see_no_key(rng):
    q, k, v = _qkv(rng)
    mask = _bool_mask(rng, FULL)
    mask[0, 1, 3] = False  # query 3 of head 1 sees no key
    out, lse = numba_flash.forward(q, k, v, attn_mask=mask, causal=True, backend="numpy")
    _assert_attention(out, lse, *hand_attention(q, k, v, HEAD_DIM ** -0.5, mask=mask,
                                                causal=True))
    assert np.isneginf(lse[0, 1, 3]) and not out[0, 3, 1].any()


def test_a_float_mask_of_minus_inf_is_a_bool_mask(rng):
    q, k, v = _qkv(rng)
    mask = _bool_mask(rng, (SEQLEN_Q, SEQLEN_K))
    mask[:, 0] = True
    bias = np.where(mask, 0.0, -np.inf)
    got = numba_flash.forward(q, k, v, attn_mask=bias, backend="numpy")
    want = numba_flash.forward(q, k, v, attn_mask=mask, backend="numpy")
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_the_backward_with_a_mask_is_the_derivative(rng, kind):
    """Central differences of sum(out · dout) at random entries of q, k and v."""
    q, k, v = _qkv(rng)
    if kind == "bool":
        mask = _bool_mask(rng, (BATCH, 1, SEQLEN_Q, SEQLEN_K))
        mask[..., 0] = True
        hand = dict(mask=np.broadcast_to(mask, FULL))
    else:
        mask = rng.standard_normal((SEQLEN_Q, SEQLEN_K)) * 2
        hand = dict(bias=mask)
    options = dict(attn_mask=mask, causal=True, backend="numpy")
    dout = rng.standard_normal(q.shape)
    out, lse = numba_flash.forward(q, k, v, **options)
    grads = numba_flash.backward(dout, q, k, v, out, lse, **options)

    def loss(*arrays):
        return float((hand_attention(*arrays, HEAD_DIM ** -0.5, causal=True, **hand)[0]
                      * dout).sum())
    assert_is_the_derivative(rng, grads, loss, (q, k, v))


# ---- 3. the numba-simt kernels (simulator) and the kernels' view ---------------------------

@pytest.mark.parametrize("dtype, kind", [("float32", "float32"), ("float16", "bool")])
def test_simt_forward_and_backward_with_a_mask_match_float64(rng, dtype, kind):
    """By the accuracy rule, against float64, the baseline a float32 (or 16-bit) standard
    attention (one batch entry, two heads sharing a key/value head: the simulator is slow;
    the kernels' own tests, tests/variants/test_*_kernels.py, take more masks)."""
    from error_rule import assert_within_rule

    from numba_flash.extras import Extras
    from numba_flash.reference import attention_backward, attention_forward
    from numba_flash.spec import make_spec
    from numba_flash.testing import plain16_backward, plain16_forward
    q = rng.standard_normal((1, 9, 2, HEAD_DIM)).astype(dtype)
    k, v = (rng.standard_normal((1, 13, 1, HEAD_DIM)).astype(dtype) for _ in range(2))
    shape = (2, 1, 13)
    mask = (_bool_mask(rng, shape) if kind == "bool"
            else (rng.standard_normal(shape) * 2).astype(kind))
    options = dict(attn_mask=mask, causal=True, softcap=2.0)
    out, lse = numba_flash.forward(q, k, v, backend="numba-simt", **options)
    dout = rng.standard_normal(q.shape).astype(dtype)
    grads = numba_flash.backward(dout, q, k, v, out, lse, backend="numba-simt", **options)

    spec = make_spec(q, k, causal=True, softcap=2.0, attn_mask=kind)
    extras = Extras(attn_mask=mask)
    if dtype == "float32":
        base = attention_forward(np, q, k, v, spec, np.float32, extras)
        bases = attention_backward(np, dout, q, k, v, out, lse, spec, np.float32, extras)
    else:
        base = plain16_forward(np, q, k, v, spec, dtype, extras)
        bases = plain16_backward(np, dout, q, k, v, out, lse, spec, dtype, extras)
    want_out, want_lse = attention_forward(np, q, k, v, spec, np.float64, extras)
    assert_within_rule("out", out, base[0], want_out, dtype)
    assert_within_rule("lse", lse, base[1], want_lse, "float32")
    wants = attention_backward(np, dout, q, k, v, out, lse, spec, np.float64, extras)
    for name, got, base_grad, want in zip(("dq", "dk", "dv"), grads, bases, wants):
        assert_within_rule(name, got, base_grad, want, dtype)


def test_the_kernels_see_a_broadcast_mask_through_zero_strides():
    from numba_flash.backends.numba.launch import DeviceView
    from numba_flash.backends.numba.marshal import broadcast
    mask = DeviceView(0x10000, (2, 1, 7), (7, 7, 1), np.bool_)  # (batch, 1, seqlen_k)
    got = broadcast(mask, (3, 2, 5, 7))
    assert (got.ptr, got.shape, got.strides) == (0x10000, (3, 2, 5, 7), (0, 7, 0, 1))
    assert got.owner is mask.owner
