"""The Numba backends: which kernels each picks, and the tensor-core and Hopper paths through
the public API (16-bit views, padded head dims, copies of views the kernels cannot read in
place)."""
import numpy as np
import pytest
from error_rule import assert_within_rule
from inputs import random_qkv

import numba_flash
from numba_flash.backends.numba.hopper import engine as hopper_engine
from numba_flash.backends.numba.marshal import is_tile_ready
from numba_flash.backends.numba.mma import engine as mma_engine
from numba_flash.backends.numba.mma.config import mma_head_dim
from numba_flash.backends.numba.simt import engine as simt_engine
from numba_flash.reference import attention_backward, attention_forward
from numba_flash.spec import make_spec
from numba_flash.testing import plain16_backward, plain16_forward, round16

HOPPER, MMA, SIMT = "Hopper (wgmma)", "tensor cores", "SIMT"


def engine_of(backend, q):
    """(the name of the engine backend `backend` runs q's call on, or None; the reasons)."""
    chosen, reason = numba_flash.get_backend(backend).engine(make_spec(q), q, q, q)
    return (None if chosen is None else chosen.name), reason


def test_numba_uses_simt_in_the_simulator_and_numba_mma_tensor_cores(rng):
    q, k, v = random_qkv(rng, 1, 4, 4, 1, 16, "float16")
    assert engine_of("numba", q) == (SIMT, None)
    assert engine_of("numba-hopper", q) == (HOPPER, None)
    assert engine_of("numba-mma", q) == (MMA, None)
    assert engine_of("numba-simt", q) == (SIMT, None)
    torch = pytest.importorskip("torch")
    assert engine_of("numba", torch.from_numpy(q).bfloat16()) == (SIMT, None)


@pytest.fixture
def on_a_gpu(monkeypatch):
    """Pretend the arrays are on a GPU of a given compute capability."""
    def set_capability(cc):
        for module in (hopper_engine, mma_engine, simt_engine):
            monkeypatch.setattr(module, "simulator_enabled", lambda: False)
            monkeypatch.setattr(module, "compute_capability", lambda device: cc)
        monkeypatch.setattr(mma_engine._arrays, "device_id", lambda x: 0)
    return set_capability


def test_numba_picks_wgmma_on_sm90_and_mma_sync_on_other_gpus_from_sm80(rng, on_a_gpu):
    q16, _, _ = random_qkv(rng, 1, 4, 4, 1, 24, "float16")
    q32, _, _ = random_qkv(rng, 1, 4, 4, 1, 24, "float32")
    d200, _, _ = random_qkv(rng, 1, 4, 4, 1, 200, "float16")
    wide, _, _ = random_qkv(rng, 1, 4, 4, 1, 272, "float16")  # (beyond what the API takes)
    for cc, sixteen_bit in (((9, 0), HOPPER), ((8, 0), MMA), ((8, 9), MMA), ((10, 0), MMA)):
        on_a_gpu(cc)
        assert engine_of("numba", q16) == (sixteen_bit, None)
        assert engine_of("numba", q32) == (SIMT, None)  # float32: tensor cores are for 16 bits
        assert engine_of("numba", d200) == (sixteen_bit, None)
        assert engine_of("numba", wide) == (SIMT, None)  # no tensor-core config
        chosen, reason = engine_of("numba-mma", wide)
        assert chosen is None and "headdim <= 256, not 272" in reason
    chosen, reason = engine_of("numba-hopper", q16)
    assert chosen is None and "need compute capability 9.0; this GPU has 10.0" in reason


