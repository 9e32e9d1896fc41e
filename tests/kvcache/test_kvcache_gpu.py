"""forward_kvcache on a GPU at real sizes (`-m gpu`): the decode kernels (numba and numba-mma:
tensor cores; numba-simt)
against float64 attention over the appended caches by the accuracy rule (baseline: the cupy
backend, float16 standard attention, or the plain 16-bit one for bfloat16), contiguous and
paged (block sizes 16 and 256, permuted), splits chosen and forced, the caches equal to the
reference's append bit for bit."""
import numpy as np
import pytest
from error_rule import assert_within_rule

import numba_flash
from numba_flash.extras import NO_EXTRAS
from numba_flash.kvcache import check_kvcache
from numba_flash.reference_kvcache import append, attention_forward_kvcache
from numba_flash.spec import make_spec
from numba_flash.testing import plain16_forward, round16

pytestmark = pytest.mark.gpu

CASES = [  # (batch, seqlen_q, heads, kv_heads, capacity, new tokens, block size, causal)
    (16, 1, 32, 8, 4096, 1, None, False),
    (4, 4, 32, 4, 4096, 4, 16, True),
    (2, 1, 32, 32, 8192, 0, 256, False),
    (1, 33, 8, 1, 2048, 33, 16, True),
]


@pytest.mark.parametrize("backend", ["numba", "numba-mma", "numba-simt"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}-q{c[1]}-H{c[2]}/{c[3]}-N{c[4]}-page"
                                             f"{c[6]}" for c in CASES])
