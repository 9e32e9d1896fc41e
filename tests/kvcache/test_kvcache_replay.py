"""Repeated forward_kvcache calls (numba_flash/call_cache.py): a signature seen before skips the
shape checks and the backend's set-up, yet every call reads and checks what cache_seqlens and
block_table hold before anything is written, and computes on its own arrays. Here on the numpy
backend with host signatures (the GPU's replays of the recorded launches: test_kvcache_gpu.py)."""
import weakref

import numpy as np
import pytest

import numba_flash
from numba_flash import kvcache
from numba_flash.extras import NO_EXTRAS, Extras
from numba_flash.reference_kvcache import append, attention_forward_kvcache
from numba_flash.spec import make_spec

BATCH, HEADS, KV_HEADS, HEAD_DIM, BLOCK, BLOCKS_PER_SEQUENCE = 3, 4, 2, 16, 16, 4
CAPACITY = BLOCK * BLOCKS_PER_SEQUENCE


def _paged_call(rng, lengths):
    """One new token per sequence appended to a paged cache (a random permutation of its
    blocks): the call's arrays, float32."""
    blocks = BATCH * BLOCKS_PER_SEQUENCE + 2
    table = rng.permutation(blocks)[:BATCH * BLOCKS_PER_SEQUENCE].reshape(BATCH, -1)
    return dict(
        q=rng.standard_normal((BATCH, 1, HEADS, HEAD_DIM)).astype(np.float32),
        k_cache=rng.standard_normal((blocks, BLOCK, KV_HEADS, HEAD_DIM)).astype(np.float32),
        v_cache=rng.standard_normal((blocks, BLOCK, KV_HEADS, HEAD_DIM)).astype(np.float32),
        k=rng.standard_normal((BATCH, 1, KV_HEADS, HEAD_DIM)).astype(np.float32),
        v=rng.standard_normal((BATCH, 1, KV_HEADS, HEAD_DIM)).astype(np.float32),
        cache_seqlens=np.asarray(lengths, np.int32), block_table=table.astype(np.int32))


def _expected(call, causal):
    """float64 attention over the caches with the new tokens appended (copies)."""
    k_cache, v_cache = call["k_cache"].copy(), call["v_cache"].copy()
    cache = kvcache.check_kvcache(call["q"], k_cache, v_cache, call["k"], call["v"],
                                  call["cache_seqlens"], call["block_table"], 0)
    append(cache)
    slopes = call.get("alibi_slopes")
    spec = make_spec(call["q"], k_cache, causal=causal, alibi=slopes is not None)
    return attention_forward_kvcache(np, call["q"], k_cache, v_cache, cache, spec, np.float64,
                                     NO_EXTRAS if slopes is None else Extras(slopes))


def _run(call, causal=True):
    q, k_cache, v_cache = call["q"], call["k_cache"], call["v_cache"]
    rest = {n: x for n, x in call.items() if n not in ("q", "k_cache", "v_cache")}
    return numba_flash.forward_kvcache(q, k_cache, v_cache, causal=causal, backend="numpy",
                                       **rest)


@pytest.fixture
def counted_checks(monkeypatch):
    """How often the full shape checks and the value checks ran."""
    counts = {"shapes": 0, "values": 0}
    for name, kind in (("check_kvcache", "shapes"), ("_check_values", "values")):
        real = getattr(kvcache, name)

        def counted(*args, real=real, kind=kind):
            counts[kind] += 1
            return real(*args)
        monkeypatch.setattr(kvcache, name, counted)
    return counts


def test_a_repeated_call_checks_its_values_and_computes_on_its_arrays(rng, host_replays,
                                                                      counted_checks):
    _run(_paged_call(rng, [0, 20, CAPACITY - 1]))
    assert counted_checks == {"shapes": 1, "values": 1}
    for lengths in ([5, CAPACITY - 1, 0], [CAPACITY - 1, 1, 33]):
        call = _paged_call(rng, lengths)  # new values, lengths and pages
        want_out, want_lse = _expected(call, True)  # (counted too: one of each)
        out, lse = _run(call)
        np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-5)
        np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-5)
    assert counted_checks == {"shapes": 3, "values": 5}  # the replays: values only


