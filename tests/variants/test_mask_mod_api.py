"""mask_mod and block_mask at the API: a mask_mod means the boolean mask it returns at every
index (checked against attn_mask holding that mask, computed here one index at a time), with
the other options and in varlen; the Numba kernels (simulator) agree with float64 with and
without a block mask, which builds its tile tables once; the tile tables are what a loop over
the tiles says; bad functions and block masks get a TypeError or ValueError naming them
before any kernel runs. The kernels' own cases (more masks, both families) are
tests/variants/test_*_kernels.py'."""
import functools
import types

import numpy as np
import pytest
from error_rule import assert_within_rule

import numba_flash
from numba_flash import registry
from numba_flash.extras import Extras
from numba_flash.mask_mod import lower
from numba_flash.reference import attention_backward, attention_forward
from numba_flash.spec import check_mask_mod, make_spec

BATCH, SEQLEN_Q, SEQLEN_K, NHEADS, NHEADS_KV, HEAD_DIM = 2, 11, 14, 4, 2, 8
DOCUMENTS = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 4, 4], np.int32)


def document(b, h, q_idx, kv_idx):
    return DOCUMENTS[q_idx + SEQLEN_K - SEQLEN_Q] == DOCUMENTS[kv_idx]


def per_head_stripes(b, h, q_idx, kv_idx):
    return (kv_idx + h + 2 * b) % 3 != 0


def prefix_lm(b, h, q_idx, kv_idx):
    if kv_idx < 4:  # (an `if`: evaluated one index at a time by the reference)
        return True
    return kv_idx <= q_idx + SEQLEN_K - SEQLEN_Q


MASK_MODS = [document, per_head_stripes, prefix_lm]


def _grid(mask_mod, shape):
    """mask_mod at every index, one call per index (the test's own loop)."""
    return np.array([bool(mask_mod(*index)) for index in np.ndindex(*shape)]).reshape(shape)


def _qkv(rng, dtype=np.float64, batch=BATCH):
    q = rng.standard_normal((batch, SEQLEN_Q, NHEADS, HEAD_DIM)).astype(dtype)
    k, v = (rng.standard_normal((batch, SEQLEN_K, NHEADS_KV, HEAD_DIM)).astype(dtype)
            for _ in range(2))
    return q, k, v


@pytest.fixture
def no_backend(monkeypatch):
    def refuse(*args):
        raise AssertionError("a backend was chosen for a call with a bad argument")
    monkeypatch.setattr(registry, "resolve", refuse)


# ---- 1. what a mask_mod means (the float64 reference) --------------------------------------

@pytest.mark.parametrize("mask_mod", MASK_MODS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("causal", [False, True])
def test_a_mask_mod_means_the_boolean_mask_it_returns(rng, mask_mod, causal):
    q, k, v = _qkv(rng)
    mask = _grid(mask_mod, (BATCH, NHEADS, SEQLEN_Q, SEQLEN_K))
    options = dict(causal=causal, softcap=3.0, backend="numpy")
    out, lse = numba_flash.forward(q, k, v, mask_mod=mask_mod, **options)
    want_out, want_lse = numba_flash.forward(q, k, v, attn_mask=mask, **options)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)
    dout = rng.standard_normal(q.shape)
    grads = numba_flash.backward(dout, q, k, v, out, lse, mask_mod=mask_mod, **options)
    wants = numba_flash.backward(dout, q, k, v, out, lse, attn_mask=mask, **options)
    for got, want in zip(grads, wants):
        np.testing.assert_array_equal(got, want)
    if not causal:  # (prefix_lm within causal is causal)
        plain = numba_flash.forward(q, k, v, **options)[0]
        assert np.abs(plain - out).max() > 1e-3  # (the mask hides something)


