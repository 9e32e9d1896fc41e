"""Test set-up: the CUDA simulator unless the GPU tests were asked for.

`pytest` (CI, any machine): NUMBA_ENABLE_CUDASIM=1 is set before numba is imported, so the
kernels run in Numba's CUDA simulator at small sizes; tests marked `gpu` are skipped.
`pytest -m gpu` (on a CUDA machine): the real GPU; only the `gpu` tests run.
"""
import os

import numpy as np
import pytest


def _gpu_run(config):
    markexpr = config.getoption("markexpr") or ""
    return "gpu" in markexpr and "not gpu" not in markexpr


def pytest_configure(config):
    if not _gpu_run(config):
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


def pytest_collection_modifyitems(config, items):
    if _gpu_run(config):
        return
    skip = pytest.mark.skip(reason="needs a real CUDA GPU: run `python -m pytest -m gpu` there")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_call_cache():
    """Each test starts with no replayed signature (numba_flash/call_cache.py), so whether a
    call runs the full path or a replay does not depend on the tests run before it."""
    from numba_flash import call_cache
    call_cache.clear()
    yield
    call_cache.clear()


@pytest.fixture
def host_replays(monkeypatch):
    """Signatures for NumPy arrays too (numba_flash/call_cache.py gives only device arrays
    one), so that the API's replays can be exercised without a GPU, on the numpy backend."""
    from numba_flash import call_cache

    def numpy_signature(x):
        if not isinstance(x, np.ndarray):
            return None
        pointer = x.ctypes.data
        return (type(x), x.shape, x.strides, x.dtype, "host", pointer % 16 == 0), pointer
    monkeypatch.setattr(call_cache, "_array_signature", numpy_signature)


@pytest.fixture
def rng():
    """A fresh random generator per test; its seed is printed so a failure can be replayed."""
    seed = np.random.SeedSequence().entropy
    print(f"rng seed: {seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Make the numba backends allocate NaN-filled outputs and scratch, so an element a kernel
    forgets to write shows (the subclasses numba-mma and numba-simt inherit the patch)."""
    from numba_flash.backends.numba.backend import NumbaBackend
    original = NumbaBackend._new

    def poisoned(self, ref, shape, dtype):
        array = original(self, ref, shape, dtype)
        if str(dtype).endswith("int16"):  # 16-bit patterns: the float16 NaN 0x7E00
            array[...] = 0x7E00
        elif str(dtype).startswith(("int", "uint")):  # other integer scratch: all bits set
            array[...] = np.iinfo(str(dtype)).max if str(dtype).startswith("u") else -1
        else:
            array[...] = float("nan")
        return array
    monkeypatch.setattr(NumbaBackend, "_new", poisoned)


@pytest.fixture
def cp():
    """CuPy, for the GPU tests."""
    return pytest.importorskip("cupy")


@pytest.fixture
def launch_streams(monkeypatch):
    """The stream handle of every kernel launch the test makes (backends/numba/launch.py), in
    order."""
    from numba_flash.backends.numba import launch as numba_launch
    seen = []
    real = numba_launch._driver_launch

    def record(function, dims, shared_bytes, stream, kernel_params):
        seen.append(int(stream))
        real(function, dims, shared_bytes, stream, kernel_params)
    monkeypatch.setattr(numba_launch, "_driver_launch", record)
    return seen
