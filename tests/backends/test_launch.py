"""backends/numba/launch.py: array views and kernel parameters as Numba's kernel ABI lays them
out (CPU), and launches on the GPU (the kernels' own GPU tests run through it too)."""
import gc
import os
import subprocess
import sys
import weakref

import numpy as np
import pytest

from numba_flash.backends.numba import launch as numba_launch
from numba_flash.backends.numba.launch import DeviceView, device_view, is_c_contiguous


class InterfaceOnly:
    """An array known only through __cuda_array_interface__ (e.g. from another library)."""

    def __init__(self, shape, typestr, strides=None, ptr=0x7000_0000):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "strides": strides,
                                         "data": (ptr, False), "version": 3}


def test_the_array_layout_is_numbas():
    """The parameters launch() packs for an array follow the fields of Numba's CUDA data model
    for arrays; a Numba release that changes them fails here, not on the GPU."""
    code = ("from numba import types\n"
            "from numba.cuda.descriptor import cuda_target\n"
            "models = cuda_target.target_context.data_model_manager\n"
            "for layout in 'CA':\n"
            "    print(models[types.Array(types.uint16, 4, layout)]._fields)\n")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")  # the CUDA target, not the simulator
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    expected = str(numba_launch.ARRAY_FIELDS)
    assert run.stdout.splitlines() == [expected, expected]


def test_array_parameters(rng):
    shape = tuple(int(s) for s in rng.integers(1, 9, size=4))
    view = DeviceView(0x1234_5600, shape, (8 * shape[1] * shape[2] * shape[3],
                                           8 * shape[2] * shape[3], 8 * shape[3], 8),
                      np.dtype("float64"))
    argtype, values, slots = numba_launch._argument(view)
    assert argtype.layout == "C" and argtype.ndim == 4 and str(argtype.dtype) == "float64"
    # meminfo, parent, nitems, itemsize, data, shape, strides
    assert values == (0, 0, int(np.prod(shape)), 8, 0x1234_5600, *shape, *view.strides)
    assert slots == (4,)
    strided = DeviceView(view.ptr, shape, view.strides[:2] + (16 * shape[3], 16), view.dtype)
    assert numba_launch._argument(strided)[0].layout == ("C" if shape[2] == shape[3] == 1
                                                         else "A")
    argtype, values, slots = numba_launch._argument(np.float32(0.25))
    assert str(argtype) == "float32" and values[0].value == 0.25 and slots == ()
    argtype, values, slots = numba_launch._argument(np.int32(-3))
    assert str(argtype) == "int32" and values[0].value == -3 and slots == ()


def test_scalars_pack_into_the_low_half_of_their_slot_and_key_the_launch():
    """An 8-byte scalar fills its slot; a 4-byte scalar's parameter is the first 4 bytes of
    its 8-byte slot (cuLaunchKernel reads 4 there), and launches that differ only in a
    scalar's value are different prepared launches (the decode kernels take their token
    counts as int32)."""
    import ctypes
    launch = numba_launch.PreparedLaunch(None, (1,), (1,), 0,
                                         (ctypes.c_float(0.5), ctypes.c_int32(-7), 9,
                                          ctypes.c_uint64(2**64 - 3)), ())
    raw = bytes(launch._values)
    assert np.frombuffer(raw[0:4], np.float32)[0] == 0.5
    assert np.frombuffer(raw[8:12], np.int32)[0] == -7 and raw[16] == 9
    assert np.frombuffer(raw[24:32], np.uint64)[0] == 2**64 - 3  # (a tensor map's words)
    argtype, values, _ = numba_launch._argument(np.uint64(2**63))
    assert str(argtype) == "uint64" and values[0].value == 2**63
    assert numba_launch._signature(np.int32(3)) != numba_launch._signature(np.int32(4))
    assert numba_launch._signature(np.int32(3)) != numba_launch._signature(np.float32(3))


