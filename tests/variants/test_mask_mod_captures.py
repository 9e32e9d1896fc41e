"""Arrays a mask_mod captures are read at each call, as arguments of the kernels
(numba_flash/mask_mod.py): a new closure of the same code over new arrays, or a global
rebound to a new array, makes the same spec (the same kernels) and the new values' mask; a
changed number makes a new one; what cannot be lowered is a TypeError naming mask_mod."""
import numpy as np
import pytest
from error_rule import assert_within_rule

import numba_flash
from numba_flash.mask_mod import lower
from numba_flash.spec import make_spec

BATCH, SEQLEN, NHEADS, HEAD_DIM = 2, 13, 2, 8
_SHIFTED_IDS = np.zeros(SEQLEN, np.int32)  # (rebound by a test)


def documents_of(ids):
    """A document mask over `ids` (a closure, as a training loop makes one per batch)."""
    def same_document(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]
    return same_document


def global_documents(b, h, q_idx, kv_idx):
    return _SHIFTED_IDS[q_idx] == _SHIFTED_IDS[kv_idx]


def windowed(width):
    def within(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < width
    return within


def _ids(rng):
    return np.sort(rng.integers(0, 4, SEQLEN)).astype(np.int32)


def _qkv(rng):
    return [rng.standard_normal((BATCH, SEQLEN, NHEADS, HEAD_DIM)) for _ in range(3)]


def _mask(ids):
    return (ids[:, None] == ids[None, :])[None, None]


def test_closures_of_one_code_over_other_arrays_make_one_program(rng):
    first, second = _ids(rng), _ids(rng)
    program, arrays = lower(documents_of(first))
    again, other_arrays = lower(documents_of(second))
    assert again is program and program.captured == ("ids",)
    assert arrays[0] is first and other_arrays[0] is second
    assert program.function(0, 0, 3, 3, first) and program.name == "same_document"
    q, k, _ = _qkv(rng)
    assert make_spec(q, k, mask_mod=documents_of(first)) == make_spec(
        q, k, mask_mod=documents_of(second))


LIMIT = 3


def below_the_limit(b, h, q_idx, kv_idx):
    return q_idx - kv_idx < LIMIT


def test_a_changed_number_makes_another_program_and_the_same_one_the_same():
    global LIMIT
    assert lower(windowed(3))[0] is lower(windowed(3))[0]
    assert lower(windowed(3))[0] is not lower(windowed(4))[0]
    assert lower(windowed(3))[0] is not lower(windowed(3.0))[0]  # (another type)
    assert lower(windowed(3))[1] == ()
    before = lower(below_the_limit)[0]
    LIMIT = 4  # (a global rebound: the same function object, another program and spec)
    try:
        after = lower(below_the_limit)[0]
    finally:
        LIMIT = 3
    assert after is not before and after != before and after.function is before.function


def test_defaults_are_constants_and_arrays_follow_the_four_indices(rng):
    """Lambdas made in a loop with a default (w=w) are programs of their own; a mask_mod
    with a defaulted parameter and a captured array takes the array after the indices."""
    narrow, wide = (lambda b, h, q_idx, kv_idx, w=w: q_idx - kv_idx < w for w in (1, 8))
    assert lower(narrow)[0] is not lower(wide)[0]
    ids = _ids(rng)

    def document_window(b, h, q_idx, kv_idx, width=4):
        return ids[q_idx] == ids[kv_idx] and q_idx - kv_idx < width
    program, arrays = lower(document_window)
    assert program.captured == ("ids",) and arrays[0] is ids
    q, k, v = _qkv(rng)
    rows, cols = np.arange(SEQLEN)[:, None], np.arange(SEQLEN)[None, :]
    for mask_mod, mask in ((narrow, rows - cols < 1), (wide, rows - cols < 8),
                           (document_window, (ids[:, None] == ids[None, :]) & (rows - cols < 4))):
        got = numba_flash.forward(q, k, v, mask_mod=mask_mod, backend="numpy")
        want = numba_flash.forward(q, k, v, attn_mask=mask[None, None], backend="numpy")
        np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("backend", ["numpy", "numba-simt"])
def test_each_call_reads_the_arrays_it_is_given(rng, backend):
    """Two batches' document ids through closures of one code, then a global rebound to a
    new array: each call's output is attention under its own mask (float64, the simulator's
    kernels by the accuracy rule), forward and backward. (The tensor-core kernels read
    captured arrays in tests/variants/test_tensor_core_kernels.py's mask_mod cases.)"""
    global _SHIFTED_IDS
    dtype = np.float64 if backend == "numpy" else np.float32
    q, k, v = (x.astype(dtype) for x in _qkv(rng))
    dout = rng.standard_normal(q.shape).astype(dtype)
    calls = [documents_of(_ids(rng)), documents_of(_ids(rng))]
    ids = [fn.__closure__[0].cell_contents for fn in calls]
    for mask_mod, mask_ids in zip(calls + [global_documents], ids + [None]):
        if mask_ids is None:
            _SHIFTED_IDS = mask_ids = _ids(rng)
        out, lse = numba_flash.forward(q, k, v, mask_mod=mask_mod, backend=backend)
        grads = numba_flash.backward(dout, q, k, v, out, lse, mask_mod=mask_mod,
                                     backend=backend)
        got = (out, lse, *grads)
        wants = _with_attn_mask(dout, q, k, v, _mask(mask_ids), np.float64)
        if backend == "numpy":
            for x, want in zip(got, wants):
                np.testing.assert_allclose(x, want, rtol=1e-12, atol=1e-13)
            continue
        bases = _with_attn_mask(dout, q, k, v, _mask(mask_ids), np.float32)
        np.testing.assert_allclose(lse, wants[1], rtol=0, atol=1e-5)
        for name, x, base, want in zip(("out", "lse", "dq", "dk", "dv"), got, bases, wants):
            if name != "lse":
                assert_within_rule(name, x, base, want, "float32")


def _with_attn_mask(dout, q, k, v, mask, dtype):
    """(out, lse, dq, dk, dv) of the numpy backend in dtype with the mask as attn_mask."""
    dout, q, k, v = (x.astype(dtype) for x in (dout, q, k, v))
    out, lse = numba_flash.forward(q, k, v, attn_mask=mask, backend="numpy")
    return (out, lse, *numba_flash.backward(dout, q, k, v, out, lse, attn_mask=mask,
                                            backend="numpy"))


def test_a_lambda_and_a_block_mask_read_their_captured_arrays(rng):
    q, k, v = (x.astype(np.float32) for x in _qkv(rng))
    ids = _ids(rng)
    mask_mod = lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx]  # noqa: E731
    blocks = numba_flash.block_mask(mask_mod, None, None, SEQLEN, SEQLEN)
    want, base = (numba_flash.forward(*(x.astype(dtype) for x in (q, k, v)),
                                      attn_mask=_mask(ids), backend="numpy")[0]
                  for dtype in (np.float64, np.float32))
    for options in (dict(mask_mod=mask_mod), dict(block_mask=blocks)):
        out = numba_flash.forward(q, k, v, backend="numba-simt", **options)[0]
        assert_within_rule("out", out, base, want, "float32")


