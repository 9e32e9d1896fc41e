"""Kernel launches that cost little host time: compile through Numba once, then launch the
compiled kernel directly.

`kernel[grid, block, stream, shared](*args)` makes Numba type every argument, build a launch
configuration and pack each array through a Numba device array: several times the host time of
torch SDPA per call (docs/KERNEL_NOTES.md, "Tuning history"), which a caller waiting for the
result pays.

Here an array is a `DeviceView` (pointer, shape, strides, dtype, read straight from CuPy,
torch or `__cuda_array_interface__`). The compiled kernel is looked up once per (kernel,
argument types, device), and the arguments are packed the way Numba's kernel ABI lays an array
out (`ARRAY_FIELDS`; numba-cuda is pinned < 0.31 in setup.cfg, and tests/backends/test_launch.py
checks the layout against Numba's data model) once per argument signature into a
`PreparedLaunch`,
which then takes only the arrays' addresses and a stream to call cuLaunchKernel. Under the
simulator the arrays are NumPy arrays and launches go through Numba as before.
"""
import contextlib
import ctypes
import functools
import math
import threading
from typing import NamedTuple

import numpy as np

from numba_flash import _arrays

from . import replay
from .gpu import SHARED_MEMORY_BYTES, simulator_enabled

#: the fields of a Numba array argument, in the order its kernel parameters take them
ARRAY_FIELDS = ("meminfo", "parent", "nitems", "itemsize", "data", "shape", "strides")


class DeviceView:
    """Where an array's elements are on the GPU: what a kernel launch needs of it. `owner`,
    the array it views, stays alive as long as the view does (a scratch array made for a
    launch must not go back to its memory pool before the launch is queued). A plain class
    with slots: one is made per array per call, and a dataclass costs microseconds more."""
    __slots__ = ("ptr", "shape", "strides", "dtype", "owner")

    def __init__(self, ptr, shape, strides, dtype, owner=None):
        self.ptr, self.shape, self.strides = int(ptr), tuple(shape), tuple(strides)  # strides:
        self.dtype, self.owner = np.dtype(dtype), owner  # in bytes

    def _fields(self):
        return (self.ptr, self.shape, self.strides, self.dtype)

    def __eq__(self, other):
        return isinstance(other, DeviceView) and self._fields() == other._fields()

    def __hash__(self):
        return hash(self._fields())

    def __repr__(self):
        return (f"DeviceView(ptr={self.ptr:#x}, shape={self.shape}, strides={self.strides}, "
                f"dtype={self.dtype})")

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return math.prod(self.shape)

    def view(self, dtype):
        """The same memory as another element type of the same size (e.g. float16 -> uint16)."""
        dtype = np.dtype(dtype)
        if dtype.itemsize != self.dtype.itemsize:
            raise ValueError(f"cannot view {self.dtype} items as {dtype}")
        return DeviceView(self.ptr, self.shape, self.strides, dtype, self.owner)


def device_view(x):
    """A DeviceView of a CuPy array, a CUDA torch tensor of a type NumPy has (bfloat16 ones
    viewed as int16 first), or any object with `__cuda_array_interface__` (a Numba device
    array, a DeviceView)."""
    if isinstance(x, DeviceView):
        return x
    package = _arrays.library(x)
    if package == "cupy":
        return DeviceView(x.data.ptr, x.shape, x.strides, x.dtype, x)
    if package == "torch":
        if not x.is_cuda:
            raise TypeError(f"a CUDA tensor is needed here; got one on {x.device}")
        name = str(x.dtype).replace("torch.", "")
        if name == "bfloat16":
            raise TypeError("NumPy has no bfloat16: pass x.view(torch.int16)")
        size = x.element_size()
        return DeviceView(x.data_ptr(), tuple(x.shape), tuple(s * size for s in x.stride()),
                          np.dtype(name), x)
    interface = getattr(x, "__cuda_array_interface__", None)
    if interface is None:
        raise TypeError(f"a device array is needed here (CuPy, torch, or one with "
                        f"__cuda_array_interface__); got {type(x).__name__}")
    if interface.get("mask") is not None:
        raise TypeError("masked arrays (__cuda_array_interface__ 'mask') are not supported")
    shape, dtype = tuple(interface["shape"]), np.dtype(interface["typestr"])
    strides = interface.get("strides") or contiguous_strides(shape, dtype.itemsize)
    return DeviceView(interface["data"][0], shape, tuple(strides), dtype, x)


