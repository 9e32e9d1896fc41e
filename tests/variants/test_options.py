"""The variants' options at the API: each bad value gets a TypeError or ValueError naming the
argument, from forward and backward alike, before any backend is chosen or launched; equal
meanings give one spec."""
import numpy as np
import pytest

import numba_flash
from numba_flash import registry
from numba_flash.spec import make_spec

BAD = [
    (dict(window_size=(-2, 0)), ValueError, r"window_size must be a pair of ints \(left, right\)"),
    (dict(window_size=(3,)), TypeError, "window_size must be a pair of ints"),
    (dict(window_size=4), TypeError, "window_size must be a pair of ints"),
    (dict(window_size=(1.5, 2)), TypeError, "window_size must be a pair of ints"),
    (dict(window_size=(True, 2)), TypeError, "window_size must be a pair of ints"),
    (dict(window_size=[[1], 2]), TypeError, "window_size must be a pair of ints"),
    (dict(softcap=-1.0), ValueError, "softcap must be a finite number >= 0"),
    (dict(softcap=float("nan")), ValueError, "softcap must be a finite number >= 0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be a finite number >= 0"),
    (dict(softcap="30"), TypeError, "softcap must be a finite number >= 0"),
    (dict(softcap=True), TypeError, "softcap must be a finite number >= 0"),
    (dict(softcap=None), TypeError, "softcap must be a finite number >= 0"),
]


@pytest.fixture
def no_backend(monkeypatch):
    """Fail the test if a backend is chosen (the error must come first)."""
    def refuse(*args):
        raise AssertionError("a backend was chosen for a call with a bad option")
    monkeypatch.setattr(registry, "resolve", refuse)


def _arrays(rng, nheads=4, nheads_kv=2):
    q = rng.standard_normal((1, 5, nheads, 8)).astype(np.float32)
    k = rng.standard_normal((1, 6, nheads_kv, 8)).astype(np.float32)
    return q, k, k.copy()


@pytest.mark.parametrize("options, error, message", BAD)
def test_a_bad_option_is_named_before_any_backend_runs(rng, no_backend, options, error,
                                                       message):
    q, k, v = _arrays(rng)
    with pytest.raises(error, match=message):
        numba_flash.forward(q, k, v, **options)
    lse = np.zeros((1, 4, 5), np.float32)
    with pytest.raises(error, match=message):
        numba_flash.backward(q, q, k, v, q, lse, **options)


@pytest.mark.parametrize("nheads, nheads_kv", [(4, 3), (2, 4), (6, 4)])
def test_query_heads_must_be_a_multiple_of_key_heads(rng, no_backend, nheads, nheads_kv):
    q, k, v = _arrays(rng, nheads, nheads_kv)
    message = (f"nheads of q must be a multiple of nheads of k and v \\(grouped-query "
               f"attention\\); got q with {nheads} heads, k with {nheads_kv}")
    with pytest.raises(ValueError, match=message):
        numba_flash.forward(q, k, v)
    with pytest.raises(ValueError, match=message):
        numba_flash.backward(q, q, k, v, q, np.zeros((1, nheads, 5), np.float32))


def test_k_and_v_must_have_the_same_heads(rng, no_backend):
    q, k, _ = _arrays(rng, 4, 2)
    v = np.concatenate([k, k], axis=2)
    with pytest.raises(ValueError, match="nheads mismatch: k has 2, v has 4"):
        numba_flash.forward(q, k, v)


def test_one_meaning_one_spec(rng):
    q, k, _ = _arrays(rng)
    causal = make_spec(q, k, causal=True)
    assert make_spec(q, k, window_size=(-1, 0)) == causal
    assert make_spec(q, k, causal=True, window_size=(-1, 5)) == causal  # causal: right = 0
    assert make_spec(q, k, window_size=[-1, 0]) == causal  # a list is a pair too
    assert make_spec(q, k, softcap=0) == make_spec(q, k)
    assert make_spec(q, k).group == 2 and make_spec(q, q).group == 1
    # kernels are built per spec without its scale: softcap and windows stay in it
    assert make_spec(q, k, softcap=2.0, softmax_scale=0.5).for_kernels().softcap == 2.0


def test_windows_and_gqa_reach_the_backend_in_the_spec(rng):
    q, k, v = _arrays(rng)
    selection = numba_flash.select_backend(q, k, v, window_size=(2, 1), softcap=1.0)
    assert selection.name is not None
    out, _ = numba_flash.forward(q, k, v, window_size=(2, 1), softcap=1.0, backend="numpy")
    plain, _ = numba_flash.forward(q, k, v, backend="numpy")
    assert not np.allclose(out, plain)  # the options took effect
