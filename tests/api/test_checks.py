"""Bad input: a clear error naming the argument and what was expected, before any launch."""
import pytest
from inputs import random_qkv

import numba_flash


@pytest.fixture
def qkv(rng):
    return random_qkv(rng, 2, 5, 7, 3, 16, "float32")


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Any kernel launch during these tests is a failure: errors must come first."""
    from numba_flash.backends.numba import backend as numba_backend

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched for bad input")

    for method in ("forward", "backward"):
        monkeypatch.setattr(numba_backend.NumbaBackend, method, launched)


def test_wrong_ndim(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"k must be 4-D \(batch, seqlen, nheads, headdim\); "
                                         r"got shape \(2, 7, 48\)"):
        numba_flash.forward(q, k.reshape(2, 7, 48), v, backend="numba")


@pytest.mark.parametrize("axis, name", [(0, "batch size"), (3, "headdim")])
def test_mismatched_dims(rng, qkv, axis, name):
    """(k and v with other heads than q: tests/variants/test_options.py, GQA)"""
    q, k, v = qkv
    shape = list(v.shape)
    shape[axis] += 1
    bad_v = rng.standard_normal(shape).astype("float32")
    with pytest.raises(ValueError, match=f"{name} mismatch: q has {q.shape[axis]}, "
                                         f"v has {shape[axis]}"):
        numba_flash.forward(q, k, bad_v, backend="numba")


def test_k_v_seqlen_mismatch(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="seqlen mismatch: k has 7 keys, v has 6"):
        numba_flash.forward(q, k, v[:, :6], backend="numba")


def test_dtypes_differ(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match="same dtype; got q=float32, k=float16, v=float32"):
        numba_flash.forward(q, k.astype("float16"), v, backend="numba")


@pytest.mark.parametrize("dtype", ["int32", "complex64", "bool"])
def test_non_float_dtypes(qkv, dtype):
    q, k, v = (x.astype(dtype) for x in qkv)
    with pytest.raises(TypeError, match=f"must be floating point .*got {dtype}"):
        numba_flash.forward(q, k, v)


def test_float64_on_numba_names_the_backends_that_take_it(qkv):
    q, k, v = (x.astype("float64") for x in qkv)
    with pytest.raises(ValueError, match="dtype float64 is not supported .*backends that "
                                         "support float64: cupy, numpy"):
        numba_flash.forward(q, k, v, backend="numba")


@pytest.mark.parametrize("headdim", [0, 257])
def test_headdim_out_of_range(rng, headdim):
    q, k, v = random_qkv(rng, 1, 3, 3, 1, headdim, "float32")
    with pytest.raises(ValueError, match=f"headdim must be in 1..256; got {headdim}"):
        numba_flash.forward(q, k, v)


def test_seqlen_zero(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="seqlen must be >= 1; got seqlen_q=0"):
        numba_flash.forward(q[:, :0], k, v)
    with pytest.raises(ValueError, match="seqlen_k=0"):
        numba_flash.forward(q, k[:, :0], v[:, :0])


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_softmax_scale(qkv, scale):
    with pytest.raises(ValueError, match="softmax_scale must be a finite positive number"):
        numba_flash.forward(*qkv, softmax_scale=scale)


@pytest.mark.parametrize("scale", [1e-300, 1e-40, 1e39])
def test_softmax_scale_outside_float32(qkv, scale):
    # scale · log2(e) would round to 0 or inf in the kernels' float32 arithmetic
    with pytest.raises(ValueError, match=r"softmax_scale must be a finite positive number within "
                                         r"float32 range \(1e-38 to 1e\+38\) or None; got"):
        numba_flash.forward(*qkv, softmax_scale=scale)


@pytest.mark.parametrize("scale", ["big", "0.5", True, b"1"])
def test_softmax_scale_not_a_number(qkv, scale):
    """Strings and bools are refused although float() would take some of them."""
    with pytest.raises(TypeError, match="softmax_scale must be a finite positive number or None;"
                                        f" got {scale!r}"):
        numba_flash.forward(*qkv, softmax_scale=scale)


def test_causal_must_be_bool(qkv):
    with pytest.raises(TypeError, match="causal must be True or False; got 'yes'"):
        numba_flash.forward(*qkv, causal="yes")


def test_not_an_array(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match="q must be an array .*got list"):
        numba_flash.forward(q.tolist(), k, v)


def test_backward_shape_checks(rng, qkv):
    q, k, v = qkv
    out = rng.standard_normal(q.shape).astype("float32")
    lse = rng.standard_normal((2, 3, 5)).astype("float32")
    with pytest.raises(ValueError, match=r"dout must have q's shape \(2, 5, 3, 16\); "
                                         r"got \(2, 4, 3, 16\)"):
        numba_flash.backward(out[:, :4], q, k, v, out, lse, backend="numba")
    with pytest.raises(TypeError, match="out must have q's dtype float32; got float16"):
        numba_flash.backward(out, q, k, v, out.astype("float16"), lse, backend="numba")
    with pytest.raises(ValueError, match=r"lse must have shape \(batch, nheads, seqlen_q\) = "
                                         r"\(2, 3, 5\); got \(2, 5, 3\)"):
        numba_flash.backward(out, q, k, v, out, lse.transpose(0, 2, 1), backend="numba")
    with pytest.raises(TypeError, match="lse must be float32 .*got float64"):
        numba_flash.backward(out, q, k, v, out, lse.astype("float64"), backend="numba")


def test_host_arrays_to_a_gpu_only_backend(qkv):
    with pytest.raises(ValueError, match="backend 'cupy' cannot run this call"):
        numba_flash.forward(*qkv, backend="cupy")


def test_numba_refuses_host_arrays_outside_the_simulator(qkv, monkeypatch):
    from numba_flash.backends.numba import backend as numba_backend
    monkeypatch.setattr(numba_backend, "simulator_enabled", lambda: False)
    monkeypatch.setattr(numba_backend.NumbaBackend, "available", lambda self: None)
    with pytest.raises(ValueError, match="takes device arrays .*got host arrays"):
        numba_flash.forward(*qkv, backend="numba")


def test_mixed_host_and_device_arrays(qkv):
    q, k, v = qkv

    class FakeDeviceArray:  # a device array as the interop layer sees one
        shape, dtype = k.shape, k.dtype
        __cuda_array_interface__ = {"shape": k.shape, "typestr": "<f4", "data": (0, False),
                                    "version": 3}

    with pytest.raises(ValueError, match="same device; got q on host, k on GPU, v on host"):
        numba_flash.forward(q, FakeDeviceArray(), v)