def test_a_mask_mod_combines_with_an_attn_mask_and_a_window(rng):
    q, k, v = _qkv(rng)
    given = rng.random((BATCH, 1, SEQLEN_Q, SEQLEN_K)) < 0.8
    mask = _grid(per_head_stripes, (BATCH, NHEADS, SEQLEN_Q, SEQLEN_K)) & given
    options = dict(window_size=(5, 2), backend="numpy")
    got = numba_flash.forward(q, k, v, attn_mask=given, mask_mod=per_head_stripes, **options)
    want = numba_flash.forward(q, k, v, attn_mask=mask, **options)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_varlen_gives_mask_mod_the_sequence_and_its_own_indices(rng):
    lengths = [(5, 9), (11, 14), (3, 3)]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(side)]).astype(np.int32)
                  for side in zip(*lengths))
    q = rng.standard_normal((int(cu_q[-1]), NHEADS, HEAD_DIM))
    k, v = (rng.standard_normal((int(cu_k[-1]), NHEADS_KV, HEAD_DIM)) for _ in range(2))
    varlen = (cu_q, cu_k, 11, 14)
    out, lse = numba_flash.forward_varlen(q, k, v, *varlen, mask_mod=per_head_stripes,
                                          backend="numpy")
    for b, (n_q, n_k) in enumerate(lengths):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        mask = _grid(lambda _, h, i, j: per_head_stripes(b, h, i, j), (1, NHEADS, n_q, n_k))
        want_out, want_lse = numba_flash.forward(q[None, rows], k[None, keys], v[None, keys],
                                                 attn_mask=mask, backend="numpy")
        np.testing.assert_allclose(out[rows], want_out[0], rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(lse[:, rows], want_lse[0], rtol=1e-13, atol=1e-14)


# ---- 2. the Numba kernels (simulator) --------------------------------------------------------

def _assert_like_float64(q, k, v, dout, out, lse, grads, mask_mod, dtype, **options):
    spec = make_spec(q, k, mask_mod=mask_mod, **options)
    extras = Extras(mask_mod_arrays=lower(mask_mod)[1])
    plain = np.float32 if dtype == np.float32 else np.float64
    ref_out, ref_lse = attention_forward(np, q, k, v, spec, np.float64, extras)
    base_out, _ = attention_forward(np, q, k, v, spec, plain, extras)
    assert_within_rule("out", out, base_out, ref_out, "float32")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=0, atol=1e-5)
    refs = attention_backward(np, dout, q, k, v, out, lse, spec, np.float64, extras)
    bases = attention_backward(np, dout, q, k, v, out, lse, spec, plain, extras)
    for name, got, base, ref in zip(("dq", "dk", "dv"), grads, bases, refs):
        assert_within_rule(name, got, base, ref, "float32")


def test_the_simt_kernels_take_a_mask_mod_and_a_block_mask_built_once(rng, monkeypatch):
    from numba_flash.backends.numba import tile_classes
    builds = []
    build = tile_classes.TileTables._build
    monkeypatch.setattr(tile_classes.TileTables, "_build",
                        lambda self, *shape: builds.append(shape) or build(self, *shape))
    q, k, v = _qkv(rng, np.float32, batch=1)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    blocks = numba_flash.block_mask(per_head_stripes, 1, None, SEQLEN_Q, SEQLEN_K)
    options = dict(causal=True, backend="numba-simt")
    for call in range(2):
        out, lse = numba_flash.forward(q, k, v, block_mask=blocks, **options)
        grads = numba_flash.backward(dout, q, k, v, out, lse, block_mask=blocks,
                                     mask_mod=per_head_stripes, **options)
        _assert_like_float64(q, k, v, dout, out, lse, grads, per_head_stripes, np.float32,
                             causal=True)
        if call == 0:
            first = len(builds)
            assert first == 3  # (the forward's tiles, the dK/dV kernel's, the dQ kernel's)
        assert len(builds) == first  # the second call reuses them
    again = numba_flash.forward(q, k, v, mask_mod=per_head_stripes, **options)  # no block mask
    np.testing.assert_array_equal(again[0], out)
    assert len(builds) == first + 1


def _near_diagonal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx + 2


