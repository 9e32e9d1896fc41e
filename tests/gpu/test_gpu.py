"""GPU tests at real sizes (run on a CUDA machine with `python -m pytest -m gpu`)."""
import numpy as np
import pytest
from error_rule import assert_within_rule

import numba_flash
from numba_flash.reference import attention_backward, attention_forward
from numba_flash.spec import make_spec

pytestmark = pytest.mark.gpu

SHAPES = [  # (batch, seqlen_q, seqlen_k, nheads, headdim)
    (2, 1024, 1024, 4, 64),
    (1, 777, 2049, 2, 128),
    (1, 2049, 777, 2, 32),
    (1, 513, 513, 2, 256),
]


def _inputs(cp, rng, shape, dtype):
    batch, seqlen_q, seqlen_k, nheads, headdim = shape
    draw = lambda n: cp.asarray(  # noqa: E731
        rng.standard_normal((batch, n, nheads, headdim)).astype(dtype))
    return draw(seqlen_q), draw(seqlen_k), draw(seqlen_k), draw(seqlen_q)


def _poison(cp, nbytes):
    block = cp.full(nbytes // 4 + 1, cp.nan, cp.float32)
    cp.cuda.get_current_stream().synchronize()
    del block


@pytest.mark.parametrize("backend", ["numba", "numba-simt"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_numba_forward_backward_on_gpu(cp, rng, shape, causal, dtype, backend):
    if backend == "numba-simt" and dtype == "float32":
        pytest.skip("numba runs the SIMT kernels for float32: the same case as backend numba")
    q, k, v, dout = _inputs(cp, rng, shape, dtype)
    scale = shape[-1] ** -0.5
    _poison(cp, 16 * q.nbytes)
    out, lse = numba_flash.forward(q, k, v, causal=causal, backend=backend)
    assert isinstance(out, cp.ndarray) and out.dtype == q.dtype and lse.dtype == cp.float32
    spec = make_spec(q, causal=causal, softmax_scale=scale)
    ref_out, ref_lse = attention_forward(cp, q, k, v, spec, "float64")
    base_out, base_lse = attention_forward(cp, q, k, v, spec, dtype)
    assert_within_rule("out", out.get(), base_out.get(), ref_out.get(), dtype)
    assert_within_rule("lse", lse.get(), base_lse.get(), ref_lse.get(), dtype)

    out_in = cp.ascontiguousarray(ref_out.astype(dtype))
    lse_in = cp.ascontiguousarray(ref_lse.astype(cp.float32))
    _poison(cp, 16 * q.nbytes)
    grads = numba_flash.backward(dout, q, k, v, out_in, lse_in, causal=causal, backend=backend)
    refs = attention_backward(cp, dout, q, k, v, out_in, lse_in, spec, "float64")
    bases = attention_backward(cp, dout, q, k, v, out_in, lse_in, spec, dtype)
    for name, got, base, ref in zip(("dq", "dk", "dv"), grads, bases, refs):
        assert_within_rule(name, got.get(), base.get(), ref.get(), dtype)


MMA_SHAPES = [  # head dims 24, 40 and 200 run padded to 32, 48 and 224
    (2, 1024, 1024, 4, 64),
    (1, 777, 2049, 2, 128),
    (1, 2049, 777, 3, 24),
    (1, 300, 300, 2, 40),
    (1, 333, 301, 2, 200),
    (1, 513, 1025, 2, 256),
    (1, 16384, 16384, 2, 128),  # issue 3: within the rule at N up to 16k, backward included
]


def _host(x):
    if type(x).__module__.startswith("torch"):
        return x.detach().float().cpu().numpy()
    return x.get()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", MMA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_tensor_core_backend_on_gpu(cp, rng, shape, causal, dtype):
    """numba-mma through the API: CuPy float16 in, CuPy out; torch bfloat16 in, torch out."""
    from numba_flash.testing import plain16_backward, plain16_forward, round16
    values = [round16(cp, x, dtype) for x in _inputs(cp, rng, shape, "float32")]
    if dtype == "float16":
        arrays = [x.astype(cp.float16) for x in values]
    else:
        torch = pytest.importorskip("torch")
        arrays = [torch.from_dlpack(x).to(torch.bfloat16) for x in values]
    q, k, v, dout = values
    scale = shape[-1] ** -0.5
    _poison(cp, 16 * q.nbytes)
    out, lse = numba_flash.forward(*arrays[:3], causal=causal, backend="numba-mma")
    assert type(out) is type(arrays[0]) and out.dtype == arrays[0].dtype
    spec = make_spec(q, causal=causal, softmax_scale=scale)
    ref_out, ref_lse = attention_forward(cp, q, k, v, spec, "float64")
    base_out, base_lse = plain16_forward(cp, q, k, v, spec, dtype)
    assert_within_rule("out", _host(out), base_out.get(), ref_out.get(), dtype)
    assert_within_rule("lse", _host(lse), base_lse.get(), ref_lse.get(), dtype)

    out_in = round16(cp, ref_out, dtype)
    lse_in = cp.ascontiguousarray(ref_lse.astype(cp.float32))
    if dtype == "float16":
        out_arg, lse_arg = out_in.astype(cp.float16), lse_in
    else:
        out_arg, lse_arg = torch.from_dlpack(out_in).to(torch.bfloat16), torch.from_dlpack(lse_in)
    _poison(cp, 16 * q.nbytes)
    grads = numba_flash.backward(arrays[3], *arrays[:3], out_arg, lse_arg, causal=causal,
                                 backend="numba-mma")
    refs = attention_backward(cp, dout, q, k, v, out_in, lse_in, spec, "float64")
    bases = plain16_backward(cp, dout, q, k, v, out_in, lse_in, spec, dtype)
    for name, got, base, ref in zip(("dq", "dk", "dv"), grads, bases, refs):
        assert_within_rule(name, _host(got), base.get(), ref.get(), dtype)


def test_tensor_core_backend_reads_strided_and_misaligned_views(cp, rng):
    """A slice of a packed qkv array (rows aligned: read in place) and views whose rows are not
    16-byte aligned (copied first) give the reference's result."""
    batch, seqlen, nheads, headdim = 2, 500, 3, 64
    packed = cp.asarray(rng.standard_normal((batch, seqlen, nheads, 3, headdim + 1)),
                        cp.float16)
    for start in (0, 1):  # start 1: every row begins 2 bytes past a 16-byte boundary
        q, k, v = (packed[:, :, :, i, start:start + headdim] for i in range(3))
        for causal in (False, True):
            out, lse = numba_flash.forward(q, k, v, causal=causal, backend="numba-mma")
            spec = make_spec(q, causal=causal, softmax_scale=headdim ** -0.5)
            ref_out, _ = attention_forward(cp, q, k, v, spec, "float64")
            base_out, _ = attention_forward(cp, q, k, v, spec, "float16")
            assert_within_rule("out", out.get(), base_out.get(), ref_out.get(), "float16")
            dout = cp.ascontiguousarray(q[:, :, :, ::-1])
            grads = numba_flash.backward(dout, q, k, v, out, lse, causal=causal,
                                         backend="numba-mma")
            refs = attention_backward(cp, dout, q, k, v, out, lse, spec,
                                      "float64")
            bases = attention_backward(cp, dout, q, k, v, out, lse, spec,
                                       "float16")
            for name, got, base, ref in zip(("dq", "dk", "dv"), grads, bases, refs):
                assert_within_rule(name, got.get(), base.get(), ref.get(), "float16")


def test_simt_backend_reads_strided_and_misaligned_float32_views(cp, rng):
    """float32 through numba, forward and backward: slices of a packed qkv+dout array with
    16-byte aligned rows are read in place by cp.async; views whose rows are not aligned are
    copied first. Both give the reference's result."""
    batch, seqlen, nheads, headdim = 2, 500, 3, 64
    scale = headdim ** -0.5
    packed = cp.asarray(rng.standard_normal((batch, seqlen, nheads, 4, headdim + 4)),
                        cp.float32)
    for start in (0, 1):  # start 1: every row begins 4 bytes past a 16-byte boundary
        q, k, v, dout = (packed[:, :, :, i, start:start + headdim] for i in range(4))
        for causal in (False, True):
            _poison(cp, 16 * q.nbytes)
            out, lse = numba_flash.forward(q, k, v, causal=causal, backend="numba")
            spec = make_spec(q, causal=causal, softmax_scale=scale)
            ref_out, ref_lse = attention_forward(cp, q, k, v, spec, "float64")
            base_out, base_lse = attention_forward(cp, q, k, v, spec, "float32")
            assert_within_rule("out", out.get(), base_out.get(), ref_out.get(), "float32")
            assert_within_rule("lse", lse.get(), base_lse.get(), ref_lse.get(), "float32")
            _poison(cp, 16 * q.nbytes)
            grads = numba_flash.backward(dout, q, k, v, out, lse, causal=causal,
                                         backend="numba")
            refs = attention_backward(cp, dout, q, k, v, out, lse, spec, "float64")
            bases = attention_backward(cp, dout, q, k, v, out, lse, spec, "float32")
            for name, got, base, ref in zip(("dq", "dk", "dv"), grads, bases, refs):
                assert_within_rule(name, got.get(), base.get(), ref.get(), "float32")


def test_cupy_backend_matches_reference(cp, rng):
    q, k, v, dout = _inputs(cp, rng, (1, 300, 400, 2, 64), "float32")
    out, lse = numba_flash.forward(q, k, v, causal=True, backend="cupy")
    spec = make_spec(q.get(), causal=True, softmax_scale=0.125)
    ref_out, ref_lse = attention_forward(np, q.get(), k.get(), v.get(), spec, np.float64)
    assert np.abs(out.get() - ref_out).max() < 1e-5
    assert np.abs(lse.get() - ref_lse).max() < 1e-5


@pytest.mark.parametrize("backend, dtype", [("numba-mma", "float16"), ("numba-simt", "float32")])
def test_repeated_runs_are_bitwise_identical(cp, rng, backend, dtype):
    q, k, v, dout = _inputs(cp, rng, (1, 1000, 1000, 2, 64), dtype)
    first = None
    for _ in range(10):
        out, lse = numba_flash.forward(q, k, v, causal=True, backend=backend)
        result = [out, lse, *numba_flash.backward(dout, q, k, v, out, lse, causal=True,
                                                  backend=backend)]
        result = [x.get() for x in result]
        if first is None:
            first = result
        for a, b in zip(first, result):
            assert np.array_equal(a, b, equal_nan=True)


def test_runs_on_the_callers_stream(cp, rng, launch_streams):
    q, k, v, _ = _inputs(cp, rng, (1, 2048, 2048, 4, 64), "float16")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        q2 = q * 2  # queued on `stream`; forward must run after it, on the same stream
        out, _ = numba_flash.forward(q2, k, v, backend="numba")
        doubled = out * 1  # later work on the same stream sees the finished output
    stream.synchronize()
    assert launch_streams == [stream.ptr]
    spec = make_spec(q * 2, causal=False, softmax_scale=64 ** -0.5)
    ref, _ = attention_forward(cp, q * 2, k, v, spec, "float64")
    assert float(cp.abs(doubled.astype(cp.float64) - ref).max()) < 1e-3


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_torch_tensors_run_on_torchs_current_stream(cp, rng, launch_streams, dtype):
    """bfloat16 (tensor cores) and float32 (SIMT) torch tensors: forward and backward launch on
    torch's current stream, after the work queued there, before the work queued later."""
    torch = pytest.importorskip("torch")
    values = [torch.from_dlpack(x) for x in _inputs(cp, rng, (1, 1500, 1500, 4, 64), "float32")]
    q, k, v, dout = (x.to(getattr(torch, dtype)) for x in values)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        q2 = q * 2  # queued on `stream`; forward must run after it, on the same stream
        out, lse = numba_flash.forward(q2, k, v, causal=True, backend="numba")
        dq, _, _ = numba_flash.backward(dout, q2, k, v, out, lse, causal=True, backend="numba")
        later = (out.float() * 1, dq.float() * 1)  # later work on the stream sees the results
    stream.synchronize()
    assert launch_streams == [stream.cuda_stream] * 4  # forward, then the three backward kernels
    synced_out, synced_lse = numba_flash.forward(q2, k, v, causal=True, backend="numba")
    synced_dq, _, _ = numba_flash.backward(dout, q2, k, v, synced_out, synced_lse, causal=True,
                                           backend="numba")
    torch.cuda.synchronize()
    assert torch.equal(later[0], synced_out.float()) and torch.equal(later[1], synced_dq.float())


def test_numba_device_arrays_in_and_out(cp, rng):
    from numba import cuda
    q, k, v, _ = _inputs(cp, rng, (1, 100, 120, 2, 32), "float32")
    qn, kn, vn = (cuda.to_device(x.get()) for x in (q, k, v))
    out, lse = numba_flash.forward(qn, kn, vn, backend="numba")
    assert cuda.is_cuda_array(out) and not isinstance(out, cp.ndarray)
    spec = make_spec(q.get(), causal=False, softmax_scale=32 ** -0.5)
    ref_out, _ = attention_forward(np, q.get(), k.get(), v.get(), spec, np.float64)
    assert np.abs(out.copy_to_host() - ref_out).max() < 1e-5


def test_torch_tensors_in_and_out(rng):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(1, 300, 2, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    out, lse = numba_flash.forward(q, k, v, causal=True, backend="numba")
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16 and out.is_cuda
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2).float() for x in (q, k, v)), is_causal=True).transpose(1, 2)
    assert float((out.float() - ref).abs().max()) < 2e-3


def test_forward_memory_is_linear_in_seqlen(cp, rng):
    """Peak extra memory of the numba forward is out + lse, nothing of size N x N."""
    q, k, v, _ = _inputs(cp, rng, (1, 16384, 16384, 8, 64), "float16")
    pool = cp.get_default_memory_pool()
    cp.cuda.get_current_stream().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    numba_flash.forward(q, k, v, backend="numba")
    cp.cuda.get_current_stream().synchronize()
    extra = pool.total_bytes() - before
    assert extra <= q.nbytes + 8 * 16384 * 4 * 2, extra  # out, lse (+ allocator rounding)


def test_torch_tensors_that_require_grad(rng):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(1, 200, 2, 32, device="cuda", requires_grad=True) for _ in range(3))
    for backend in ("numba", "cupy"):
        out, lse = numba_flash.forward(q, k, v, backend=backend)
        assert isinstance(out, torch.Tensor) and out.shape == q.shape


