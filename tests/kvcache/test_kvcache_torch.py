"""numba_flash.torch.forward_kvcache: the torch.library op numba_flash::forward_kvcache passes
opcheck (it declares that it writes the caches), and a decode step compiled with
fullgraph=True (under no_grad, as inference runs) gives eager's output and leaves the caches
as eager does (the numpy backend under the simulator: the op is the same for every
backend)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import numba_flash.torch  # noqa: E402


def _decode_inputs(gen, paged):
    q = torch.randn(2, 1, 4, 8, generator=gen, dtype=torch.float64)
    shape = (6, 16, 2, 8) if paged else (2, 32, 2, 8)
    k_cache, v_cache = (torch.randn(shape, generator=gen, dtype=torch.float64)
                        for _ in range(2))
    k, v = (torch.randn(2, 1, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    lengths = torch.tensor([5, 20], dtype=torch.int32)
    table = torch.tensor([[4, 0], [2, 5]], dtype=torch.int32) if paged else None
    return q, k_cache, v_cache, k, v, lengths, table


@pytest.mark.parametrize("paged", [False, True])
def test_the_kvcache_op_passes_opcheck(rng, paged):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    q, k_cache, v_cache, k, v, lengths, table = _decode_inputs(gen, paged)
    options = (True, 0.35, -1, 0, 0.0, None, 0, "numpy")
    torch.library.opcheck(torch.ops.numba_flash.forward_kvcache.default,
                          (q, k_cache, v_cache, k, v, lengths, table, *options))


def test_a_compiled_decode_step_gives_eager_results(rng):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    q, k_cache, v_cache, k, v, lengths, table = _decode_inputs(gen, paged=True)
    proj = torch.nn.Linear(8, 8, dtype=torch.float64)

    def step(q, k_cache, v_cache):
        out, lse = numba_flash.torch.forward_kvcache(
            proj(q), k_cache, v_cache, k=k, v=v, cache_seqlens=lengths, block_table=table,
            causal=True, softcap=4.0, backend="numpy")
        return out.sum(dim=-1), lse

    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    with torch.no_grad():  # (inference: the op has no gradient)
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, *caches[0])
        want = step(q, *caches[1])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-12)
    for a, b in zip(caches[0], caches[1]):
        assert torch.equal(a, b)
    assert not torch.equal(caches[0][0], k_cache)  # (the new token was written)
