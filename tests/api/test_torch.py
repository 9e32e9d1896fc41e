"""numba_flash.torch: autograd through our forward and backward, checked against torch's own
math attention (CPU tensors through the simulator; CUDA tensors with `-m gpu`)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import numba_flash.torch  # noqa: E402

MODES = ["simulator", pytest.param("gpu", marks=pytest.mark.gpu)]


def _torch_reference(q, k, v, causal, scale, attn_mask=None):
    """torch math attention in float64 with the bottom-right causal mask of numba_flash (or
    the given attn_mask, an SDPA mask): (out, its float64 leaves q, k, v)."""
    qh, kh, vh = (x.detach().double().transpose(1, 2).requires_grad_() for x in (q, k, v))
    if causal:
        nq, nk = q.shape[1], k.shape[1]
        attn_mask = torch.ones(nq, nk, dtype=torch.bool).tril(diagonal=nk - nq).to(q.device)
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=attn_mask,
                                                           scale=scale)
    return out.transpose(1, 2), (qh, kh, vh)


def _assert_like_reference(out, grads, ref, leaves, weight):
    """Our out and (q, k, v) grads of sum(out · weight) against the float64 reference's."""
    (ref * weight.double()).sum().backward()
    assert float((out.detach().double() - ref.detach()).abs().max()) < 1e-5
    for name, got, leaf in zip("qkv", grads, leaves):
        expected = leaf.grad.transpose(1, 2)
        err = float((got.double() - expected).abs().max())
        assert err < 1e-4 * max(1.0, float(expected.abs().max())), (name, err)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_torch_math_attention(rng, mode, causal):
    device = "cuda" if mode == "gpu" else "cpu"
    seqlen_q, seqlen_k = (19, 27) if mode == "simulator" else (300, 513)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    q, k, v = (torch.randn(2, n, 2, 32, generator=gen).to(device).requires_grad_()
               for n in (seqlen_q, seqlen_k, seqlen_k))
    weight = torch.randn(2, seqlen_q, 2, 32, generator=gen).to(device)

    out = numba_flash.torch.attention(q, k, v, causal=causal, softmax_scale=0.3,
                                      backend="numba")
    assert isinstance(out, torch.Tensor) and out.device == q.device and out.dtype == q.dtype
    (out * weight).sum().backward()

    ref, leaves = _torch_reference(q, k, v, causal, 0.3)
    _assert_like_reference(out, (q.grad, k.grad, v.grad), ref, leaves, weight)


@pytest.mark.parametrize("mode", MODES)
def test_alibi_gradients_match_torch_math_attention_with_the_bias(rng, mode):
    """alibi_slopes through the autograd Function: torch's math attention with the ALiBi bias
    as a float attn_mask (and the causal mask in it) gives the same output and gradients."""
    device = "cuda" if mode == "gpu" else "cpu"
    seqlen_q, seqlen_k = (17, 23) if mode == "simulator" else (300, 513)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    q, k, v = (torch.randn(2, n, 2, 32, generator=gen).to(device).requires_grad_()
               for n in (seqlen_q, seqlen_k, seqlen_k))
    slopes = (torch.rand(2, 2, generator=gen) + 0.1).to(device)
    weight = torch.randn(2, seqlen_q, 2, 32, generator=gen).to(device)
    out = numba_flash.torch.attention(q, k, v, causal=True, alibi_slopes=slopes, backend="numba")
    (out * weight).sum().backward()

    distance = (torch.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q
                - torch.arange(seqlen_k)[None, :]).to(device)
    bias = -slopes.double()[:, :, None, None] * distance.abs().double()
    bias = bias.masked_fill(distance < 0, float("-inf"))  # causal: no key in the future
    ref, leaves = _torch_reference(q, k, v, False, None, attn_mask=bias)
    _assert_like_reference(out, (q.grad, k.grad, v.grad), ref, leaves, weight)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_attn_mask_gradients_match_torch_math_attention(rng, mode, kind):
    """attn_mask through the autograd Function: SDPA's math attention with the same mask (a
    key padding mask per batch entry, or a bias per head broadcast over the batch) gives the
    same output and gradients; the mask gets no gradient."""
    device = "cuda" if mode == "gpu" else "cpu"
    (seqlen_q, seqlen_k), dim = ((9, 11), 8) if mode == "simulator" else ((300, 513), 32)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    q, k, v = (torch.randn(2, n, 2, dim, generator=gen).to(device).requires_grad_()
               for n in (seqlen_q, seqlen_k, seqlen_k))
    if kind == "bool":  # batch entry 1 pads its last keys
        mask = torch.ones(2, 1, 1, seqlen_k, dtype=torch.bool)
        mask[1, ..., seqlen_k - 5:] = False
    else:
        mask = torch.randn(2, seqlen_q, seqlen_k, generator=gen)
    mask = mask.to(device)
    if kind == "float":
        mask.requires_grad_()
    weight = torch.randn(2, seqlen_q, 2, dim, generator=gen).to(device)
    out = numba_flash.torch.attention(q, k, v, attn_mask=mask, backend="numba")
    (out * weight).sum().backward()

    ref_mask = mask.detach() if kind == "bool" else mask.detach().double()
    ref, leaves = _torch_reference(q, k, v, False, None, attn_mask=ref_mask)
    _assert_like_reference(out, (q.grad, k.grad, v.grad), ref, leaves, weight)
    assert mask.grad is None