def contiguous_strides(shape, itemsize):
    """The strides in bytes of a C-contiguous array."""
    return tuple(math.prod(shape[i + 1:]) * itemsize for i in range(len(shape)))


def is_c_contiguous(shape, strides, itemsize):
    """NumPy's rule: strides match a C layout wherever a dimension has more than one element
    (and an empty array is contiguous)."""
    if 0 in shape:
        return True
    expected = itemsize
    for extent, stride in zip(reversed(shape), reversed(strides)):
        if extent != 1:
            if stride != expected:
                return False
            expected *= extent
    return True


@functools.lru_cache(maxsize=4096)
def _array_signature(dtype, shape, strides):
    """(Numba type, (nitems, itemsize), shape + strides) of an array: what its kernel
    parameters hold besides the pointer (cached: a training loop repeats its shapes)."""
    from numba import types
    from numba.np import numpy_support
    layout = "C" if is_c_contiguous(shape, strides, dtype.itemsize) else "A"
    return (types.Array(numpy_support.from_dtype(dtype), len(shape), layout),
            (math.prod(shape), dtype.itemsize), shape + strides)


#: the scalar types kernels take, with their Numba and ctypes types
_SCALARS = {np.float32: ("float32", ctypes.c_float), np.int32: ("int32", ctypes.c_int32),
            np.uint64: ("uint64", ctypes.c_uint64)}


def _launch_arg(arg):
    """A float32, int32 or uint64 scalar as it is, a tuple as a tuple of its items', any other
    argument as its DeviceView."""
    if type(arg) in _SCALARS:
        return arg
    if isinstance(arg, tuple):
        return tuple(map(_launch_arg, arg))
    if isinstance(arg, (np.generic, int, float)):
        raise TypeError(f"kernel arguments are arrays or numpy float32 / int32 / uint64 scalars; "
                        f"got {type(arg).__name__}")
    return device_view(arg)


def _argument(arg):
    """(Numba type, kernel parameters, the parameters' indices that hold array addresses) of
    one argument: a DeviceView, a scalar (_SCALARS) or a tuple of them (which Numba's kernel ABI
    passes as its items' parameters one after another; an empty one as none)."""
    arg = _launch_arg(arg)
    return (_argument_type(arg), *_parameters(arg))


def argument_types(args):
    """The Numba types a kernel is compiled for when launched with `args` (launch's, or NumPy
    arrays: the simulator's), without packing them."""
    return tuple(map(_argument_type, args))


def _argument_type(arg):
    from numba import types
    if type(arg) in _SCALARS:
        return getattr(types, _SCALARS[type(arg)][0])
    if isinstance(arg, tuple):
        return types.BaseTuple.from_types(tuple(map(_argument_type, arg)))
    array = arg if isinstance(arg, np.ndarray) else _launch_arg(arg)
    return _array_signature(array.dtype, array.shape, array.strides)[0]


def _parameters(arg):
    """(kernel parameters, the parameters' indices that hold array addresses) of a _launch_arg
    (_argument's)."""
    if type(arg) in _SCALARS:
        return (_SCALARS[type(arg)][1](arg),), ()
    if isinstance(arg, tuple):
        parameters, pointer_slots = [], []
        for item in arg:
            values, slots = _parameters(item)
            pointer_slots.extend(len(parameters) + slot for slot in slots)
            parameters.extend(values)
        return tuple(parameters), tuple(pointer_slots)
    _, sizes, shape_strides = _array_signature(arg.dtype, arg.shape, arg.strides)
    # meminfo, parent, nitems, itemsize, data, shape, strides (ARRAY_FIELDS)
    return (0, 0, *sizes, arg.ptr, *shape_strides), (ARRAY_FIELDS.index("data"),)


def _pointers(args):
    """The arrays' addresses among launch arguments (tuples' items included), in order."""
    for arg in args:
        if isinstance(arg, tuple):
            yield from _pointers(arg)
        elif type(arg) not in _SCALARS:
            yield arg.ptr


def current_device():
    """The ordinal of the GPU whose context is current on this thread, or None."""
    binding = _driver()
    error, device = binding.cuCtxGetDevice()
    return int(device) if error == binding.CUresult.CUDA_SUCCESS else None


def on_device(device):
    """A context manager making `device` current, or nothing to do if it already is."""
    if current_device() == device:
        return contextlib.nullcontext()
    from numba import cuda
    return cuda.gpus[device]


