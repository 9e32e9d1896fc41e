"""numba_flash._arrays: which library and kind an array is (asked once per type, so the answer
must hold for every object of the type) and convert_like's pass-through of a replay's results."""
import numpy as np
import pytest

from numba_flash import _arrays

torch = pytest.importorskip("torch")
HERE = __name__.split(".")[0]  # (this module's top-level package, as _arrays.library sees it)


class _Interface:
    """An object whose __cuda_array_interface__ is set per instance (as _arrays' own views)."""

    def __init__(self, has_interface):
        if has_interface:
            self.__cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (0, False),
                                             "version": 3}


def test_libraries_and_kinds_by_type():
    image_type = type("Image", (torch.Tensor,), {"__module__": "visionlib.tensors"})
    image = torch.zeros(3).as_subclass(image_type)  # a torch subclass from another package
    cases = [(np.zeros(2), "numpy", _arrays.HOST),
             (np.zeros((2, 2)).view(np.matrix), "numpy", _arrays.HOST),
             (torch.zeros(2), "torch", _arrays.HOST),
             (torch.nn.Parameter(torch.zeros(2)), "torch", _arrays.HOST),
             (image, "torch", _arrays.HOST),
             (_Interface(True), HERE, _arrays.CUDA),
             (_Interface(False), HERE, None),
             ([1.0, 2.0], "builtins", None)]
    for _ in range(2):  # (the second time from the per-type cache)
        for x, library, kind in cases:
            assert (_arrays.library(x), _arrays.array_kind(x)) == (library, kind), type(x)


def test_convert_like_passes_an_array_of_the_same_kind_through():
    a, b = torch.zeros(2), torch.ones(3)
    assert _arrays.convert_like(a, b) is a
    n = np.arange(3.0)
    assert _arrays.convert_like(n, np.zeros(1)) is n
    converted = _arrays.convert_like(n, b)
    assert type(converted) is torch.Tensor and converted.tolist() == [0.0, 1.0, 2.0]
    back = _arrays.convert_like(a, n)
    assert type(back) is np.ndarray and back.tolist() == [0.0, 0.0]