@pytest.mark.parametrize("mode", MODES)
def test_varlen_gradients_match_each_sequence_alone(rng, mode):
    """attention_varlen's output and gradients are those of torch's math attention on each
    packed sequence alone (bottom-right causal, GQA 2), a sequence without keys included."""
    device = "cuda" if mode == "gpu" else "cpu"
    lengths = [(7, 9), (0, 3), (12, 12), (4, 0)] if mode == "simulator" else [
        (300, 513), (0, 40), (700, 700), (90, 0)]
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    cu = [torch.tensor([0] + list(np.cumsum(side)), dtype=torch.int32, device=device)
          for side in zip(*lengths)]
    total_q, total_k = (int(c[-1]) for c in cu)
    q = torch.randn(total_q, 4, 32, generator=gen).to(device).requires_grad_()
    k, v = (torch.randn(total_k, 2, 32, generator=gen).to(device).requires_grad_()
            for _ in range(2))
    weight = torch.randn(total_q, 4, 32, generator=gen).to(device)
    out = numba_flash.torch.attention_varlen(q, k, v, *cu, max(n for n, _ in lengths),
                                             max(n for _, n in lengths), causal=True,
                                             backend="numba")
    (out * weight).sum().backward()
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    parts = []
    for b, (nq, nk) in enumerate(lengths):
        rows, keys = (slice(int(c[b]), int(c[b + 1])) for c in cu)
        if nk == 0:  # no key: output 0
            parts.append(torch.zeros(nq, 4, 32, dtype=torch.float64, device=device))
            continue
        qb, kb, vb = (x[s].transpose(0, 1) for x, s in zip(leaves, (rows, keys, keys)))
        kb, vb = (x.repeat_interleave(2, dim=0) for x in (kb, vb))
        mask = torch.ones(nq, nk, dtype=torch.bool, device=device).tril(diagonal=nk - nq)
        parts.append(torch.nn.functional.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=mask).transpose(0, 1))
    ref = torch.cat(parts)
    (ref * weight.double()).sum().backward()
    assert float((out.detach().double() - ref.detach()).abs().max()) < 1e-5
    for name, got, leaf in zip("qkv", (q.grad, k.grad, v.grad), leaves):
        err = float((got.double() - leaf.grad).abs().max())
        assert err < 1e-4 * max(1.0, float(leaf.grad.abs().max())), (name, err)


class _OnGpu:
    """A stand-in for a CUDA tensor: its device, and its reads to the host counted."""

    def __init__(self, device="cuda:0"):
        self.is_cuda, self.device, self.reads = True, device, 0

    def cpu(self):
        self.reads += 1
        return object()