def test_varlen_sequences_of_different_lengths_get_their_own_tiles(rng):
    """A mask_mod that reads neither b nor h still gets one table per sequence in varlen:
    the short sequence's tiles (mostly past its end) must not stand for the long one's."""
    lengths = (5, 70)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v = (rng.standard_normal((int(cu[-1]), 2, HEAD_DIM)).astype(np.float32)
               for _ in range(3))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    varlen = (cu, cu, max(lengths), max(lengths))
    got = numba_flash.forward_varlen(q, k, v, *varlen, mask_mod=_near_diagonal,
                                     backend="numba-simt")
    want = numba_flash.forward_varlen(q.astype(np.float64), k.astype(np.float64),
                                      v.astype(np.float64), *varlen, mask_mod=_near_diagonal,
                                      backend="numpy")
    np.testing.assert_allclose(got[0], want[0], atol=2e-5, rtol=0)
    np.testing.assert_allclose(got[1], want[1], atol=2e-5, rtol=0)
    grads = numba_flash.backward_varlen(dout, q, k, v, *got, *varlen, mask_mod=_near_diagonal,
                                        backend="numba-simt")
    wants = numba_flash.backward_varlen(dout.astype(np.float64), q.astype(np.float64),
                                        k.astype(np.float64), v.astype(np.float64), *want,
                                        *varlen, mask_mod=_near_diagonal, backend="numpy")
    for got_grad, want_grad in zip(grads, wants):
        np.testing.assert_allclose(got_grad, want_grad, atol=1e-4, rtol=0)


# ---- 3. the tile tables -------------------------------------------------------------------