def test_numba_arrays_run_on_the_stream_their_interface_names(rng, launch_streams):
    from numba import cuda
    stream = cuda.stream()
    q, k, v = (cuda.to_device(rng.standard_normal((1, 300, 2, 32)).astype("float32"),
                              stream=stream) for _ in range(3))
    out, _ = numba_flash.forward(q, k, v, backend="numba")
    stream.synchronize()
    assert launch_streams == [int(stream)]
    host = [x.copy_to_host() for x in (q, k, v)]
    ref, _ = attention_forward(np, *host, make_spec(host[0]), np.float64)
    assert np.abs(out.copy_to_host() - ref).max() < 1e-5


def test_strided_device_inputs(cp, rng):
    """A slice of a packed qkv tensor and transposed (B, H, N, D) views are read correctly in
    place (the kernels index through the strides)."""
    qkv = cp.asarray(rng.standard_normal((2, 300, 3, 4, 64)).astype("float16"))
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    bhnd = cp.asarray(rng.standard_normal((2, 4, 300, 64)).astype("float16"))
    for args in ((q, k, v), (bhnd.transpose(0, 2, 1, 3), k, v)):
        assert not args[0].flags.c_contiguous
        out, lse = numba_flash.forward(*args, causal=True, backend="numba")
        spec = make_spec(args[0], causal=True)
        ref, _ = attention_forward(cp, *args, spec, "float64")
        base, _ = attention_forward(cp, *args, spec, "float16")
        assert_within_rule("out", out.get(), base.get(), ref.get(), "float16")