def test_tuple_parameters_are_their_items_in_order():
    """A tuple argument (a mask_mod's captured arrays) is its items' parameters one after
    another, as Numba's data model flattens tuples; an empty tuple has none."""
    ids = DeviceView(0x1000, (7,), (4,), np.dtype("int32"))
    flags = DeviceView(0x2000, (2, 3), (3, 1), np.dtype("bool"))
    argtype, values, slots = numba_launch._argument((ids, flags))
    assert str(argtype) == "Tuple(array(int32, 1d, C), array(bool, 2d, C))"
    assert values == (0, 0, 7, 4, 0x1000, 7, 4, 0, 0, 6, 1, 0x2000, 2, 3, 3, 1)
    assert slots == (4, 11) and [values[s] for s in slots] == [0x1000, 0x2000]
    assert list(numba_launch._pointers([ids, (), (flags, ids), np.float32(1)])) == [
        0x1000, 0x2000, 0x1000]
    argtype, values, slots = numba_launch._argument(())
    assert str(argtype) == "Tuple()" and values == () and slots == ()


@pytest.mark.parametrize("scalar", [0.25, np.float64(0.25), np.int64(3), np.uint32(3), 7])
def test_scalars_other_than_float32_int32_and_uint64_are_refused(scalar):
    with pytest.raises(TypeError, match="arrays or numpy float32 / int32 / uint64 scalars; got "
                                        f"{type(scalar).__name__}"):
        numba_launch._argument(scalar)


def test_what_is_not_a_device_array_is_refused():
    with pytest.raises(TypeError, match="a device array is needed here .* got ndarray"):
        device_view(np.zeros((2, 3), np.float32))
    masked = InterfaceOnly((2, 3), "<f4")
    masked.__cuda_array_interface__["mask"] = InterfaceOnly((2, 3), "|b1")
    with pytest.raises(TypeError, match="masked arrays"):
        device_view(masked)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="a CUDA tensor is needed here; got one on cpu"):
        device_view(torch.zeros(2, 3))


def test_a_view_keeps_its_array_alive():
    """A scratch array made for a launch must outlive the view the launch takes of it."""
    array = InterfaceOnly((4, 8), "<f2")
    alive = weakref.ref(array)
    view = device_view(array).view(np.uint16)
    del array
    gc.collect()
    assert alive() is not None and view.owner is alive()
    del view
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("index", [np.s_[:, :, 0], np.s_[..., ::2], np.s_[:, 1:2], np.s_[::-1],
                                   np.s_[:, :1, :, :], np.s_[:0], np.s_[:0, :, ::2]])
def test_c_contiguity_is_numpys(index):
    x = np.zeros((3, 4, 5, 6), np.float16)[index]
    if x.ndim < 4:
        x = x[..., None]
    assert is_c_contiguous(x.shape, x.strides, x.itemsize) == x.flags.c_contiguous


def test_views_of_interface_arrays():
    packed = device_view(InterfaceOnly((2, 3, 4), "<f2"))
    assert packed == DeviceView(0x7000_0000, (2, 3, 4), (24, 8, 2), np.dtype("float16"))
    strided = device_view(InterfaceOnly((2, 3), "<f4", strides=(40, 4)))
    assert strided.strides == (40, 4) and strided.size == 6
    bits = strided.view(np.uint32)
    assert bits.dtype == np.uint32 and bits.ptr == strided.ptr
    with pytest.raises(ValueError, match="cannot view float32 items as uint16"):
        strided.view(np.uint16)
    assert device_view(bits) is bits
    assert device_view(InterfaceOnly((2, 3), "<u4", strides=(40, 4))) == bits


@pytest.mark.gpu
def test_views_of_cupy_and_torch(cp):
    x = cp.arange(2 * 5 * 3 * 8, dtype=cp.float16).reshape(2, 5, 3, 8)[:, 1:4]
    assert device_view(x) == DeviceView(x.data.ptr, x.shape, x.strides, np.dtype("float16"))
    torch = pytest.importorskip("torch")
    t = torch.from_dlpack(x)
    assert device_view(t) == device_view(x)


@pytest.mark.gpu
def test_launches_on_the_given_stream(cp, launch_streams):
    """The copy kernel through launch(): right result, on the stream handle given."""
    from numba_flash.backends.numba.marshal import copy_padded
    src = cp.random.standard_normal((2, 7, 3, 5)).astype(cp.float16)
    dst = cp.full((2, 7, 3, 8), cp.nan, cp.float16)
    stream = cp.cuda.Stream(non_blocking=True)
    copy_padded(device_view(src), device_view(dst), stream.ptr)
    stream.synchronize()
    assert launch_streams == [stream.ptr]
    assert cp.array_equal(dst[..., :5], src) and not cp.any(dst[..., 5:])
