"""The shared device rules (backends/numba/device: mask, block_range, softmax, score_mod)
against brute force over the float64 reference's own mask and score mod, for random sizes,
tiles and options (causal, windows smaller than a tile and wider than the sequence). Under the
simulator the device functions are plain Python, so each rule is checked element by element."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mask_mods import striped_mask

from numba import cuda

from numba_flash.backends.numba.device.block_range import (EMPTY, FULL, PARTIAL,
                                                           longest_last, make_block_range,
                                                           make_query_tile_start)
from numba_flash.backends.numba.device.constants import LOG2E
from numba_flash.backends.numba.device.mask import (MASK_ALL, MASK_BOUNDS, MASK_NONE,
                                                    make_mask, tile_mask)
from numba_flash.backends.numba.device.score_mod import make_score_mod
from numba_flash.backends.numba.device.softmax import (finalize, grad_score, lse_log2,
                                                       online_update, probability)
from numba_flash.reference import score_mod, visible
from numba_flash.spec import AttentionSpec
from numba_flash.testing import bf16_bits, bf16_values

NO_MASK = (None, 0, 0, ())  # the (attn_mask, b, h, mask_mod arrays) of a call without a mask:
#                               never read

WINDOW_SIDE = st.one_of(st.just(-1), st.integers(0, 12), st.just(100))
SIZES = dict(seqlen_q=st.integers(1, 70), seqlen_k=st.integers(1, 70),
             block_m=st.sampled_from([1, 4, 16, 32]), block_n=st.sampled_from([1, 8, 16, 48]),
             causal=st.booleans(), window=st.tuples(WINDOW_SIDE, WINDOW_SIDE))


def _spec(causal, window):
    return AttentionSpec(16, "float32", causal=causal, window_left=window[0],
                         window_right=window[1])


def _truth(spec, seqlen_q, seqlen_k):
    mask = visible(np, spec, seqlen_q, seqlen_k)
    return np.ones((seqlen_q, seqlen_k), bool) if mask is None else mask


@settings(max_examples=60, deadline=None)
@given(**SIZES)
def test_mask_is_the_reference_mask(seqlen_q, seqlen_k, block_m, block_n, causal, window):
    spec = _spec(causal, window)
    seen = make_mask(spec)
    truth = _truth(spec, seqlen_q, seqlen_k)
    offset = seqlen_k - seqlen_q
    got = np.array([[seen(i, j, seqlen_k, offset, NO_MASK, True)
                     for j in range(seqlen_k + block_n)]
                    for i in range(seqlen_q)])
    assert np.array_equal(got[:, :seqlen_k], truth)
    assert not got[:, seqlen_k:].any()  # the zero-filled tail of the last key tile


@settings(max_examples=80, deadline=None)
@given(**SIZES, key_bound=st.booleans())
def test_tile_ranges_and_classes_cover_exactly_the_visible_pairs(seqlen_q, seqlen_k, block_m,
                                                                 block_n, causal, window,
                                                                 key_bound):
    spec = _spec(causal, window)
    key_range, query_range, tile_class, is_partial, _ = make_block_range(
        spec, block_m, block_n, key_bound)
    truth = _truth(spec, seqlen_q, seqlen_k)
    for m0 in range(0, seqlen_q, block_m):
        n_begin, n_end = key_range(m0, seqlen_q, seqlen_k)
        visited = set(range(n_begin, n_end, block_n))
        assert n_begin % block_n == 0
        for n0 in range(0, seqlen_k, block_n):
            tile = truth[m0:m0 + block_m, n0:n0 + block_n]
            overhangs = n0 + block_n > seqlen_k
            expected = (EMPTY if not tile.any() else
                        PARTIAL if (key_bound and overhangs) or not tile.all() else FULL)
            got = tile_class(m0, n0, seqlen_q, seqlen_k)
            # a tile may be called partial when only its rows past seqlen_q, or without
            # key_bound its keys past seqlen_k, are masked: those are never stored
            assert got == expected or (got == PARTIAL and expected == FULL and (
                m0 + block_m > seqlen_q or overhangs)), (m0, n0)
            assert (n0 in visited) == (expected != EMPTY), (m0, n0)
            if got != EMPTY:
                assert is_partial(m0, n0, seqlen_q, seqlen_k) == (got == PARTIAL), (m0, n0)
    for n0 in range(0, seqlen_k, block_n):
        m_begin, m_end = query_range(n0, seqlen_q, seqlen_k)
        assert m_begin % block_m == 0 and m_end <= seqlen_q
        for m0 in range(0, seqlen_q, block_m):
            seen = truth[m0:m0 + block_m, n0:n0 + block_n].any()
            assert (m_begin <= m0 < m_end) == seen, (m0, n0)


def _query_tile_starts(spec, block_m, from_end, along_y, seqlen_q):
    """The first row of each block's query tile, from a grid of ceil(seqlen_q / block_m)
    tiles along x (or along_y: y) and three heads along the other axis."""
    query_tile_start = make_query_tile_start(spec, block_m, from_end, along_y)

    @cuda.jit
    def starts(out):
        head, tile = ((cuda.blockIdx.x, cuda.blockIdx.y) if along_y else
                      (cuda.blockIdx.y, cuda.blockIdx.x))
        out[head, tile] = query_tile_start(seqlen_q)

    out = np.full((3, -(-seqlen_q // block_m)), -10**6, np.int64)
    starts[out.shape if along_y else out.shape[::-1], 1](out)
    assert (out == out[0]).all()  # (every head's blocks alike)
    return out[0]


@settings(max_examples=30, deadline=None)
@given(**SIZES, from_end=st.booleans(), along_y=st.booleans())
def test_query_tiles_cover_every_row_once_and_see_all_their_keys(seqlen_q, seqlen_k, block_m,
                                                                 block_n, causal, window,
                                                                 from_end, along_y):
    """Laid from the end of Q (causal alone, from_end) or from row 0, along grid.x or y, the
    tiles cover each row once, the longest first, and the key range of a tile that starts
    below row 0 still holds every key its rows inside Q see."""
    spec = _spec(causal, window)
    starts = _query_tile_starts(spec, block_m, from_end, along_y, seqlen_q)
    causal_alone = longest_last(spec)
    first = seqlen_q - starts.size * block_m if from_end and causal_alone else 0
    expected = range(first, seqlen_q, block_m)
    assert list(starts) == list(expected)[::-1 if causal_alone else 1]
    key_range = make_block_range(spec, block_m, block_n)[0]
    truth = _truth(spec, seqlen_q, seqlen_k)
    for m0 in starts:
        n_begin, n_end = key_range(m0, seqlen_q, seqlen_k)
        seen = np.flatnonzero(truth[max(0, m0):m0 + block_m].any(axis=0))
        assert seen.size == 0 or (n_begin <= seen[0] and seen[-1] < n_end), (m0, seen)


@pytest.mark.parametrize("causal", [False, True])
def test_no_tile_when_no_query_of_the_tile_sees_a_key(causal):
    """seqlen_q > seqlen_k, causal: the first rows see no key, so their tiles visit nothing."""
    spec = AttentionSpec(16, "float32", causal=causal)
    key_range = make_block_range(spec, 16, 16)[0]
    n_begin, n_end = key_range(0, 100, 20)  # rows 0..15 see keys j <= i - 80: none
    assert (n_end <= n_begin) == causal


def test_online_softmax_matches_the_softmax_of_the_whole_row(rng):
    scores = rng.standard_normal(37).astype(np.float32) * 4
    scale_log2 = np.float32(0.3 * math.log2(math.e))
    m_i, l_i = np.float32(-np.inf), np.float32(0)
    for start in range(0, 37, 8):  # tiles of 8 keys
        tile = scores[start:start + 8]
        m_i, m_ref, alpha = online_update(m_i, np.float32(tile.max() * scale_log2))
        l_i = l_i * alpha + sum(probability(s, scale_log2, m_ref) for s in tile)
    inv_l, lse = finalize(l_i, m_i)
    exact = np.log(np.exp(0.3 * scores.astype(np.float64)).sum())
    assert abs(lse - exact) < 1e-5 * abs(exact) + 1e-5
    assert abs(inv_l - 1 / l_i) < 1e-7 / l_i
    # P recomputed from the lse, as the backward does, sums to 1
    p = [probability(s, scale_log2, lse_log2(np.float32(lse))) for s in scores]
    assert abs(sum(p) - 1) < 1e-5
    assert grad_score(np.float32(0.5), np.float32(2), np.float32(0.5)) == 0.75


def test_a_row_that_sees_no_key_gets_zero_and_minus_inf():
    m_i, m_ref, alpha = online_update(np.float32(-np.inf), np.float32(-np.inf))
    assert m_i == -np.inf and m_ref == 0 and alpha == 0  # no -inf - -inf: no NaN
    assert finalize(np.float32(0), m_i) == (0, -np.inf)
    assert lse_log2(np.float32(-np.inf)) == np.inf  # so that P = exp2(S - lse) = 0
    assert probability(np.float32(3), np.float32(1), lse_log2(np.float32(-np.inf))) == 0


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (3, -1), (0, 0), (5, 2)])
def test_causal_is_the_window_minus_one_zero(window):
    """One spec for one meaning: a right side of 0 is causal, and causal sets it to 0."""
    spec = AttentionSpec(16, "float32", window_left=window[0], window_right=window[1])
    assert spec.windowed == (window != (-1, -1))
    assert spec.causal == (window[1] == 0)
    causal = AttentionSpec(16, "float32", causal=True, window_left=window[0],
                           window_right=window[1])
    assert (causal.window_left, causal.window_right) == (window[0], 0)


@settings(max_examples=30, deadline=None)
@given(softcap=st.floats(0.1, 50), scale=st.floats(0.05, 2),
       s=st.floats(-1e4, 1e4, allow_nan=False))
def test_softcap_is_the_reference_score_mod_in_log2_units(softcap, scale, s):
    spec = AttentionSpec(16, "float32", softcap=softcap)
    mod = make_score_mod(spec)
    tile_scale, pre = mod.scales(np.float32(scale * float(LOG2E)))
    assert tile_scale == 1  # modified scores are in log2 units already
    want, want_grad = score_mod(np, np.float64(np.float32(s)) * scale, spec)
    # (no ALiBi: slope and positions unused)
    args = (np.float32(s), pre, np.float32(0.0), 7, 3, 0, 9, NO_MASK)
    got = mod.score(*args) / float(LOG2E)
    got_too, grad = mod.score_and_grad(*args)
    assert mod.active and got_too == mod.score(*args)
    assert abs(got - want) <= 2e-6 * softcap + 1e-6 * abs(s * scale)
    assert abs(grad - want_grad) <= 1e-5


@settings(max_examples=30, deadline=None)
@given(softcap=st.sampled_from([0.0, 0.5, 20.0]), scale=st.floats(0.05, 2),
       s=st.floats(-1e3, 1e3, allow_nan=False), slope=st.floats(0.0, 2.0),
       query_pos=st.integers(-50, 50), key_pos=st.integers(0, 80))
def test_alibi_adds_the_reference_bias_after_the_softcap(softcap, scale, s, slope, query_pos,
                                                         key_pos):
    spec = AttentionSpec(16, "float32", softcap=softcap, alibi=True)
    mod = make_score_mod(spec)
    _, pre = mod.scales(np.float32(scale * float(LOG2E)))
    slopes = np.full((2, 3), np.nan, np.float32)
    slopes[1, 2] = slope
    slope_log2 = mod.head_slope(slopes, 1, 2)
    # (one float32 rounding, whose relative size grows for subnormal slopes: a unit in the
    # last place of the product, twice, as a floor: the slope itself is rounded to float32)
    assert abs(slope_log2 - slope * float(LOG2E)) <= 1e-6 * slope + 2 * np.spacing(
        np.float32(slope * float(LOG2E)))
    capped, want_grad = score_mod(np, np.float64(np.float32(s)) * scale, spec)
    want = capped - np.float64(np.float32(slope)) * abs(query_pos - key_pos)
    args = (np.float32(s), pre, slope_log2, query_pos + 50, key_pos, -50, 81, NO_MASK)
    got_log2, grad = mod.score_and_grad(*args)  # (row query_pos + 50 at offset -50)
    assert mod.active
    assert got_log2 == mod.score(*args)
    got = got_log2 / float(LOG2E)
    # (float32 arithmetic: a subnormal slope carries an absolute rounding, two units in its
    # last place, over up to 130 positions, where the relative bound underflows)
    assert abs(got - want) <= 2e-6 * (softcap + abs(s * scale) + slope * 130) + 260 * np.spacing(
        np.float32(slope)) + 2 * np.spacing(np.float32(abs(want)))
    assert abs(grad - (1 if want_grad is None else want_grad)) <= 1e-5


def test_without_a_score_mod_the_raw_score_goes_on():
    mod = make_score_mod(AttentionSpec(16, "float32"))
    assert mod.active is False
    assert mod.score_and_grad(np.float32(3.5), np.float32(7), np.float32(2), 1, 9, 0, 10,
                              NO_MASK) == (3.5, 1)
    assert mod.head_slope(None, 0, 0) == 0
    assert mod.scales(np.float32(0.25)) == (0.25, 1)  # raw scores: the exponential scales them


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_float_mask_adds_its_element_in_log2_units(rng, dtype):
    """The score mod reads mask[b, h, row, col] (bfloat16 as its bits); past seqlen_q or
    seqlen_k (rows and keys whose scores are masked or never stored) it reads the nearest
    element inside, never outside the mask."""
    values = rng.standard_normal((2, 3, 5, 7)).astype(np.float32)
    if dtype == "bfloat16":
        mask = bf16_bits(np, values)
        values = bf16_values(np, mask)
    else:
        mask = values = values.astype(dtype)
    mod = make_score_mod(AttentionSpec(16, "float32", attn_mask=dtype))
    assert mod.active
    offset = 7 - 5
    for row in range(7):
        for col in range(9):
            got = mod.score(np.float32(1.5), np.float32(2.0), np.float32(0), row, col, offset, 7,
                            (mask, 1, 2, ()))
            want = 3.0 + float(values[1, 2, min(row, 4), min(col, 6)]) * float(LOG2E)
            assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), (row, col)


def test_a_bool_mask_hides_what_it_says_and_everything_outside_the_bounds(rng):
    mask = rng.random((1, 2, 4, 6)) < 0.5
    window = AttentionSpec(16, "float32", attn_mask="bool", window_left=1, window_right=1)
    seen = make_mask(window, key_bound=False)
    offset = 6 - 4
    truth = _truth(window, 4, 6) & mask[0, 1]
    got = np.array([[seen(i, j, 6, offset, (mask, 0, 1, ()), True) for j in range(8)]
                    for i in range(6)])
    assert np.array_equal(got[:4, :6], truth)
    assert not got[4:].any() and not got[:, 6:].any()  # (rows, keys past the ends: not read)
    partial = make_block_range(window, 4, 4)[3]
    assert partial(0, 0, 4, 6)  # every tile of a masked call is partial


def test_a_tile_mask_mod_sees_whole_skips_its_predicate():
    """tile_mask: nothing on a tile no bound cuts and mask_mod sees whole (FULL), the bounds
    alone where they cut it, mask_mod too where mask_mod cuts (PARTIAL) or hides it; and
    visible asks mask_mod only when told to."""
    for bounds in (False, True):
        assert tile_mask(bounds, PARTIAL) == tile_mask(bounds, EMPTY) == MASK_ALL
    assert tile_mask(False, FULL) == MASK_NONE and tile_mask(True, FULL) == MASK_BOUNDS
    seen = make_mask(AttentionSpec(16, "float32", causal=True, mask_mod=striped_mask))
    causal = _truth(_spec(True, (-1, -1)), 40, 40)
    stripes = np.array([[striped_mask(1, 0, i, j) for j in range(40)] for i in range(40)])
    for with_mod, want in ((False, causal), (True, causal & stripes)):
        got = np.array([[seen(i, j, 40, 0, (None, 1, 0, ()), with_mod) for j in range(40)]
                        for i in range(40)])
        assert np.array_equal(got, want), with_mod
