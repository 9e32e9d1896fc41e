"""numba_flash.forward_kvcache through the simulated split-KV kernels (numba-simt) and the
numpy backend: against float64 attention over each sequence's cache by the accuracy rule
(the baseline: float32 attention, or the plain 16-bit one), with random cache_seqlens (0, 1,
partly full, full), random page permutations, new tokens appended (the cache outside the
written positions bit-identical), seqlen_q 1 / 4 / 33 with causal, GQA 1 / 4 / 8, window with
softcap, ALiBi, and splits 1, 2, 7 and the heuristic's choice."""
import numpy as np
import pytest
from error_rule import assert_within_rule

import numba_flash
from numba_flash.kvcache import check_kvcache
from numba_flash.reference_kvcache import append, attention_forward_kvcache
from numba_flash.spec import make_spec
from numba_flash.testing import plain16_forward, round16

HEAD_DIM = 16


def _values(rng, shape, dtype):
    x = rng.standard_normal(shape).astype(np.float32)
    return x if dtype == "float32" else round16(np, x, dtype)


def _as(x, dtype):
    """float32 values as the call takes them (bfloat16: a CPU torch tensor)."""
    if dtype == "bfloat16":
        torch = pytest.importorskip("torch")
        return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16)
    return np.ascontiguousarray(x.astype(dtype))


def _host(x):
    if type(x).__module__.startswith("torch"):
        return x.float().numpy()
    return np.asarray(x, np.float32)