def test_the_hopper_engine_takes_masks(rng, on_a_gpu):
    on_a_gpu((9, 0))
    q, _, _ = random_qkv(rng, 1, 4, 4, 1, 64, "float16")
    for spec in (make_spec(q, attn_mask="bool"), make_spec(q, mask_mod=lambda b, h, i, j: i >= j)):
        for backend in ("numba", "numba-hopper"):
            chosen, reason = numba_flash.get_backend(backend).engine(spec, q, q, q)
            assert chosen.name == HOPPER and reason is None
    wide, _, _ = random_qkv(rng, 1, 4, 4, 1, 200, "float16")  # (run at d256)
    spec = make_spec(wide, attn_mask="bool")
    assert numba_flash.get_backend("numba").engine(spec, wide, wide, wide)[0].name == MMA
    chosen, reason = numba_flash.get_backend("numba-hopper").engine(spec, wide, wide, wide)
    assert chosen is None
    assert "take an attn_mask or a mask_mod up to headdim 128, not 200" in reason


def test_below_sm80_float16_uses_simt_and_bfloat16_is_refused(rng, on_a_gpu):
    torch = pytest.importorskip("torch")
    on_a_gpu((7, 5))
    q, _, _ = random_qkv(rng, 1, 4, 4, 1, 64, "float16")
    assert engine_of("numba", q) == (SIMT, None)
    chosen, reason = engine_of("numba-mma", q)
    assert chosen is None
    assert "need compute capability 8.0 or newer; this GPU has 7.5" in reason
    chosen, reason = engine_of("numba", torch.from_numpy(q).bfloat16())
    assert chosen is None
    assert "bfloat16 needs compute capability 8.0 or newer; this GPU has 7.5" in reason


def test_bfloat16_up_to_head_dim_256_uses_tensor_cores_on_sm80(rng, on_a_gpu):
    torch = pytest.importorskip("torch")
    on_a_gpu((8, 0))
    q, _, _ = random_qkv(rng, 1, 4, 4, 1, 256, "float32")
    assert engine_of("numba", torch.from_numpy(q).bfloat16()) == (MMA, None)


def test_numba_mma_refuses_float32_and_numba_simt_float64(rng):
    q32, _, _ = random_qkv(rng, 1, 4, 4, 1, 16, "float32")
    reason = engine_of("numba-mma", q32)[1]
    assert "take float16 or bfloat16, not float32" in reason
    q64, _, _ = random_qkv(rng, 1, 4, 4, 1, 16, "float64")
    assert "not supported" in numba_flash.get_backend("numba-simt").supports(make_spec(q64), q64,
                                                                             q64, q64)


def test_mma_head_dims():
    assert [mma_head_dim(d) for d in (1, 16, 24, 40, 80, 128)] == [16, 16, 32, 48, 80, 128]
    # above 128 the backward splits the head dim in two halves of a multiple of 16 columns
    assert [mma_head_dim(d) for d in (129, 144, 160, 200, 256)] == [160, 160, 160, 224, 256]
    assert mma_head_dim(257) is None


def test_is_tile_ready_wants_unit_stride_and_16_byte_aligned_rows(rng):
    packed = rng.standard_normal((1, 8, 2, 3, 33)).astype(np.float16).view(np.uint16)
    assert is_tile_ready(np.ascontiguousarray(packed[..., 0, :32]), 32)
    assert not is_tile_ready(packed[..., 0, :32], 32)  # rows 3*33*2 = 198 bytes apart
    aligned = np.zeros((1, 8, 2, 3, 40), np.uint16)
    assert is_tile_ready(aligned[..., 1, :32], 32)  # a packed-qkv slice: read in place
    assert not is_tile_ready(aligned[..., 1, 1:33], 32)  # starts 2 bytes past a boundary
    assert not is_tile_ready(aligned[..., 1, :24], 32)  # narrower than the kernel's head dim
    assert not is_tile_ready(aligned[..., 1, ::2][..., :16], 16)  # no unit stride


def _encode(values, dtype):
    """float32 values (already representable) as the caller's arrays of dtype."""
    if dtype == "float16":
        return values.astype(np.float16)
    import torch
    return torch.from_numpy(values).to(torch.bfloat16)


def _host(x):
    return x.float().numpy() if type(x).__module__.startswith("torch") else np.asarray(x)


