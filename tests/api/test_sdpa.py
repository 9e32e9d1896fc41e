"""numba_flash.torch.scaled_dot_product_attention: torch SDPA's layout and meaning (is_causal
top-left aligned, for seqlen_q below, equal to and above seqlen_k; GQA with enable_gqa;
boolean and floating masks; scale), output and gradients against torch's own SDPA in float64
(the numpy backend: the meaning; the Numba kernels under the simulator: one case), and SDPA's
refusals as clear errors."""
import pytest

torch = pytest.importorskip("torch")
import numba_flash.torch  # noqa: E402

F = torch.nn.functional


def _inputs(gen, shape_q, shape_kv, dtype=torch.float64):
    q = torch.randn(*shape_q, generator=gen, dtype=dtype).requires_grad_()
    k, v = (torch.randn(*shape_kv, generator=gen, dtype=dtype).requires_grad_()
            for _ in range(2))
    return q, k, v


def _assert_same(ours, theirs):
    """Outputs (to 1e-12) and the gradients of sum(out · weight) (to 1e-6: the backward
    recomputes P from the float32 lse the forward saved) of two float64 SDPA calls on the same
    inputs."""
    (q, k, v), out = ours
    (q2, k2, v2), want = theirs
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    (out * weight).sum().backward()
    (want * weight).sum().backward()
    assert float((out - want).detach().abs().max()) < 1e-12
    for name, a, b in (("q", q, q2), ("k", k, k2), ("v", v, v2)):
        bound = 1e-6 * max(1.0, float(b.grad.abs().max()))
        assert float((a.grad - b.grad).abs().max()) < bound, name


def _twins(gen, shape_q, shape_kv, dtype=torch.float64):
    ours = _inputs(gen, shape_q, shape_kv, dtype)
    theirs = [x.detach().clone().requires_grad_() for x in ours]
    return ours, theirs


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(9, 9), (6, 11), (12, 5)])
@pytest.mark.parametrize("gqa", [False, True])
def test_is_causal_is_top_left_aligned_as_in_sdpa(rng, seqlen_q, seqlen_k, gqa):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    heads_kv = 2 if gqa else 4
    ours, theirs = _twins(gen, (2, 4, seqlen_q, 8), (2, heads_kv, seqlen_k, 8))
    out = numba_flash.torch.scaled_dot_product_attention(
        *ours, is_causal=True, scale=0.4, enable_gqa=gqa, backend="numpy")
    want = F.scaled_dot_product_attention(*theirs, is_causal=True, scale=0.4, enable_gqa=gqa)
    assert out.shape == want.shape == (2, 4, seqlen_q, 8)
    _assert_same((ours, out), (theirs, want))
    if seqlen_q < seqlen_k:  # keys no query sees get no gradient
        assert not ours[1].grad[:, :, seqlen_q:].any()


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_an_attn_mask_means_what_sdpa_says(rng, kind):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    ours, theirs = _twins(gen, (2, 2, 7, 8), (2, 2, 10, 8))
    if kind == "bool":
        mask = torch.rand(2, 1, 7, 10, generator=gen) < 0.7
        mask[..., 0] = True  # (SDPA gives NaN for a query that sees no key; we give 0)
    else:
        mask = torch.randn(7, 10, generator=gen, dtype=torch.float64)
    out = numba_flash.torch.scaled_dot_product_attention(*ours, attn_mask=mask, backend="numpy")
    want = F.scaled_dot_product_attention(*theirs, attn_mask=mask)
    _assert_same((ours, out), (theirs, want))


def test_the_numba_kernels_run_the_drop_in(rng):
    """float32 through the SIMT kernels (simulator), seqlen_q < seqlen_k causal with GQA."""
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    ours, theirs = _twins(gen, (1, 4, 9, 16), (1, 2, 14, 16), torch.float32)
    out = numba_flash.torch.scaled_dot_product_attention(
        *ours, is_causal=True, enable_gqa=True, backend="numba")
    reference = [x.detach().double().requires_grad_() for x in theirs]  # (float64)
    want = F.scaled_dot_product_attention(*reference, is_causal=True, enable_gqa=True)
    out.sum().backward()
    want.sum().backward()
    assert float((out.double() - want).detach().abs().max()) < 1e-5
    for a, b in zip(ours, reference):
        assert float((a.grad.double() - b.grad).abs().max()) < 1e-4


@pytest.mark.parametrize("call, message", [
    (dict(dropout_p=0.1), "dropout_p must be 0.0: numba_flash has no attention dropout yet"),
    (dict(is_causal=True, attn_mask=torch.ones(5, 5, dtype=torch.bool)),
     "attn_mask and is_causal=True together are not allowed"),
    (dict(kv_heads=2), "key and value have 2 heads and query 4: pass enable_gqa=True"),
    (dict(rank=3), "query, key and value must be 4-D"),
])
def test_what_sdpa_refuses_is_a_clear_error(call, message):
    call = dict(call)
    kv_heads, rank = call.pop("kv_heads", 4), call.pop("rank", 4)
    q = torch.randn(1, 4, 5, 8)
    k = v = torch.randn(1, kv_heads, 5, 8)
    if rank == 3:
        q, k, v = q[0], k[0], v[0]
    with pytest.raises(ValueError, match=message):
        numba_flash.torch.scaled_dot_product_attention(q, k, v, backend="numpy", **call)
