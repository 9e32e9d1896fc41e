"""numba_flash.merge: the attention over disjoint key sets merged from each set's (out, lse)
is the attention over their union (float64, the numpy backend's forward on each part; and
the simulated kernels' float32 parts), stacked or as lists; parts that saw no key of a row
(lse -inf, even with NaN in their out) weigh nothing, and a row no part saw gets 0 and -inf;
torch tensors in, torch tensors out; bad parts are named."""
import numpy as np
import pytest

import numba_flash

BATCH, SEQLEN_Q, SEQLEN_K, NHEADS, HEAD_DIM = 2, 6, 23, 3, 8


def _qkv(rng, dtype=np.float64):
    q = rng.standard_normal((BATCH, SEQLEN_Q, NHEADS, HEAD_DIM)).astype(dtype)
    k, v = (rng.standard_normal((BATCH, SEQLEN_K, NHEADS, HEAD_DIM)).astype(dtype)
            for _ in range(2))
    return q, k, v


def _parts(q, k, v, bounds, backend="numpy", **options):
    """forward on each key range [bounds[i], bounds[i + 1])."""
    results = [numba_flash.forward(q, k[:, a:b], v[:, a:b], softmax_scale=0.5, backend=backend,
                                   **options) for a, b in zip(bounds, bounds[1:])]
    return [r[0] for r in results], [r[1] for r in results]


@pytest.mark.parametrize("bounds", [(0, 23), (0, 10, 23), (0, 1, 2, 17, 23)])
def test_merging_the_parts_of_the_keys_is_attention_over_all_of_them(rng, bounds):
    q, k, v = _qkv(rng)
    want_out, want_lse = numba_flash.forward(q, k, v, softmax_scale=0.5, backend="numpy")
    outs, lses = _parts(q, k, v, bounds)
    for stacked in (False, True):
        got = numba_flash.merge(np.stack(outs), np.stack(lses)) if stacked else \
            numba_flash.merge(outs, lses)
        # (each part's lse is float32, so its weight is good to ~1e-7 relative)
        np.testing.assert_allclose(got[0], want_out, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got[1], want_lse, rtol=1e-6, atol=1e-6)
        assert got[0].dtype == np.float64 and got[1].dtype == np.float32


def test_a_part_that_saw_no_key_weighs_nothing_and_a_row_no_part_saw_is_empty(rng):
    """Boolean masks that hide every key of a part from some rows (their lse -inf there,
    their out poisoned with NaN here: it must not be read), and one row from every key."""
    q, k, v = _qkv(rng)
    mask = rng.random((BATCH, NHEADS, SEQLEN_Q, SEQLEN_K)) < 0.7
    mask[..., 0, :10] = False  # row 0 sees nothing of the first part
    mask[..., 2, 10:] = False  # row 2 nothing of the second
    mask[..., 1, :] = False  # row 1 nothing at all
    mask[..., 3:, 0] = mask[..., 3:, 10] = True
    want_out, want_lse = numba_flash.forward(q, k, v, softmax_scale=0.5, attn_mask=mask,
                                             backend="numpy")
    outs, lses = [], []
    for keys in (slice(0, 10), slice(10, SEQLEN_K)):
        out, lse = numba_flash.forward(q, k[:, keys], v[:, keys], softmax_scale=0.5,
                                       attn_mask=mask[..., keys], backend="numpy")
        outs.append(np.where(np.isneginf(lse).transpose(0, 2, 1)[..., None], np.nan, out))
        lses.append(lse)
    assert np.isneginf(lses[0][..., 0]).all() and np.isneginf(lses[1][..., 2]).all()
    out, lse = numba_flash.merge(outs, lses)
    np.testing.assert_allclose(out, want_out, rtol=1e-6, atol=1e-6)  # (float32 lse weights)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    assert np.isneginf(lse[..., 1]).all() and not out[:, 1].any()
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-6, atol=1e-6)


def test_the_simulated_kernels_parts_merge_to_the_whole(rng):
    q, k, v = _qkv(rng, np.float32)
    outs, lses = _parts(q, k, v, (0, 17, 23), backend="numba")
    want_out, want_lse = numba_flash.forward(*(x.astype(np.float64) for x in (q, k, v)),
                                             softmax_scale=0.5, backend="numpy")
    out, lse = numba_flash.merge(outs, lses)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, want_out, rtol=0, atol=2e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=2e-6)


def test_torch_parts_give_torch_results(rng):
    torch = pytest.importorskip("torch")
    q, k, v = _qkv(rng)
    outs, lses = _parts(q, k, v, (0, 9, 23))
    got = numba_flash.merge([torch.from_numpy(x) for x in outs],
                            [torch.from_numpy(x) for x in lses])
    want = numba_flash.merge(outs, lses)
    assert isinstance(got[0], torch.Tensor) and got[0].dtype == torch.float64
    assert got[1].dtype == torch.float32
    np.testing.assert_array_equal(got[0].numpy(), want[0])
    np.testing.assert_array_equal(got[1].numpy(), want[1])


@pytest.mark.parametrize("outs, lses, error, message", [
    ([], [], ValueError, "outs must hold at least one part"),
    (np.zeros((2, 6, 3, 8)), np.zeros((2, 3, 6), np.float32), TypeError,
     r"outs must be an array of 5 dimensions \(parts first\) or a list of 4-D arrays; got "
     r"shape \(2, 6, 3, 8\)"),
    ([np.zeros((2, 6, 3, 8))] * 2, [np.zeros((2, 3, 6), np.float32)], ValueError,
     "outs and lses must hold as many parts; got 2 and 1"),
    ([np.zeros((2, 6, 3, 8))], [np.zeros((2, 6, 3), np.float32)], ValueError,
     r"lses\[0\] must have shape \(batch, nheads, seqlen_q\) = \(2, 3, 6\); got \(2, 6, 3\)"),
    ([np.zeros((2, 6, 3, 8)), np.zeros((2, 6, 3, 4))], [np.zeros((2, 3, 6), np.float32)] * 2,
     ValueError, r"outs\[1\] has shape \(2, 6, 3, 4\); outs\[0\] \(2, 6, 3, 8\)"),
    (["x"], [np.zeros((2, 3, 6), np.float32)], TypeError, r"outs\[0\] must be a 4-D array"),
])
def test_bad_parts_are_named(outs, lses, error, message):
    with pytest.raises(error, match=message):
        numba_flash.merge(outs, lses)