def test_varlen_cu_seqlens_on_the_gpu_are_read_once_for_forward_and_backward():
    """The autograd function hands the forward (and so the backward) host copies of the
    cu_seqlens on q's GPU: one read for a tensor given twice; cu_seqlens elsewhere (the host,
    another GPU: the API's checks refuse those) and calls on the CPU are passed as given."""
    from numba_flash.torch import _offsets_read_once
    q, cu, other = _OnGpu(), _OnGpu(), _OnGpu("cuda:1")
    host_q, host_k, max_q, max_k = _offsets_read_once(q, (cu, cu, 7, 9))
    assert host_q is host_k and cu.reads == 1 and (max_q, max_k) == (7, 9)
    cu_k = _OnGpu()
    host_q, host_k, *_ = _offsets_read_once(q, (cu, cu_k, 7, 9))
    assert cu.reads == 2 and cu_k.reads == 1 and host_q is not host_k
    on_host = np.zeros(3, np.int32)
    assert _offsets_read_once(q, (on_host, other, 7, 9))[:2] == (on_host, other)
    assert other.reads == 0
    q.is_cuda = False
    assert _offsets_read_once(q, (cu, cu, 7, 9))[0] is cu and cu.reads == 2


@pytest.mark.gpu
def test_varlen_backward_reads_nothing_back(rng, monkeypatch):
    """attention_varlen with one cu_seqlens tensor on the GPU for q and k: the API's checks
    read nothing from the GPU (the forward hands them host values), and out and the gradients
    are those of the plain API calls, bit for bit."""
    from numba_flash import _checks
    lengths = [300, 1, 517, 64]
    cu = torch.tensor([0] + list(np.cumsum(lengths)), dtype=torch.int32, device="cuda")
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    q, k, v, dout = (torch.randn(int(cu[-1]), 4, 64, generator=gen).to("cuda", torch.float16)
                     for _ in range(4))
    out, lse = numba_flash.forward_varlen(q, k, v, cu, cu, 517, 517, causal=True,
                                          backend="numba")
    grads = numba_flash.backward_varlen(dout, q, k, v, out, lse, cu, cu, 517, 517,
                                        causal=True, backend="numba")
    monkeypatch.setattr(_checks, "host_values", None)  # nothing is read back
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    got = numba_flash.torch.attention_varlen(*leaves, cu, cu, 517, 517, causal=True,
                                             backend="numba")
    got.backward(dout)
    assert torch.equal(got, out)
    for leaf, grad in zip(leaves, grads):
        assert torch.equal(leaf.grad, grad)