def test_the_tile_tables_are_what_a_loop_over_the_tiles_says():
    from numba_flash.backends.numba.tile_classes import TileTables
    from numba_flash.spec import AttentionSpec
    group, block_m, block_n = 2, 4, 3
    spec = AttentionSpec(HEAD_DIM, "float32", group=group, mask_mod=per_head_stripes)
    sizes = (BATCH, NHEADS, SEQLEN_Q, SEQLEN_K)
    tables = TileTables(spec, None, sizes, lambda shape, dtype: np.full(shape, 77, dtype), 0, 0,
                        ())
    classes, query_spans, captured = tables.arguments(block_m, block_n, along_keys=False)
    _, key_spans, _ = tables.arguments(block_m, block_n, along_keys=True)
    assert captured == ()
    seen = _grid(per_head_stripes, sizes)
    m_tiles, n_tiles = -(-SEQLEN_Q // block_m), -(-SEQLEN_K // block_n)
    for b in range(BATCH):
        for h in range(NHEADS):
            for m in range(m_tiles):
                for n in range(n_tiles):
                    tile = seen[b, h, m * block_m:(m + 1) * block_m, n * block_n:(n + 1) * block_n]
                    assert classes[b, h, m, n] == (2 if tile.all() else 1 if tile.any() else 0)
                visited = [n for n in range(n_tiles) if classes[b, h, m, n]]
                want = (visited[0], visited[-1] + 1) if visited else (0, 0)
                assert tuple(query_spans[b, h, m]) == want
        for h_kv in range(NHEADS // group):
            for n in range(n_tiles):
                visited = [m for h in range(h_kv * group, h_kv * group + group)
                           for m in range(m_tiles) if classes[b, h, m, n]]
                want = (min(visited), max(visited) + 1) if visited else (0, 0)
                assert tuple(key_spans[b, h_kv, n]) == want


def _everywhere(b, h, q_idx, kv_idx):
    return q_idx >= 0


@pytest.mark.parametrize("window", [(-1, 0), (3, 2)], ids=["causal", "window"])
def test_tiles_hidden_by_the_window_are_empty_and_a_mask_mod_without_b_and_h_has_one_table(
        window):
    """mask_mod lets every query see every key: the tiles causal or the window hides wholly
    are EMPTY (no kernel visits them: mask_mod is not asked there), the others FULL (mask_mod
    alone classifies them, whatever the bounds cut); one table serves the batch and heads."""
    from numba_flash.backends.numba.tile_classes import TileTables
    from numba_flash.spec import AttentionSpec
    block_m, block_n = 4, 3
    left, right = window
    spec = AttentionSpec(HEAD_DIM, "float32", group=2, mask_mod=_everywhere, window_left=left,
                         window_right=right)
    assert (spec.mask_mod.reads_batch, spec.mask_mod.reads_head) == (False, False)
    tables = TileTables(spec, None, (BATCH, NHEADS, SEQLEN_Q, SEQLEN_K),
                        lambda shape, dtype: np.full(shape, 77, dtype), 0, 0, ())
    classes, _, _ = tables.arguments(block_m, block_n, along_keys=False)
    built = next(iter(tables.block_mask._tables.values()))[0]
    assert built.shape[:2] == (1, 1)
    offset = SEQLEN_K - SEQLEN_Q
    for m in range(-(-SEQLEN_Q // block_m)):
        rows = np.arange(m * block_m, min(SEQLEN_Q, (m + 1) * block_m))
        for n in range(-(-SEQLEN_K // block_n)):
            keys = np.arange(n * block_n, min(SEQLEN_K, (n + 1) * block_n))
            seen = np.ones((len(rows), len(keys)), bool)
            if right >= 0:
                seen &= keys[None, :] <= rows[:, None] + offset + right
            if left >= 0:
                seen &= keys[None, :] >= rows[:, None] + offset - left
            assert (classes[:, :, m, n] == (2 if seen.any() else 0)).all(), (m, n)


@pytest.mark.parametrize("mask_mod, reads", [
    (document, (False, False)), (per_head_stripes, (True, True)),
    (lambda b, h, q_idx, kv_idx: (h % 2 == 0) | (q_idx >= kv_idx), (False, True)),
    (lambda b, h, i, j: b > 0 if i > j else b < 0, (True, False)),
    (lambda *index: index[1] % 2 == 0, (True, True)),
    (lambda b, *rest: rest[0] > 0, (False, True))])
def test_a_programs_code_says_whether_it_reads_b_and_h(mask_mod, reads):
    program = lower(mask_mod)[0]
    assert (program.reads_batch, program.reads_head) == reads

    def with_a_closure_over_b(b, h, q_idx, kv_idx):
        def inner():
            return b
        return inner() > 0
    assert lower(with_a_closure_over_b)[0].reads_batch


# ---- 4. bad functions and block masks: named, before any backend or kernel ------------------

def _three(b, h, q_idx):
    return True


@pytest.mark.parametrize("mask_mod, message", [
    (np.ones((2, 2), bool), "mask_mod must be a Python function .* got ndarray"),
    (len, "mask_mod must be a Python function .* got builtin_function_or_method"),
    (_three, "'_three', which does not take four positional arguments"),
])
def test_a_mask_mod_that_is_not_a_function_of_four_indices_is_refused(rng, no_backend,
                                                                      mask_mod, message):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match=message):
        numba_flash.forward(q, k, v, mask_mod=mask_mod)


def _five(b, h, q_idx, kv_idx, extra):
    return True


def test_the_four_index_check_follows_a_functions_defaults_not_only_its_code(rng, no_backend):
    """The check keeps its verdicts by code and defaults (not by function, which would keep
    the arrays a function captures alive): of two functions of one code, the one whose fifth
    parameter has a default takes four indices, the other does not, asked in either order;
    wrappers of one code each get their wrapped function's verdict."""
    q, k, v = _qkv(rng)
    with_default = types.FunctionType(_five.__code__, _five.__globals__, "_five", (1,))
    for _ in range(2):
        with pytest.raises(TypeError, match="'_five', which does not take four positional"):
            numba_flash.forward(q, k, v, mask_mod=_five)
        assert check_mask_mod(with_default) is with_default
    # wrappers share their code; their signatures are what they wrap
    wrapped_five, wrapped_four = (functools.wraps(f)(lambda *args: f(*args))
                                  for f in (_five, with_default))
    for _ in range(2):
        assert check_mask_mod(wrapped_four) is wrapped_four
        with pytest.raises(TypeError, match="does not take four positional"):
            check_mask_mod(wrapped_five)


def _raises(b, h, q_idx, kv_idx):
    return DOCUMENTS[q_idx + 1000] == 0


def _not_bool(b, h, q_idx, kv_idx):
    return q_idx * 1.5


@pytest.mark.parametrize("mask_mod, message", [
    (_raises, "mask_mod '_raises' failed at index \\(0, 0, 0, 0\\): IndexError"),
    (_not_bool, "mask_mod '_not_bool' must return a bool; it returned float"),
])
def test_a_mask_mod_the_kernels_cannot_use_is_refused_before_any_launch(
        rng, monkeypatch, mask_mod, message):
    from numba_flash.backends.numba.backend import NumbaBackend
    monkeypatch.setattr(NumbaBackend, "_new", lambda *args: pytest.fail("an output was made"))
    q, k, v = _qkv(rng, np.float32, batch=1)
    with pytest.raises(TypeError, match=message):
        numba_flash.forward(q, k, v, mask_mod=mask_mod, backend="numba-simt")
    with pytest.raises((TypeError, ValueError), match="mask_mod"):
        numba_flash.forward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                            mask_mod=mask_mod, backend="numpy")


@pytest.mark.parametrize("blocks, mask_mod, error, message", [
    ("not a block mask", None, TypeError, "block_mask must be a BlockMask .* got str"),
    (numba_flash.block_mask(document, None, None, SEQLEN_Q, SEQLEN_K + 1), None, ValueError,
     "block_mask was built for seqlen_k = 15; the call has seqlen_k = 14"),
    (numba_flash.block_mask(document, 3, None, SEQLEN_Q, SEQLEN_K), None, ValueError,
     "block_mask was built for batch = 3; the call has batch = 2"),
    (numba_flash.block_mask(document, None, None, SEQLEN_Q, SEQLEN_K), prefix_lm, ValueError,
     "mask_mod and block_mask disagree: block_mask was built for 'document', mask_mod is "
     "'prefix_lm'"),
])
def test_a_block_mask_that_does_not_fit_the_call_is_refused(rng, no_backend, blocks, mask_mod,
                                                            error, message):
    q, k, v = _qkv(rng)
    with pytest.raises(error, match=message):
        numba_flash.forward(q, k, v, mask_mod=mask_mod, block_mask=blocks)


@pytest.mark.parametrize("arguments, error, message", [
    ((None, 1, 1, 4, 4), TypeError, "mask_mod must be a Python function"),
    ((document, 0, 1, 4, 4), ValueError, "batch must be an int >= 1 or None"),
    ((document, 1, 1.5, 4, 4), TypeError, "nheads must be an int >= 1 or None"),
    ((document, 1, 1, None, 4), TypeError, "seqlen_q must be an int >= 1; got None"),
])
def test_block_mask_checks_its_arguments(arguments, error, message):
    with pytest.raises(error, match=message):
        numba_flash.block_mask(*arguments)


def test_a_mask_mod_numba_cannot_compile_gets_its_reason_in_short():
    """The check the GPU path runs (cuda.compile_ptx, which needs no GPU), outside the
    simulator: in a process of its own, since Numba's mode is fixed when it is imported."""
    import os
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent('''
        from numba_flash.backends.numba.tile_classes import check_mask_mod
        from numba_flash.mask_mod import lower
        def undefined(b, h, q_idx, kv_idx):
            return missing_name[q_idx] > 0
        def not_bool(b, h, q_idx, kv_idx):
            return q_idx * 1.5
        def fine(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
        check_mask_mod(*lower(fine))
        for mask_mod in (undefined, not_bool):
            try:
                check_mask_mod(*lower(mask_mod))
            except TypeError as error:
                print(error)
        ''')
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, NUMBA_ENABLE_CUDASIM="0"), timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    undefined, not_bool = run.stdout.splitlines()
    assert undefined.startswith("mask_mod 'undefined' does not compile for the Numba kernels: ")
    assert "missing_name" in undefined and len(undefined) < 500
    assert not_bool == ("mask_mod 'not_bool' must return a bool; for int64 indices it returns "
                        "float64")