class _Compiled(NamedTuple):
    handle: object  # the kernel's driver handle
    shared_limit: list  # [bytes of dynamic shared memory the kernel is opted in to]
    local_bytes: int  # local memory per thread (spills, arrays ptxas kept in memory)


_compiled = {}
_lock = threading.Lock()


def _compile(kernel, argtypes, device):
    """The loaded kernel for these argument types on `device` (compiling it on first use)."""
    from numba import cuda
    key = (kernel, argtypes, device)
    with _lock, cuda.gpus[device]:
        if key not in _compiled:
            cufunc = kernel.compile(argtypes)._codelibrary.get_cufunc()
            _compiled[key] = _Compiled(cufunc.handle, [SHARED_MEMORY_BYTES], cufunc.attrs.local)
        return _compiled[key]


def local_memory(kernel, argtypes, device):
    """Bytes of local memory a thread of `kernel` compiled for `argtypes` takes on `device`
    (compiled and loaded for the launches that follow); None under the simulator, which
    compiles nothing."""
    if simulator_enabled():
        return None
    return _compile(kernel, argtypes, device).local_bytes


def _opt_in(compiled, shared_bytes, device):
    """Let the kernel take `shared_bytes` of dynamic shared memory (above 48 KiB it must ask:
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)."""
    from numba import cuda
    from numba.cuda.cudadrv.driver import binding, driver
    with _lock, cuda.gpus[device]:
        if shared_bytes <= compiled.shared_limit[0]:
            return
        limit = cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        if shared_bytes > limit:
            raise ValueError(f"this kernel needs {shared_bytes} bytes of shared memory per "
                             f"block; this GPU allows {limit}")
        attribute = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.cuKernelSetAttribute(attribute, shared_bytes, compiled.handle, device)
        compiled.shared_limit[0] = shared_bytes


class PreparedLaunch:
    """One launch of a compiled kernel with its grid, block, shared memory and every parameter
    fixed but the arrays' addresses: calling it with those and a stream launches it.

    The parameters are packed once, 8 bytes each (a 4-byte scalar in the low half of its slot), in
    the order Numba's kernel ABI takes them (ARRAY_FIELDS); `pointer_slots` are the slots of
    the arrays' `data` fields. cuLaunchKernel copies the parameters before it returns, so one
    buffer serves every launch, under a lock in case two threads launch it at once."""

    def __init__(self, function, grid, block, shared_bytes, parameters, pointer_slots):
        self.function, self.shared_bytes = function, shared_bytes
        self.dims = tuple(grid) + (1,) * (3 - len(grid)) + tuple(block) + (1,) * (3 - len(block))
        self.pointer_slots = tuple(pointer_slots)
        self._values = (ctypes.c_int64 * len(parameters))()
        for slot, value in enumerate(parameters):
            if isinstance(value, ctypes.c_float):
                ctypes.c_float.from_buffer(self._values, 8 * slot).value = value.value
            elif isinstance(value, ctypes.c_int32):
                self._values[slot] = value.value
            elif isinstance(value, ctypes.c_uint64):
                ctypes.c_uint64.from_buffer(self._values, 8 * slot).value = value.value
            else:
                self._values[slot] = value
        base = ctypes.addressof(self._values)
        self._addresses = (ctypes.c_void_p * len(parameters))(
            *(base + 8 * slot for slot in range(len(parameters))))
        self._kernel_params = ctypes.addressof(self._addresses)
        self._lock = threading.Lock()

    def __call__(self, stream, pointers):
        """Launch on `stream` (a handle) with the arrays at `pointers`, in argument order."""
        with self._lock:
            for slot, pointer in zip(self.pointer_slots, pointers):
                self._values[slot] = pointer
            _driver_launch(self.function, self.dims, self.shared_bytes, stream,
                           self._kernel_params)


def _driver_launch(function, dims, shared_bytes, stream, kernel_params):
    """cuLaunchKernel; `kernel_params` is the address of the array of parameter addresses."""
    binding = _driver()
    error = binding.cuLaunchKernel(function, *dims, shared_bytes, stream, kernel_params, 0)[0]
    if error != binding.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"kernel launch failed: {error.name} (grid and block {dims}, "
                           f"{shared_bytes} bytes of dynamic shared memory)")


@functools.lru_cache(maxsize=None)
def _driver():
    from numba.cuda.cudadrv.driver import binding
    return binding