@pytest.mark.parametrize("mode", MODES)
def test_inside_a_model(rng, mode):
    """A tiny attention layer trains: the loss goes down over a few SGD steps."""
    device = "cuda" if mode == "gpu" else "cpu"
    torch.manual_seed(int(rng.integers(2**31)))
    proj = torch.nn.Linear(16, 3 * 16).to(device)
    x = torch.randn(1, 12, 16, device=device)
    target = torch.randn(1, 12, 16, device=device)
    opt = torch.optim.SGD(proj.parameters(), lr=0.5)
    losses = []
    for _ in range(4):
        q, k, v = proj(x).view(1, 12, 3, 1, 16).unbind(2)  # strided views of one tensor
        out = numba_flash.torch.attention(q, k, v, causal=True, backend="numba")
        loss = ((out.view(1, 12, 16) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.parametrize("mode", MODES)
def test_sum_backward_fills_every_grad(rng, mode):
    """out.sum().backward() hands the backward an expanded (stride-0) dout."""
    device = "cuda" if mode == "gpu" else "cpu"
    q, k, v = (torch.randn(1, 9, 1, 8, device=device, requires_grad=True) for _ in range(3))
    numba_flash.torch.attention(q, k, v, causal=True, backend="numba").sum().backward()
    ref, leaves = _torch_reference(q, k, v, True, 8 ** -0.5)
    ref.sum().backward()
    for got, leaf in zip((q.grad, k.grad, v.grad), leaves):
        assert got is not None
        assert float((got.double() - leaf.grad.transpose(1, 2)).abs().max()) < 1e-5


@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_parameters(rng, mode):
    """bfloat16 nn.Parameters in, bfloat16 out and bfloat16 gradients, close to float64 math
    attention on the same (bfloat16-representable) values."""
    device = "cuda" if mode == "gpu" else "cpu"
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    q, k, v = (torch.nn.Parameter(torch.randn(1, n, 2, 16, generator=gen).bfloat16().to(device))
               for n in (13, 21, 21))
    out = numba_flash.torch.attention(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16 and out.device == q.device
    out.float().sum().backward()
    ref, leaves = _torch_reference(q, k, v, True, 16 ** -0.5)
    ref.sum().backward()
    # bfloat16 keeps 8 bits: errors of a few 2^-8 relative are what rounding alone gives.
    assert float((out.detach().double() - ref.detach()).abs().max()) < 2e-2
    for got, leaf in zip((q.grad, k.grad, v.grad), leaves):
        assert got.dtype == torch.bfloat16
        expected = leaf.grad.transpose(1, 2)
        assert float((got.double() - expected).abs().max()) < 3e-2 * max(1.0, float(
            expected.abs().max()))


@pytest.mark.parametrize("mode", MODES)
def test_mask_mod_gradients_match_torch_math_attention_with_its_mask(rng, mode):
    """A document mask_mod over a captured tensor of document ids (on the GPU a CUDA tensor,
    read by the kernels at its address; under the simulator a CPU one) through the autograd
    Function: torch's math attention with the boolean mask the function describes gives the
    same output and gradients."""
    device = "cuda" if mode == "gpu" else "cpu"
    (seqlen_q, seqlen_k), dim = ((9, 13), 8) if mode == "simulator" else ((300, 513), 32)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    q, k, v = (torch.randn(2, n, 2, dim, generator=gen).to(device).requires_grad_()
               for n in (seqlen_q, seqlen_k, seqlen_k))
    documents = torch.sort(torch.randint(0, 4, (seqlen_k,), generator=gen)).values
    document_ids = documents.to(torch.int32).to(device)
    offset = seqlen_k - seqlen_q  # (queries are the last seqlen_q positions)

    def same_document(b, h, q_idx, kv_idx):
        return document_ids[q_idx + offset] == document_ids[kv_idx]
    weight = torch.randn(2, seqlen_q, 2, dim, generator=gen).to(device)
    out = numba_flash.torch.attention(q, k, v, mask_mod=same_document, causal=True,
                                      backend="numba")
    (out * weight).sum().backward()

    positions = torch.arange(seqlen_k)
    mask = ((documents[offset:, None] == documents[None, :])
            & (positions[None, :] <= positions[offset:, None])).to(device)  # (each row sees
    #                                                                        itself at least)
    ref, leaves = _torch_reference(q, k, v, False, None, attn_mask=mask)
    _assert_like_reference(out, (q.grad, k.grad, v.grad), ref, leaves, weight)


def test_the_torch_library_ops_pass_opcheck(rng):
    """numba_flash::forward and ::backward: schema, fake (meta) shapes, autograd registration
    and dispatch as torch.library.opcheck tests them (the numpy backend: the registration is
    the same for every backend)."""
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    q, k, v = (torch.randn(1, n, 4, 8, generator=gen, dtype=torch.float64) for n in (5, 7, 7))
    k, v = k[:, :, :2], v[:, :, :2]  # (GQA)
    options = (True, 0.35, 3, 0, 2.0, None, None, "numpy")
    torch.library.opcheck(torch.ops.numba_flash.forward.default, (q, k, v, *options))
    out, lse = torch.ops.numba_flash.forward(q, k, v, *options)
    assert out.shape == q.shape and lse.shape == (1, 4, 5) and lse.dtype == torch.float32
    dout = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    torch.library.opcheck(torch.ops.numba_flash.backward.default,
                          (dout, q, k, v, out, lse, *options))


def test_the_varlen_torch_library_ops_pass_opcheck(rng):
    """numba_flash::forward_varlen and ::backward_varlen, as the dense ops above (three
    packed sequences, one without keys; GQA 2; a window and softcap)."""
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    cu_q, cu_k = torch.tensor([0, 3, 8, 9], dtype=torch.int32), torch.tensor(
        [0, 4, 4, 11], dtype=torch.int32)
    q = torch.randn(9, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(11, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    args = (cu_q, cu_k, 5, 7, False, 0.35, 3, 1, 2.0, None, "numpy")
    torch.library.opcheck(torch.ops.numba_flash.forward_varlen.default, (q, k, v, *args))
    out, lse = torch.ops.numba_flash.forward_varlen(q, k, v, *args)
    assert out.shape == q.shape and lse.shape == (4, 9) and lse.dtype == torch.float32
    dout = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    torch.library.opcheck(torch.ops.numba_flash.backward_varlen.default,
                          (dout, q, k, v, out, lse, *args))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "varlen"])
def test_torch_compile_traces_a_model_in_one_graph(rng, mode, packed):
    """A model calling numba_flash.torch.attention (or attention_varlen on packed sequences)
    compiles with fullgraph=True (no graph break: the call is the numba_flash::forward or
    ::forward_varlen op) and gives eager's output and gradients (under the simulator through
    the numpy backend: the op is the same for every backend, and the other tests here run the
    kernels through it)."""
    device = "cuda" if mode == "gpu" else "cpu"
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    (batch, seqlen, width), heads = ((1, 6, 16), 2) if mode == "simulator" else ((2, 500, 256), 4)
    backend, dtype = ("numpy", torch.float64) if mode == "simulator" else ("numba", torch.float32)
    proj = torch.nn.Linear(width, 3 * width, dtype=dtype).to(device)
    x = torch.randn(batch, seqlen, width, generator=gen, dtype=dtype).to(device)
    tokens = batch * seqlen  # (packed: the batch's rows as 3 sequences)
    lengths = [tokens // 3, 0, tokens - tokens // 3]
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32, device=device)

    def model(x):
        q, k, v = proj(x).unflatten(-1, (3, heads, width // heads)).unbind(2)
        if packed:
            q, k, v = (t.flatten(0, 1) for t in (q, k, v))
            return numba_flash.torch.attention_varlen(
                q, k, v, cu, cu, max(lengths), max(lengths), causal=True, softcap=5.0,
                backend=backend).sum(dim=(1, 2))
        return numba_flash.torch.attention(q, k, v, causal=True, softcap=5.0,
                                           backend=backend).sum(dim=(2, 3))

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got = compiled(x)
    got.pow(2).sum().backward()
    compiled_grads = [p.grad.clone() for p in proj.parameters()]
    proj.zero_grad()
    want = model(x)
    want.pow(2).sum().backward()
    assert float((got - want).detach().abs().max()) < 1e-5 * max(1.0, float(want.abs().max()))
    for got_grad, param in zip(compiled_grads, proj.parameters()):
        assert torch.equal(got_grad, param.grad)  # (the same kernels on the same inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("compile_options", [dict(backend="cudagraphs"),
                                             dict(mode="reduce-overhead")],
                         ids=["cudagraphs", "inductor-reduce-overhead"])
def test_cuda_graph_replays_give_eager_results(rng, compile_options):
    """Compiled with CUDA graphs, the op's launches are captured on torch's stream into
    torch's graph pool: each replay on fresh inputs gives eager's output and gradients."""
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    proj = torch.nn.Linear(256, 3 * 256, dtype=torch.float32).cuda()

    def model(x):
        q, k, v = proj(x).unflatten(-1, (3, 4, 64)).unbind(2)
        return numba_flash.torch.attention(q, k, v, causal=True, softcap=5.0,
                                           backend="numba").sum(dim=(2, 3))

    compiled = torch.compile(model, fullgraph=True, **compile_options)
    for _ in range(4):  # (warm-up, capture, replays)
        x = torch.randn(2, 300, 256, generator=gen).cuda()
        torch.compiler.cudagraph_mark_step_begin()
        got = compiled(x)
        got.pow(2).sum().backward()
        got = got.detach().clone()
        compiled_grads = [p.grad.clone() for p in proj.parameters()]
        proj.zero_grad()
        want = model(x)
        want.pow(2).sum().backward()
        assert float((got - want).detach().abs().max()) < 1e-5 * float(want.abs().max())
        for got_grad, param in zip(compiled_grads, proj.parameters()):
            err = float((got_grad - param.grad).abs().max())
            assert err < 1e-4 * float(param.grad.abs().max()), err
        proj.zero_grad()