# (each dtype at one shape: the kernels themselves are tests/kernels' and tests/variants')
CASES = [("numba-mma", "float16", (1, 9, 20, 2, 16)),
         ("numba-mma", "bfloat16", (1, 21, 7, 1, 24)),
         ("numba-simt", "bfloat16", (1, 9, 20, 2, 16)),
         ("numba", "bfloat16", (1, 7, 11, 1, 200)),
         ("numba-hopper", "float16", (1, 70, 37, 1, 40))]  # (d40 runs padded to 64)


@pytest.mark.parametrize("backend, dtype, shape", CASES,
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else x)
def test_16_bit_inputs_through_the_api(rng, poisoned_outputs, backend, shape, dtype):
    """float16 (NumPy) and bfloat16 (CPU torch) through the public API: the tensor-core kernels
    (head dim 24 padded to 32), the SIMT kernels (bfloat16 as bit patterns; head dim 200) and
    the Hopper ones (head dim 40 padded to 64, forward and backward on wgmma)."""
    if dtype == "bfloat16":
        pytest.importorskip("torch")
    batch, seqlen_q, seqlen_k, nheads, head_dim = shape
    q, k, v, dout = (round16(np, x, dtype) for x in
                     random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, head_dim, "float32")
                     + (rng.standard_normal((batch, seqlen_q, nheads, head_dim)),))
    args = [_encode(x, dtype) for x in (q, k, v)]
    out, lse = numba_flash.forward(*args, causal=True, backend=backend)
    assert type(out) is type(args[0]) and out.dtype == args[0].dtype
    spec = make_spec(q, causal=True)
    ref_out, ref_lse = attention_forward(np, q, k, v, spec, np.float64)
    base_out, base_lse = plain16_forward(np, q, k, v, spec, dtype)
    assert_within_rule("out", _host(out), base_out, ref_out, dtype)
    assert_within_rule("lse", _host(lse), base_lse, ref_lse, dtype)
    out_values = _host(out)
    grads = numba_flash.backward(_encode(dout, dtype), *args, out, lse, causal=True,
                                 backend=backend)
    refs = attention_backward(np, dout, q, k, v, out_values, _host(lse), spec, np.float64)
    bases = plain16_backward(np, dout, q, k, v, out_values, _host(lse), spec, dtype)
    for name, got, base, ref in zip(("dq", "dk", "dv"), grads, bases, refs):
        assert type(got) is type(args[0]) and got.shape == ref.shape
        assert_within_rule(name, _host(got), base, ref, dtype)


def test_the_hopper_engine_hands_backwards_it_has_no_kernels_for_to_its_backward_engine(
        rng, monkeypatch):
    """Head dims above 128 (no wgmma backward config; here every head dim, patched) run the
    backward on the mma.sync kernels."""
    engine = numba_flash.get_backend("numba-hopper").engines[0]
    called = []
    original = engine.backward_engine.backward
    monkeypatch.setattr(engine.backward_engine, "backward",
                        lambda *args: called.append(1) or original(*args))
    q, k, v = random_qkv(rng, 1, 18, 21, 1, 16, "float16")
    out, lse = numba_flash.forward(q, k, v, backend="numba-hopper")
    numba_flash.backward(q, q, k, v, out, lse, backend="numba-hopper")
    assert called == []  # (the wgmma backward)
    monkeypatch.setattr(hopper_engine, "hopper_backward_config", lambda head_dim, spec: None)
    grads = numba_flash.backward(q, q, k, v, out, lse, backend="numba-hopper")
    assert called == [1]
    spec = make_spec(q)
    refs = attention_backward(np, q.astype(np.float32), q.astype(np.float32),
                              k.astype(np.float32), v.astype(np.float32), _host(out),
                              _host(lse), spec, np.float64)
    bases = plain16_backward(np, q.astype(np.float32), q.astype(np.float32),
                             k.astype(np.float32), v.astype(np.float32), _host(out),
                             _host(lse), spec, "float16")
    for name, got, base, ref in zip(("dq", "dk", "dv"), grads, bases, refs):
        assert_within_rule(name, _host(got), base, ref, "float16")