def test_a_replay_takes_each_array_in_its_place(rng, host_replays, counted_checks):
    """Paged, with new tokens and ALiBi's per-sequence slopes: every call gives new values in
    each array (lengths, pages, slopes), and the replays' results are the reference's."""
    for step, lengths in enumerate(([0, 20, CAPACITY - 1], [5, CAPACITY - 1, 0], [40, 7, 33])):
        call = _paged_call(rng, lengths)
        call["alibi_slopes"] = rng.uniform(0.05, 1.0, (BATCH, HEADS)).astype(np.float32)
        want_out, want_lse = _expected(call, True)
        shapes = counted_checks["shapes"]
        out, lse = _run(call)
        assert counted_checks["shapes"] == shapes + (step == 0)  # then replays
        np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-5)
        np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-5)


def test_a_replay_keeps_none_of_the_first_calls_arrays(rng, host_replays):
    """A replay outlives the call that made it: it must not keep that call's arrays (on a GPU,
    their memory) alive."""
    call = _paged_call(rng, [1, 2, 3])
    call["alibi_slopes"] = rng.uniform(0.05, 1.0, (BATCH, HEADS)).astype(np.float32)
    _run(call)
    kept = {name: weakref.ref(x) for name, x in call.items()}
    del call
    assert [name for name, ref in kept.items() if ref() is not None] == []


def test_the_splits_follow_an_int_cache_seqlens(rng):
    """The keys the splits are sized by: with cache_seqlens an int (never replayed), its own
    lengths; with an array, the cache's capacity (one for every call of a signature)."""
    call = _paged_call(rng, [1, 2, 3])
    arrays = (call["q"], call["k_cache"], call["v_cache"], call["k"], call["v"])
    assert kvcache.check_kvcache(*arrays, 5, call["block_table"], 0).max_keys == 6
    assert kvcache.check_kvcache(*arrays, call["cache_seqlens"], call["block_table"],
                                 0).max_keys == CAPACITY


@pytest.mark.parametrize("bad, message", [
    (dict(cache_seqlens=[3, CAPACITY, 0]), r"sequence 1 would hold 65 tokens .* holds 64"),
    (dict(cache_seqlens=[3, -1, 0]), "cache_seqlens must be >= 0; got -1 for sequence 1"),
    (dict(block_table_entry=(1, 2, 99)), r"block_table\[1, 2\] = 99 points outside"),
])
def test_a_repeated_call_with_bad_values_is_refused_and_writes_nothing(rng, host_replays,
                                                                       counted_checks, bad,
                                                                       message):
    _run(_paged_call(rng, [1, 2, 3]))
    call = _paged_call(rng, bad.get("cache_seqlens", [17, 40, 3]))
    if "block_table_entry" in bad:
        b, i, value = bad["block_table_entry"]
        call["block_table"][b, i] = value
    before = call["k_cache"].copy(), call["v_cache"].copy()
    with pytest.raises(ValueError, match=message):
        _run(call)
    assert counted_checks == {"shapes": 1, "values": 2}  # refused by the replay's checks
    assert np.array_equal(call["k_cache"], before[0]) and np.array_equal(call["v_cache"],
                                                                         before[1])


def test_what_decides_a_replay_is_part_of_the_signature(rng, host_replays, counted_checks):
    """Another set of optional arrays, another num_splits or another causal (each call differs
    from one before it in that alone): the full path; the same call again: a replay;
    cache_seqlens as an int (a launch argument): the full path every time."""
    call = _paged_call(rng, [1, 2, 3])
    without_new = {n: x for n, x in call.items() if n not in ("k", "v")}
    for arrays, causal in ((call, True), (without_new, True),
                           ({**without_new, "num_splits": 2}, True), (without_new, False)):
        shapes = counted_checks["shapes"]
        _run(arrays, causal)
        assert counted_checks["shapes"] == shapes + 1
    _run(without_new, causal=False)
    assert counted_checks["shapes"] == 4
    for _ in range(2):
        numba_flash.forward_kvcache(call["q"], call["k_cache"], call["v_cache"],
                                    cache_seqlens=5, block_table=call["block_table"],
                                    backend="numpy")
    assert counted_checks["shapes"] == 6
