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


@pytest.fixture
def rng():
    """A fresh random generator per test; its seed is printed so a failure can be replayed."""
    seed = np.random.SeedSequence().entropy
    print(f"rng seed: {seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Make the numba backend allocate NaN-filled outputs, so an unwritten element shows."""
    import numba_flash
    backend = numba_flash.get_backend("numba")
    monkeypatch.setattr(type(backend), "_new",
                        lambda self, ref, shape, dtype: np.full(shape, np.nan, dtype))