@pytest.mark.parametrize("num_splits", [0, 7])
def test_forward_kvcache_on_the_gpu(cp, rng, backend, dtype, case, num_splits):
    batch, seqlen_q, heads, kv_heads, capacity, new_tokens, block_size, causal = case
    torch = pytest.importorskip("torch")

    def values(shape):
        return round16(cp, cp.asarray(rng.standard_normal(shape), cp.float32), dtype)

    q = values((batch, seqlen_q, heads, 128))
    if block_size:
        blocks = batch * capacity // block_size + 5
        k_cache, v_cache = (values((blocks, block_size, kv_heads, 128)) for _ in range(2))
        table = cp.asarray(rng.permutation(blocks)[:batch * capacity // block_size]
                           .reshape(batch, -1).astype(np.int32))
    else:
        k_cache, v_cache = (values((batch, capacity, kv_heads, 128)) for _ in range(2))
        table = None
    k_new, v_new = (values((batch, new_tokens, kv_heads, 128)) if new_tokens else None
                    for _ in range(2))
    cached = rng.integers(0, capacity - new_tokens + 1, batch).astype(np.int32)
    cached[0] = capacity - new_tokens
    cached_gpu = cp.asarray(cached)

    def as_call(x):
        if x is None:
            return None
        return torch.from_dlpack(x).to(getattr(torch, dtype)).contiguous()

    args = [as_call(x) for x in (q, k_cache, v_cache, k_new, v_new)]
    out, lse = numba_flash.forward_kvcache(*args[:3], k=args[3], v=args[4],
                                           cache_seqlens=cached_gpu, block_table=table,
                                           causal=causal, num_splits=num_splits,
                                           backend=backend)
    _check_call(cp, dtype, (q, k_cache, v_cache, k_new, v_new, cached_gpu, table), causal,
                (out, lse), args[1:3])


def _check_call(cp, dtype, arrays, causal, result, written_caches):
    """A call's (out, lse) against float64 attention over the appended caches (arrays: its
    float32 values before the call), and the caches it wrote equal to the reference's append."""
    q, k_cache, v_cache, k_new, v_new, cached, table = arrays
    want_k, want_v = k_cache.copy(), v_cache.copy()
    cache = check_kvcache(q, want_k, want_v, k_new, v_new, cached, table, 0)
    append(cache)
    spec = make_spec(q, k_cache, causal=causal)
    ref = attention_forward_kvcache(cp, q, want_k, want_v, cache, spec, "float64", NO_EXTRAS)
    base = attention_forward_kvcache(cp, q, want_k, want_v, cache, spec, dtype, NO_EXTRAS,
                                     forward=plain16_forward)
    out, lse = result
    assert_within_rule("out", out.float().cpu().numpy(), base[0].get(), ref[0].get(), dtype)
    assert_within_rule("lse", lse.cpu().numpy(), base[1].get(), ref[1].get(), "float32")
    for written, want in zip(written_caches, (want_k, want_v)):
        assert bool(cp.all(cp.asarray(written.float()) == want))


@pytest.mark.parametrize("backend", ["numba", "numba-simt"])
def test_decode_steps_replay_the_launches(cp, rng, poisoned_outputs, monkeypatch, backend):
    """Decode steps on a paged cache, one new token per sequence and step, new queries and
    lengths each step: from the second step on the call is a replay (the backend's
    forward_kvcache is not entered), with the reference's results and appended caches."""
    from numba_flash.backends.numba.backend import NumbaBackend
    torch = pytest.importorskip("torch")
    batch, heads, kv_heads, block_size, max_blocks = 4, 16, 4, 16, 64
    blocks = batch * max_blocks

    def values(shape):
        return round16(cp, cp.asarray(rng.standard_normal(shape), cp.float32), "float16")

    k_cache, v_cache = (values((blocks, block_size, kv_heads, 128)) for _ in range(2))
    table = cp.asarray(rng.permutation(blocks).reshape(batch, max_blocks).astype(np.int32))
    lengths = rng.integers(0, blocks * block_size // batch - 4, batch).astype(np.int32)
    caches = [torch.from_dlpack(x).to(torch.float16).contiguous() for x in (k_cache, v_cache)]
    for step in range(3):
        q, k_new, v_new = (values((batch, 1, h, 128)) for h in (heads, kv_heads, kv_heads))
        before = [cp.asarray(x.float()) for x in caches]
        call = [torch.from_dlpack(x).to(torch.float16) for x in (q, k_new, v_new)]
        out, lse = numba_flash.forward_kvcache(call[0], *caches, k=call[1], v=call[2],
                                               cache_seqlens=cp.asarray(lengths),
                                               block_table=table, causal=True, backend=backend)
        _check_call(cp, "float16", (q, *before, k_new, v_new, cp.asarray(lengths), table), True,
                    (out, lse), caches)
        lengths += 1
        monkeypatch.setattr(NumbaBackend, "forward_kvcache", None)  # a replay never calls it


def test_a_cache_that_cp_async_cannot_read(cp, rng):
    """Caches whose rows are not contiguous along the head dim: numba-mma refuses them before
    the new tokens are written; numba decodes them on the SIMT kernel instead."""
    def values(shape):
        return cp.asarray(rng.standard_normal(shape), cp.float16)

    q, wide = values((2, 1, 2, 128)), values((2, 64, 1, 256))
    k_cache, v_cache = wide[..., ::2], wide[..., 1::2]  # (stride 2 along the head dim)
    k_new, v_new = values((2, 1, 1, 128)), values((2, 1, 1, 128))
    before = wide.copy()
    with pytest.raises(ValueError, match="rows must be contiguous and 16-byte aligned"):
        numba_flash.forward_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=3,
                                    backend="numba-mma")
    assert bool(cp.all(wide == before))
    out, _ = numba_flash.forward_kvcache(q, k_cache, v_cache, cache_seqlens=3, backend="numba")
    want, _ = numba_flash.forward_kvcache(q, k_cache.copy(), v_cache.copy(), cache_seqlens=3,
                                          backend="numba-mma")
    np.testing.assert_allclose(out.get(), want.get(), rtol=0, atol=2e-3)


@pytest.mark.parametrize("library", ["cupy", "torch", "numba"])
def test_lengths_and_pages_given_on_the_host(cp, rng, monkeypatch, library):
    """cache_seqlens and block_table as host arrays with q on the GPU (CuPy, torch, Numba
    device arrays): checked without reading anything back from the GPU, in the full path and
    the replay (Numba's arrays: the full path twice), with the results of the same call given
    them on the GPU; bad host values refused with the caches untouched."""
    from numba_flash import call_cache, kvcache
    torch = pytest.importorskip("torch")
    batch, block_size, max_blocks = 3, 16, 8

    def values(shape):
        x = cp.asarray(rng.standard_normal(shape), cp.float16)
        if library == "numba":
            from numba import cuda
            return cuda.as_cuda_array(x)
        return torch.from_dlpack(x) if library == "torch" else x

    q = values((batch, 1, 8, 128))
    k_cache, v_cache = (values((batch * max_blocks, block_size, 2, 128)) for _ in range(2))
    table = rng.permutation(batch * max_blocks).reshape(batch, max_blocks).astype(np.int32)
    host = torch.from_numpy if library == "torch" else np.asarray
    read_back = kvcache.host_values
    for lengths in ([5, 100, 0], [128, 1, 77]):
        lengths = np.asarray(lengths, np.int32)
        on_gpu = numba_flash.forward_kvcache(q, k_cache, v_cache, cache_seqlens=cp.asarray(lengths),
                                             block_table=cp.asarray(table), backend="numba")
        monkeypatch.setattr(kvcache, "host_values", None)  # nothing is read back
        call_cache.clear()  # (the copies of CuPy's host values have the GPU call's signature)
        for _ in range(2):  # the full path, then a replay
            got = numba_flash.forward_kvcache(q, k_cache, v_cache, cache_seqlens=host(lengths),
                                              block_table=host(table), backend="numba")
            for a, b in zip(got, on_gpu):
                assert bool(cp.all(cp.asarray(a) == cp.asarray(b)))
        monkeypatch.setattr(kvcache, "host_values", read_back)
    before = [cp.asarray(x).copy() for x in (k_cache, v_cache)]
    k_new = values((batch, 1, 2, 128))
    with pytest.raises(ValueError, match="sequence 0 would hold 129 tokens"):
        numba_flash.forward_kvcache(q, k_cache, v_cache, k=k_new, v=k_new,
                                    cache_seqlens=host(np.full(batch, 128, np.int32)),
                                    block_table=host(table), backend="numba")
    for x, was in zip((k_cache, v_cache), before):
        assert bool(cp.all(cp.asarray(x) == was))