@pytest.mark.parametrize("backend", ["numba", "numba-simt", "cupy"])
def test_arrays_on_a_second_gpu(cp, rng, backend):
    """Arrays on GPU 1 while GPU 0 is current: the kernels run on GPU 1 and the results stay
    there; arrays spread over two GPUs are refused before any launch."""
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    shape, dtype, causal = (1, 300, 257, 2, 64), "float16", True
    scale = shape[-1] ** -0.5
    with cp.cuda.Device(1):
        q, k, v, dout = _inputs(cp, rng, shape, dtype)
    with cp.cuda.Device(0):
        out, lse = numba_flash.forward(q, k, v, causal=causal, backend=backend)
        grads = numba_flash.backward(dout, q, k, v, out, lse, causal=causal, backend=backend)
    assert {x.device.id for x in (out, lse, *grads)} == {1}
    with cp.cuda.Device(1):
        spec = make_spec(q, causal=causal, softmax_scale=scale)
        ref_out, ref_lse = attention_forward(cp, q, k, v, spec, "float64")
        base_out, base_lse = attention_forward(cp, q, k, v, spec, dtype)
        refs = attention_backward(cp, dout, q, k, v, out, lse, spec, "float64")
        bases = attention_backward(cp, dout, q, k, v, out, lse, spec, dtype)
    assert_within_rule("out", out.get(), base_out.get(), ref_out.get(), dtype)
    assert_within_rule("lse", lse.get(), base_lse.get(), ref_lse.get(), dtype)
    for name, got, base, ref in zip(("dq", "dk", "dv"), grads, bases, refs):
        assert_within_rule(name, got.get(), base.get(), ref.get(), dtype)
    with cp.cuda.Device(0):
        k_on_0 = cp.asarray(k.get())
    with pytest.raises(ValueError, match="same GPU; got q on GPU 1, k on GPU 0, v on GPU 1"):
        numba_flash.forward(q, k_on_0, v, backend=backend)
