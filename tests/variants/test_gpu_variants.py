"""The variants at real sizes on a CUDA GPU (`python -m pytest -m gpu`): every Numba engine and
the cupy backend through the API, forward and backward, against float64 by the accuracy rule
(varlen, attention masks and mask_mods too); GQA's dK/dV bitwise deterministic."""
import numpy as np
import pytest
from error_rule import assert_within_rule

import numba_flash
from numba_flash.extras import Extras
from numba_flash.mask_mod import lower
from numba_flash.reference import attention_backward, attention_forward
from numba_flash.spec import make_spec
from numba_flash.testing import plain16_backward, plain16_forward, round16

pytestmark = pytest.mark.gpu

# (name, (batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim), options)
CASES = [
    ("gqa4-causal", (2, 1000, 1000, 8, 2, 128), dict(causal=True)),
    ("mqa-full-d64", (1, 777, 1500, 8, 1, 64), {}),
    ("window-256-causal", (1, 2048, 2048, 4, 2, 64), dict(causal=True, window_size=(256, 0))),
    ("window-both-sides", (1, 1500, 1300, 2, 2, 128), dict(window_size=(100, 40))),
    ("softcap-gqa2", (1, 1024, 1024, 4, 2, 128), dict(softcap=30.0, causal=True)),
    ("softcap-window-d256", (1, 600, 700, 2, 1, 256), dict(softcap=5.0, window_size=(64, 64))),
    ("rows-see-no-key", (1, 1200, 300, 2, 1, 64), dict(causal=True, window_size=(10, -1))),
    ("alibi-causal-gqa2", (2, 1000, 1300, 4, 2, 128), dict(causal=True, alibi=True)),
    ("alibi-per-head-softcap-window-d64", (2, 1100, 900, 4, 4, 64),
     dict(alibi="per-head", softcap=20.0, window_size=(300, 50))),
    ("bool-padding-mask-gqa2", (2, 1000, 1200, 4, 2, 128), dict(mask="padding")),
    ("float-mask-per-head-causal-d64", (2, 900, 900, 4, 4, 64), dict(mask="float", causal=True)),
    ("bool-mask-softcap-window", (1, 700, 800, 2, 1, 128),
     dict(mask="bool", softcap=20.0, window_size=(200, 100))),
    ("document-mask-mod-causal-gqa2", (2, 1000, 1000, 4, 2, 128),
     dict(mask_mod="document", causal=True)),
    ("document-mask-mod-softcap-causal", (1, 1100, 1100, 4, 4, 128),
     dict(mask_mod="document", causal=True, softcap=20.0)),  # (no GQA: Hopper's wider dK/dV)
    ("striped-mask-mod-softcap-d64", (1, 700, 900, 4, 4, 64),
     dict(mask_mod="striped", softcap=20.0)),
    ("document-block-mask-window", (1, 1200, 1200, 2, 1, 128),
     dict(mask_mod="document", block_mask=True, window_size=(300, 0))),
]
IDS = [case[0] for case in CASES]


def _values(cp, rng, shape, dtype):
    """float32 values q, k, v, dout representable in dtype."""
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim = shape
    values = []
    for n, h in ((seqlen_q, nheads), (seqlen_k, nheads_kv), (seqlen_k, nheads_kv),
                 (seqlen_q, nheads)):
        x = cp.asarray(rng.standard_normal((batch, n, h, head_dim)), cp.float32)
        values.append(x if dtype == "float32" else round16(cp, x, dtype))
    return values


def _as(values, dtype, torch_too=False):
    """CuPy arrays of dtype, torch tensors for bfloat16 (or, with torch_too, for any)."""
    import cupy as cp
    if dtype == "bfloat16" or torch_too:
        torch = pytest.importorskip("torch")
        return [torch.from_dlpack(x).to(getattr(torch, dtype)) for x in values]
    return [x.astype(getattr(cp, dtype)) for x in values]


def _host(x):
    if type(x).__module__.startswith("torch"):
        return x.detach().float().cpu().numpy()
    return x.get()


def _plain(cp, dtype):
    """The plain same-precision implementation that sets the bound: standard attention in
    CuPy in the dtype (float16, float32: the cupy backend's own computation, so it is checked
    against itself within 2x), emulated in float32 for bfloat16, which CuPy lacks."""
    if dtype == "bfloat16":
        return (lambda *a: plain16_forward(cp, *a[:-1], dtype, a[-1]),
                lambda *a: plain16_backward(cp, *a[:-1], dtype, a[-1]))
    return (lambda *a: attention_forward(cp, *a[:-1], dtype, a[-1]),
            lambda *a: attention_backward(cp, *a[:-1], dtype, a[-1]))


