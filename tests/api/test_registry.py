"""The backend table: names, lookup errors, the default backend, "auto" and its reasons."""
import numpy as np
import pytest
from inputs import random_qkv

import numba_flash
from numba_flash import registry


def test_list_backends_names_every_registered_backend():
    assert numba_flash.list_backends() == [
        "numba", "numba-hopper", "numba-mma", "numba-simt", "cupy", "numpy"]


def test_get_backend_returns_objects_with_the_contract():
    for name in numba_flash.list_backends():
        backend = numba_flash.get_backend(name)
        assert backend.name == name
        for method in ("supports", "forward", "backward"):
            assert callable(getattr(backend, method))


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown backend 'flash3'; registered backends: "
                                         r"numba, numba-hopper, numba-mma, numba-simt, cupy, "
                                         r"numpy"):
        numba_flash.get_backend("flash3")
    q, k, v = random_qkv(np.random.default_rng(), 1, 4, 4, 1, 8, "float32")
    with pytest.raises(ValueError, match="unknown backend 'nope'; registered backends"):
        numba_flash.forward(q, k, v, backend="nope")


def test_use_backend_sets_and_restores_the_default(rng):
    q, k, v = random_qkv(rng, 1, 5, 7, 1, 8, "float32")
    assert registry.default_backend() == "auto"
    with numba_flash.use_backend("numpy"):
        assert registry.default_backend() == "numpy"
        with numba_flash.use_backend("numba"):
            assert numba_flash.select_backend(q, k, v).name == "numba"
        assert numba_flash.select_backend(q, k, v).name == "numpy"
    assert registry.default_backend() == "auto"
    with pytest.raises(RuntimeError):
        with numba_flash.use_backend("numpy"):
            raise RuntimeError("boom")
    assert registry.default_backend() == "auto"


def test_use_backend_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown backend 'bogus'"):
        with numba_flash.use_backend("bogus"):
            pass


def test_environment_variable_sets_the_default(rng, monkeypatch):
    q, k, v = random_qkv(rng, 1, 5, 7, 1, 8, "float32")
    monkeypatch.setenv("NUMBA_FLASH_BACKEND", "numpy")
    assert numba_flash.select_backend(q, k, v).name == "numpy"
    with numba_flash.use_backend("numba"):  # the context manager wins over the variable
        assert numba_flash.select_backend(q, k, v).name == "numba"
    monkeypatch.setenv("NUMBA_FLASH_BACKEND", "bogus")
    with pytest.raises(ValueError, match=r"unknown backend in \$NUMBA_FLASH_BACKEND 'bogus'"):
        numba_flash.forward(q, k, v)


def test_auto_uses_the_first_backend_that_supports_the_call(rng):
    q, k, v = random_qkv(rng, 1, 6, 6, 1, 8, "float64")
    selection = numba_flash.select_backend(q, k, v)
    # float64 host arrays: numba refuses the dtype, cupy needs device arrays (or is absent).
    assert selection.name == "numpy"
    assert "float64 is not supported" in selection.skipped["numba"]
    assert set(selection.skipped) == {"numba", "numba-hopper", "numba-mma", "numba-simt", "cupy"}
    text = str(selection)
    assert "using backend 'numpy'" in text and "numba: not used because" in text


def test_auto_result_matches_reference(rng):
    q, k, v = random_qkv(rng, 1, 9, 12, 2, 16, "float64")
    out, lse = numba_flash.forward(q, k, v, causal=True)
    from numba_flash.reference import attention_forward
    from numba_flash.spec import make_spec
    spec = make_spec(q, causal=True, softmax_scale=0.25)
    ref_out, ref_lse = attention_forward(np, q, k, v, spec, np.float64)
    assert np.array_equal(out, ref_out) and np.allclose(lse, ref_lse, rtol=1e-6)


def test_backend_that_cannot_serve_the_call_says_why(rng):
    q, k, v = random_qkv(rng, 1, 6, 6, 1, 8, "float64")
    with pytest.raises(ValueError, match=r"backend 'numba' cannot run this call: dtype float64 "
                                         r"is not supported .*backends that support float64: "
                                         r"cupy, numpy"):
        numba_flash.forward(q, k, v, backend="numba")


def test_available_backends_gives_reasons_without_a_gpu(monkeypatch):
    available = numba_flash.available_backends()
    assert set(available) == {"numba", "numba-hopper", "numba-mma", "numba-simt", "cupy", "numpy"}
    assert available["numpy"] is None
    assert available["numba"] is None  # the tests run the kernels in the simulator
    # Outside the simulator, on this GPU-less machine, numba says what is missing.
    from numba_flash.backends.numba import backend as numba_backend
    monkeypatch.setattr(numba_backend, "simulator_enabled", lambda: False)
    monkeypatch.setattr("numba.cuda.is_available", lambda: False)
    reason = numba_flash.available_backends()["numba"]
    assert "no usable CUDA GPU" in reason and "NUMBA_ENABLE_CUDASIM=1" in reason


def test_cupy_reason_when_cupy_is_missing(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name == "cupy" or name.startswith("cupy."):
            raise ImportError("No module named 'cupy'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    assert "CuPy is not installed" in numba_flash.available_backends()["cupy"]