def _make(rng, dtype, batch, seqlen_q, nheads, nheads_kv, capacity, new_tokens, paged,
          block_size=16, full_first=False, head_dim=HEAD_DIM):
    """(q, k_cache, v_cache, k, v, cache_seqlens, block_table) in float32 values: lengths
    drawn from 0, 1, partly full and full (before the new tokens), pages a random
    permutation of more blocks than the batch uses."""
    room = capacity - new_tokens
    choices = [0, 1, room // 2, room]
    cached = rng.choice(choices, batch).astype(np.int32)
    if full_first:
        cached[0] = room
    q = _values(rng, (batch, seqlen_q, nheads, head_dim), dtype)
    if paged:
        per_sequence = capacity // block_size
        blocks = batch * per_sequence + 3
        shape = (blocks, block_size, nheads_kv, head_dim)
        table = rng.permutation(blocks)[:batch * per_sequence].reshape(batch, per_sequence)
        table = table.astype(np.int32)
    else:
        shape, table = (batch + 1, capacity, nheads_kv, head_dim), None
    k_cache, v_cache = (_values(rng, shape, dtype) for _ in range(2))
    new = [None, None]
    if new_tokens:
        new = [_values(rng, (batch, new_tokens, nheads_kv, head_dim), dtype) for _ in range(2)]
    return q, k_cache, v_cache, new[0], new[1], cached, table


def _check(dtype, arrays, options, backend="numba-simt", splits=(0,)):
    """Each num_splits' call against float64 attention over the appended caches; the caches
    after each call equal the reference's append bit for bit."""
    q, k_cache, v_cache, k, v, cached, table = arrays
    alibi = options.get("alibi_slopes")
    spec = make_spec(q, k_cache, alibi=alibi is not None,
                     **{n: x for n, x in options.items() if n != "alibi_slopes"})
    want_k, want_v = k_cache.copy(), v_cache.copy()
    cache = check_kvcache(q, want_k, want_v, k, v, cached, table, 0)
    append(cache)
    from numba_flash.extras import Extras
    extras = Extras(alibi)
    ref = attention_forward_kvcache(np, q, want_k, want_v, cache, spec, np.float64, extras)
    base = (attention_forward_kvcache(np, q, want_k, want_v, cache, spec, np.float32, extras)
            if dtype == "float32" else
            attention_forward_kvcache(np, q, want_k, want_v, cache, spec, dtype, extras,
                                      forward=plain16_forward))
    for num_splits in splits:
        k_arg, v_arg = _as(k_cache, dtype), _as(v_cache, dtype)
        out, lse = numba_flash.forward_kvcache(
            _as(q, dtype), k_arg, v_arg, k=None if k is None else _as(k, dtype),
            v=None if v is None else _as(v, dtype), cache_seqlens=cached, block_table=table,
            num_splits=num_splits, backend=backend, **options)
        assert_within_rule(f"out (num_splits={num_splits})", _host(out), base[0], ref[0], dtype)
        assert_within_rule(f"lse (num_splits={num_splits})", _host(lse), base[1], ref[1],
                           "float32")
        np.testing.assert_array_equal(_host(k_arg), want_k)
        np.testing.assert_array_equal(_host(v_arg), want_v)


def test_decoding_one_token_with_each_split(rng):
    """MHA, a contiguous cache, one query token; num_splits 1, 2, 7 and the heuristic's."""
    arrays = _make(rng, "float32", 2, 1, 1, 1, 64, 0, paged=False, full_first=True)
    _check("float32", arrays, {}, splits=(0, 1, 2, 7))


@pytest.mark.parametrize("nheads, paged, dtype, head_dim, shape", [
    (1, False, "float16", HEAD_DIM, (1, 4)), (4, True, "float16", HEAD_DIM, (4, 4)),
    (1, False, "float32", 128, (2, 2))])
def test_the_warps_split_long_caches_between_them(rng, nheads, paged, dtype, head_dim, shape):
    """One and four rows per block (MHA, GQA 4, one token): the warps read keys of their own
    (4 key warps; 2 where 4 would take too much shared memory, two row warps then) and their
    partial softmaxes are merged; caches of up to 300 keys take several block tiles per
    split, sequences of 0 and 1 keys none or one warp's share."""
    from numba_flash.backends.numba.decode.kernels import decode_shape
    spec = make_spec(np.zeros((1, 1, nheads, head_dim), dtype),
                     np.zeros((1, 1, 1, head_dim), dtype))
    assert (decode_shape(spec, nheads).rows, decode_shape(spec, nheads).key_warps) == shape
    arrays = _make(rng, dtype, 3, 1, nheads, 1, 304, 4, paged=paged, full_first=True,
                   head_dim=head_dim)
    _check(dtype, arrays, dict(causal=True), splits=(1, 2))


def test_decoding_with_gqa_8(rng):
    """Eight query heads share each K/V tile their block reads."""
    arrays = _make(rng, "float32", 2, 1, 8, 1, 48, 1, paged=False, full_first=True)
    _check("float32", arrays, {}, splits=(2,))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_speculative_tokens_appended_to_a_paged_cache(rng, dtype):
    """Four new tokens (causal: each sees the cache and the new tokens up to itself),
    written through a permuted block table; GQA 4."""
    arrays = _make(rng, dtype, 2, 4, 4, 1, 64, 4, paged=True)
    _check(dtype, arrays, dict(causal=True), splits=(2,))


def test_a_chunk_of_33_tokens(rng):
    """Chunked prefill: 33 new tokens, causal (three row tiles of a block)."""
    arrays = _make(rng, "float16", 1, 33, 1, 1, 80, 33, paged=False, full_first=True)
    _check("float16", arrays, dict(causal=True), splits=(0,))


def test_window_and_softcap_on_a_paged_cache(rng):
    arrays = _make(rng, "float32", 2, 2, 2, 1, 96, 0, paged=True, block_size=32,
                   full_first=True)
    _check("float32", arrays, dict(window_size=(20, 0), softcap=3.0), splits=(7,))


def test_alibi_per_sequence(rng):
    arrays = _make(rng, "float32", 2, 1, 2, 2, 48, 1, paged=False, full_first=True)
    slopes = rng.uniform(0.05, 0.5, (2, 2)).astype(np.float32)
    _check("float32", arrays, dict(alibi_slopes=slopes), splits=(0,))


@pytest.mark.parametrize("head_dim, dtype, loads", [(16, "float16", "cp.async"),
                                                    (20, "float16", "plain")])
def test_both_load_kinds(rng, head_dim, dtype, loads):
    """cp.async reads rows of whole 16-byte chunks; head dim 20 in float16 (40-byte rows) takes
    the element-by-element loads and tiles padded to whole chunks."""
    from numba_flash.backends.numba.decode.engine import _async_copy
    arrays = _make(rng, dtype, 2, 2, 2, 1, 48, 2, paged=True, head_dim=head_dim)
    q, k_cache, v_cache = (_as(x, dtype) for x in arrays[:3])
    assert _async_copy(make_spec(q, k_cache), q, k_cache, v_cache) == (loads == "cp.async")
    _check(dtype, arrays, dict(causal=True), splits=(2,))


def test_the_numpy_backend_gives_the_reference(rng):
    """The reference backend's path (its own append and per-sequence attention)."""
    arrays = _make(rng, "float32", 3, 4, 4, 2, 64, 2, paged=True)
    _check("float32", arrays, dict(causal=True, softcap=5.0), backend="numpy")