_prepared = {}
#: prepared launches kept for the slow path (replays hold their own); past this the oldest goes,
#: so that a loop whose shapes keep changing (a growing KV length) does not grow memory
MAX_PREPARED = 1024


def _signature(arg):
    """What of an argument a prepared launch fixes: all but an array's address."""
    if type(arg) in _SCALARS:
        return type(arg), arg.item()
    if isinstance(arg, tuple):
        return tuple(map(_signature, arg))
    return (arg.dtype, arg.shape, arg.strides)


def prepare(kernel, grid, block, shared_bytes, args, device):
    """The PreparedLaunch of kernel[grid, block, stream, shared_bytes](*args) on `device`
    (cached per argument signature: a training loop repeats its shapes). `args` are
    DeviceViews and scalars (_SCALARS)."""
    key = (kernel, device, grid, block, shared_bytes, *map(_signature, args))
    prepared = _prepared.get(key)
    if prepared is not None:
        return prepared
    arguments, parameters, pointer_slots = _argument(tuple(args))  # (packed as one tuple is)
    argtypes = tuple(arguments.types)
    compiled = _compiled.get((kernel, argtypes, device)) or _compile(kernel, argtypes, device)
    if shared_bytes > compiled.shared_limit[0]:
        _opt_in(compiled, shared_bytes, device)
    grid = grid if isinstance(grid, tuple) else (grid,)
    block = block if isinstance(block, tuple) else (block,)
    prepared = PreparedLaunch(compiled.handle, grid, block, shared_bytes, parameters,
                              pointer_slots)
    with _lock:
        if len(_prepared) >= MAX_PREPARED:
            del _prepared[next(iter(_prepared))]
        return _prepared.setdefault(key, prepared)


#: the unused arguments of launches on host arrays (which are copied to the GPU and back one
#: by one, so a written array passed twice would be copied back stale)
_HOST_UNUSED = np.zeros(1, np.int32)


def scratch_like(like):
    """alloc(shape, dtype) for scratch of launches outside an engine (tests, tools): zeroed
    NumPy arrays if `like` is one (launches copy those), else Numba device arrays (the
    engines allocate scratch as they do their other arrays)."""
    if isinstance(like, np.ndarray):
        return np.zeros
    from numba import cuda
    return cuda.device_array


def kernel_extras_unused(unused):
    """The attention kernels' last four arguments (alibi_slopes, cu_seqlens_q, cu_seqlens_k,
    attn_mask) for a call that has none of them: each takes `unused`, a device array the
    launch passes anyway (the kernels of such a spec never read these arguments), so that no
    array is made for them and a replay finds every address among the call's arrays; for host
    arrays (the simulator, kernel tests) a one-element array instead."""
    if isinstance(unused, np.ndarray):
        unused = _HOST_UNUSED
    return unused, unused, unused, unused


def launch(kernel, grid, block, stream, shared_bytes, *args):
    """kernel[grid, block, stream, shared_bytes](*args) on the current device (the backend
    makes the arrays' device current first: backend.NumbaBackend._on_device).

    `stream` is a stream handle as `__cuda_array_interface__` encodes them (0 or 1: the legacy
    default stream, 2: the per-thread one, else a cudaStream_t) or a Numba stream (under the
    simulator: anything Numba takes); `args` are device arrays (anything `device_view` takes)
    and float32 / int32 / uint64 scalars, or tuples of them. NumPy arrays are copied to the GPU
    and back around the launch, as Numba does (the kernel tests use that; it synchronises). Inside
    `replay.recording()` the launch is noted for a replay."""
    from numba import config
    if config.ENABLE_CUDASIM:
        kernel[grid, block, stream, shared_bytes](*args)
        return
    host = [i for i, arg in enumerate(args) if isinstance(arg, np.ndarray)]
    if host:
        from numba import cuda
        uploaded = [cuda.to_device(arg) if i in host else arg for i, arg in enumerate(args)]
        launch(kernel, grid, block, stream, shared_bytes, *uploaded)
        cuda.synchronize()
        for i in host:
            uploaded[i].copy_to_host(args[i])
        return
    args = [_launch_arg(arg) for arg in args]
    device = current_device()
    if device is None:  # no context yet on this thread: Numba's, on its current device
        from numba import cuda
        device = cuda.get_current_device().id
    prepared = prepare(kernel, grid, block, shared_bytes, args, device)
    pointers = list(_pointers(args))
    prepared(0 if stream is None else int(stream), pointers)  # (a Numba stream gives its handle)
    replay.note_launch(prepared, pointers)