def test_varlen_reads_the_captured_arrays_in_each_sequence(rng):
    lengths = [5, 8]
    cu = np.array([0, 5, 13], np.int32)
    flags = rng.random(8) < 0.5  # (which keys of a sequence are visible, by index)
    flags[0] = True

    def visible_key(b, h, q_idx, kv_idx):
        return flags[kv_idx]
    q, k, v = (rng.standard_normal((13, NHEADS, HEAD_DIM)) for _ in range(3))
    out, _ = numba_flash.forward_varlen(q, k, v, cu, cu, 8, 8, mask_mod=visible_key,
                                        backend="numpy")
    for b, n in enumerate(lengths):
        rows = slice(cu[b], cu[b + 1])
        want = numba_flash.forward(q[None, rows], k[None, rows], v[None, rows],
                                   attn_mask=flags[:n][None, None, None], backend="numpy")[0]
        np.testing.assert_allclose(out[rows], want[0], rtol=1e-13, atol=1e-14)


def _no_source():
    namespace = {"ids": np.arange(4)}
    exec("def hidden(b, h, q_idx, kv_idx):\n    return ids[q_idx] == ids[kv_idx]\n",
         namespace)
    return namespace["hidden"]


def _helper_with_array():
    ids = np.arange(4)

    def helper(i):
        return ids[i]

    def calls_helper(b, h, q_idx, kv_idx):
        return helper(q_idx) == helper(kv_idx)
    return calls_helper


def _array_in_a_tuple():
    pair = (np.arange(4), np.arange(4))

    def in_tuple(b, h, q_idx, kv_idx):
        return pair[0][q_idx] == pair[1][kv_idx]
    return in_tuple


def _array_in_a_module():
    import types
    module = types.ModuleType("documents")
    module.IDS = np.arange(4)

    def through_module(b, h, q_idx, kv_idx):
        return module.IDS[q_idx] == module.IDS[kv_idx]
    return through_module


@pytest.mark.parametrize("make, message", [
    (_no_source, "mask_mod 'hidden' captures arrays, so its source is needed"),
    (_helper_with_array, "reaches an array through 'helper' \\(the array 'ids'\\)"),
    (_array_in_a_tuple, "reaches an array through 'pair' \\(the array 0\\)"),
    (_array_in_a_module, "reaches an array through 'module' \\(the array 'IDS'\\)"),
])
def test_what_cannot_be_lowered_is_named(rng, make, message):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match=message):
        numba_flash.forward(q, k, v, mask_mod=make(), backend="numpy")


def test_a_bfloat16_array_is_refused_by_name(rng):
    torch = pytest.importorskip("torch")
    scores = torch.zeros(SEQLEN, dtype=torch.bfloat16)

    def positive(b, h, q_idx, kv_idx):
        return scores[kv_idx] >= 0
    q, k, v = (torch.from_numpy(x) for x in _qkv(rng))
    with pytest.raises(TypeError, match="captures 'scores', a bfloat16 array"):
        numba_flash.forward(q, k, v, mask_mod=positive, backend="numpy")