def _extras(cp, rng, options, shape, dtype):
    """(options for the API, Extras for the references): ALiBi slopes (batch, nheads) for
    options with alibi=True, (nheads,) for alibi="per-head"; an attn_mask for mask="padding"
    (boolean (batch, 1, 1, seqlen_k): each batch entry's last keys padding), "bool" (boolean
    (batch, nheads, seqlen_q, seqlen_k)) or "float" (q's dtype, (nheads, seqlen_q, seqlen_k),
    some -inf); torch tensors for bfloat16 (whose arrays are torch's)."""
    options = dict(options)
    alibi, mask_kind = options.pop("alibi", False), options.pop("mask", None)
    batch, seqlen_q, seqlen_k, nheads = shape[:4]
    if "mask_mod" in options:
        mask_mod = _mask_mod(cp, rng, options.pop("mask_mod"), max(seqlen_q, seqlen_k))
        if options.pop("block_mask", False):
            options["block_mask"] = numba_flash.block_mask(mask_mod, None, None, seqlen_q,
                                                           seqlen_k)
        else:
            options["mask_mod"] = mask_mod
    slopes = mask = None
    if alibi:
        slopes = cp.asarray(rng.uniform(0.02, 0.5, nheads if alibi == "per-head"
                                        else (batch, nheads)), cp.float32)
        options["alibi_slopes"] = _as([slopes], "float32", torch_too=dtype == "bfloat16")[0]
    if mask_kind == "padding":
        lengths = cp.asarray(rng.integers(seqlen_k // 2, seqlen_k + 1, batch))
        mask = cp.arange(seqlen_k)[None, None, None, :] < lengths[:, None, None, None]
    elif mask_kind == "bool":
        mask = cp.asarray(rng.random((batch, nheads, seqlen_q, seqlen_k)) < 0.8)
    elif mask_kind == "float":
        values = rng.standard_normal((nheads, seqlen_q, seqlen_k)) * 2
        values[rng.random(values.shape) < 0.1] = -np.inf
        values = cp.asarray(values, cp.float32)
        mask = values if dtype == "float32" else round16(cp, values, dtype)
    if mask is not None:
        mask_dtype = "bool" if mask.dtype == cp.bool_ else dtype
        options["attn_mask"] = _as([mask], mask_dtype, torch_too=dtype == "bfloat16")[0]
    mask_mod = options["block_mask"].mask_mod if "block_mask" in options else options.get(
        "mask_mod")
    return options, Extras(slopes, attn_mask=mask, mask_mod_arrays=lower(mask_mod)[1])


def _mask_mod(cp, rng, kind, length):
    """A mask_mod over a captured device array: "document" (random documents of 50 to 400
    tokens) or "striped" (key stripes of 48 that depend on the batch entry and head); or
    "window" (the 300 keys before a query and 20 after it: no array, and neither b nor h)."""
    if kind == "window":
        def window(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx + 20) & (q_idx - kv_idx <= 300)
        return window
    if kind == "document":
        lengths = rng.integers(50, 400, length // 50 + 1)
        document_ids = cp.asarray(np.repeat(np.arange(len(lengths)), lengths)[:length],
                                  cp.int32)

        def document(b, h, q_idx, kv_idx):
            return document_ids[q_idx] == document_ids[kv_idx]
        return document
    shift = cp.asarray(rng.integers(0, 3, 64), cp.int32)

    def striped(b, h, q_idx, kv_idx):
        return ((kv_idx // 48 + shift[b * 8 + h]) % 3 != 0) | (q_idx % 97 == kv_idx % 97)
    return striped


def _spec(q, k, options, extras, **varlen):
    """The call's spec, for the references."""
    mask = extras.attn_mask
    block_mask = options.get("block_mask")
    return make_spec(q, k, alibi=extras.alibi_slopes is not None,
                     attn_mask=None if mask is None else str(options["attn_mask"].dtype)
                     .replace("torch.", ""), **varlen,
                     mask_mod=block_mask.mask_mod if block_mask else options.get("mask_mod"),
                     **{key: x for key, x in options.items()
                        if key not in ("alibi_slopes", "attn_mask", "mask_mod", "block_mask")})


# (on an sm_90 GPU "numba" runs 16-bit calls on the Hopper kernels: "numba-mma" keeps the
# mma.sync kernels in the suite there; "numba-hopper" is skipped elsewhere)
@pytest.mark.parametrize("backend, dtype", [("numba", "float16"), ("numba", "bfloat16"),
                                            ("numba", "float32"), ("numba-mma", "float16"),
                                            ("numba-hopper", "float16"),
                                            ("numba-hopper", "bfloat16"),
                                            ("numba-simt", "float16"), ("cupy", "float16")])
@pytest.mark.parametrize("name, shape, options", CASES, ids=IDS)
def test_variants_on_gpu(cp, rng, name, shape, options, backend, dtype):
    if backend == "numba-hopper" and cp.cuda.Device().compute_capability != "90":
        pytest.skip("the Hopper kernels need compute capability 9.0")
    values = _values(cp, rng, shape, dtype)
    q, k, v, dout = values
    arrays = _as(values, dtype)
    options, extras = _extras(cp, rng, options, shape, dtype)
    spec = _spec(q, k, options, extras)
    grads = _check_forward_and_backward(
        cp, dtype, values, arrays, spec, extras,
        lambda *a: numba_flash.forward(*a, backend=backend, **options),
        lambda *a: numba_flash.backward(*a, backend=backend, **options))
    assert [tuple(g.shape) for g in grads] == [q.shape, k.shape, v.shape]


def _check_forward_and_backward(cp, dtype, values, arrays, spec, extras, forward, backward):
    """forward(q, k, v) -> (out, lse) and backward(dout, q, k, v, out, lse) -> grads of the
    backend's arrays, each result by the accuracy rule against float64 (values: q, k, v, dout
    as the references take them; the backward gets the reference's out and lse, rounded as a
    forward returns them). Returns the gradients."""
    q, k, v, dout = values
    plain_forward, plain_backward = _plain(cp, dtype)
    out, lse = forward(*arrays[:3])
    ref_out, ref_lse = attention_forward(cp, q, k, v, spec, "float64", extras)
    base_out, base_lse = plain_forward(q, k, v, spec, extras)
    assert_within_rule("out", _host(out), base_out.get(), ref_out.get(), dtype)
    assert_within_rule("lse", _host(lse), base_lse.get(), ref_lse.get(), "float32")

    out_in = ref_out.astype(cp.float32) if dtype == "float32" else round16(cp, ref_out, dtype)
    lse_in = cp.ascontiguousarray(ref_lse.astype(cp.float32))
    out_arg, = _as([out_in], dtype)
    lse_arg = lse_in
    if dtype == "bfloat16":
        import torch
        lse_arg = torch.from_dlpack(lse_in)
    grads = backward(arrays[3], *arrays[:3], out_arg, lse_arg)
    refs = attention_backward(cp, dout, q, k, v, out_in, lse_in, spec, "float64", extras)
    bases = plain_backward(dout, q, k, v, out_in, lse_in, spec, extras)
    for grad_name, got, base, ref in zip(("dq", "dk", "dv"), grads, bases, refs):
        assert_within_rule(grad_name, _host(got), base.get(), ref.get(), dtype)
    return grads


VARLEN_LENGTHS = [(700, 700), (1, 40), (1500, 1200), (0, 30), (333, 0), (900, 1100)]


@pytest.mark.parametrize("backend, dtype", [("numba", "float16"), ("numba", "bfloat16"),
                                            ("numba-simt", "float32"), ("cupy", "float16")])
@pytest.mark.parametrize("options", [dict(causal=True), dict(alibi=True, window_size=(200, 64)),
                                     dict(mask_mod="striped", causal=True),
                                     dict(mask_mod="window")],
                         ids=["causal", "alibi-window", "striped-mask-mod-causal",
                              "window-mask-mod"])
def test_varlen_on_gpu(cp, rng, backend, dtype, options):
    """Six packed sequences (one without keys, one without queries), GQA 8/2, d128."""
    cu_q, cu_k = (cp.asarray(np.concatenate([[0], np.cumsum(side)]), cp.int32)
                  for side in zip(*VARLEN_LENGTHS))
    max_q, max_k = (max(side) for side in zip(*VARLEN_LENGTHS))
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    values = []
    for n, h in ((total_q, 8), (total_k, 2), (total_k, 2), (total_q, 8)):
        x = cp.asarray(rng.standard_normal((n, h, 128)), cp.float32)
        values.append(x if dtype == "float32" else round16(cp, x, dtype))
    q, k, v, dout = values
    arrays = _as(values, dtype)
    options, extras = _extras(cp, rng, options, (len(VARLEN_LENGTHS), max_q, max_k, 8), dtype)
    extras = extras._replace(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    varlen = (cu_q, cu_k, max_q, max_k)
    spec = _spec(q, k, options, extras, max_seqlens=(max_q, max_k))
    shapes = []

    def forward(*qkv):
        out, lse = numba_flash.forward_varlen(*qkv, *varlen, backend=backend, **options)
        shapes.append(tuple(lse.shape))
        return out, lse

    _check_forward_and_backward(
        cp, dtype, values, arrays, spec, extras, forward,
        lambda *a: numba_flash.backward_varlen(*a, *varlen, backend=backend, **options))
    assert shapes == [(8, total_q)]


@pytest.mark.parametrize("backend", ["numba", "numba-simt"])
def test_gqa_gradients_are_bitwise_repeatable(cp, rng, backend):
    """dK, dV sum a group's query heads in a fixed order (no atomics)."""
    q, k, v, dout = _as(_values(cp, rng, (2, 1000, 1000, 8, 2, 64), "float16"), "float16")
    out, lse = numba_flash.forward(q, k, v, causal=True, backend=backend)
    first = numba_flash.backward(dout, q, k, v, out, lse, causal=True, backend=backend)
    for _ in range(3):
        again = numba_flash.backward(dout, q, k, v, out, lse, causal=True, backend=backend)
        for a, b in zip(first, again):
            assert bool((a.view(cp.uint16) == b.view(cp.uint16)).all())


@pytest.mark.parametrize("backend", ["numba", "numba-simt"])
def test_new_closures_over_new_arrays_compile_nothing(cp, rng, backend):
    """A training loop's document mask: each step a new closure over new document ids (a
    CuPy array), two steps with the mask_mod alone, then two with a new block mask each (whose
    broadcast tile tables are other argument types: kernels of their own). Each step is
    attention under its own documents by the accuracy rule, and the second step of each kind
    compiles no kernel (the ids are kernel arguments: numba_flash/mask_mod.py)."""
    from numba_flash.backends.numba import launch
    dtype = "float16" if backend == "numba" else "float32"
    shape = (2, 900, 900, 4, 2, 64)
    compiled = {}
    for step, kind in enumerate(["mask_mod", "mask_mod", "block_mask", "block_mask"]):
        lengths = rng.integers(30, 300, 40)
        ids = cp.asarray(np.repeat(np.arange(40), lengths)[:900], cp.int32)

        def same_document(b, h, q_idx, kv_idx):
            return ids[q_idx] == ids[kv_idx]
        values = _values(cp, rng, shape, dtype)
        arrays = _as(values, dtype)
        options = dict(causal=True, mask_mod=same_document, block_mask=numba_flash.block_mask(
            same_document, None, None, 900, 900) if kind == "block_mask" else None)
        extras = Extras(mask_mod_arrays=(ids,))
        spec = make_spec(values[0], values[1], causal=True, mask_mod=same_document)
        _check_forward_and_backward(
            cp, dtype, values, arrays, spec, extras,
            lambda *a: numba_flash.forward(*a, backend=backend, **options),
            lambda *a: numba_flash.backward(*a, backend=backend, **options))
        kernels = compiled.setdefault(kind, len(launch._compiled))
        assert len(launch._compiled) == kernels, f"step {step} ({kind}) compiled a kernel"


@pytest.mark.parametrize("library", ["cupy", "torch"])
def test_host_cu_seqlens_are_not_read_back(cp, rng, monkeypatch, library):
    """cu_seqlens given on the host (NumPy, a CPU tensor) beside q on the GPU: checked there
    and copied to the GPU, nothing read back from it, in the full path and the replay; the
    same results, bit for bit, as the call with the cu_seqlens on the GPU; bad host values
    refused by name."""
    from numba_flash import _checks, call_cache
    torch = pytest.importorskip("torch") if library == "torch" else None
    lengths = np.array([700, 1, 1500, 333], np.int32)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = [round16(cp, cp.asarray(rng.standard_normal((int(cu[-1]), h, 64)), cp.float32),
                      "float16") for h in (8, 2, 2, 8)]
    arrays = _as(values, "float16")
    if torch is not None:
        arrays = [torch.from_dlpack(x) for x in arrays]
    q, k, v, dout = arrays
    host = torch.from_numpy if torch is not None else np.asarray

    def call(cu_q, cu_k):
        varlen = (cu_q, cu_k, 1500, 1500)
        out, lse = numba_flash.forward_varlen(q, k, v, *varlen, causal=True, backend="numba")
        grads = numba_flash.backward_varlen(dout, q, k, v, out, lse, *varlen, causal=True,
                                            backend="numba")
        return [cp.asarray(x) for x in (out, lse, *grads)]

    on_gpu = call(cp.asarray(cu), cp.asarray(cu))
    monkeypatch.setattr(_checks, "host_values", None)  # nothing is read back
    call_cache.clear()
    for cu_q, cu_k in [(host(cu), host(cu))] * 2 + [(host(cu), host(cu.copy()))]:
        got = call(cu_q, cu_k)  # the full path, the replay, two host arrays
        for a, b in zip(got, on_gpu):
            assert bool(cp.all(a.view(cp.uint16 if a.dtype == cp.float16 else cp.uint32)
                               == b.view(cp.uint16 if b.dtype == cp.float16 else cp.uint32)))
    bad = cu.copy()
    bad[2] = 0
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        numba_flash.forward_varlen(q, k, v, host(cu), host(bad), 1500, 1500, backend="numba")
