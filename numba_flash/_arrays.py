"""Array interop: which library an array comes from, its dtype, device and stream.

Everything here works from attributes (`shape`, `dtype`, `__cuda_array_interface__`) and the
type's module name, so that `import numba_flash` needs neither CuPy nor torch.
"""
import contextlib
import functools

import numpy as np

HOST = "numpy"
CUPY = "cupy"
TORCH = "torch"
CUDA = "cuda"  # any other object exposing __cuda_array_interface__ (e.g. Numba device arrays)


@functools.lru_cache(maxsize=None)
def _library_of(array_type):
    """The array library of a type: 'torch' or 'cupy' for theirs and their subclasses (a
    torchvision tensor too), else its top-level package ('numpy', ...). Asked once per type:
    a replayed call asks for every array it touches."""
    packages = [(base.__module__ or "").split(".")[0] for base in array_type.__mro__]
    return next((p for p in packages if p in ("torch", "cupy")), packages[0])


def library(x):
    return _library_of(type(x))


@functools.lru_cache(maxsize=None)
def _kind_of(array_type):
    """array_kind's answer where the type decides it (TORCH: CUDA or CPU, per tensor; None:
    per object, by its __cuda_array_interface__)."""
    if issubclass(array_type, np.ndarray):
        return HOST
    return {"cupy": CUPY, "torch": TORCH}.get(_library_of(array_type))


def array_kind(x):
    """Return HOST, CUPY, TORCH or CUDA for an array, or None if it is not an array we know."""
    kind = _kind_of(type(x))
    if kind == TORCH:
        return TORCH if getattr(x, "is_cuda", False) else HOST
    if kind is None and hasattr(x, "__cuda_array_interface__"):
        return CUDA
    return kind


def is_device_kind(kind):
    return kind in (CUPY, TORCH, CUDA)


def dtype_name(x):
    """The element type as a short name: 'float16', 'float32', 'bfloat16', 'int64', ..."""
    return _dtype_name(x.dtype)


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype):  # (NumPy's dtype.name costs microseconds, and every call asks often)
    if _library_of(type(dtype)) == "torch":
        return str(dtype).replace("torch.", "")
    return np.dtype(dtype).name


def device_id(x):
    """CUDA device ordinal of a device array, None for host arrays."""
    kind = array_kind(x)
    if kind == CUPY:
        return x.data.device_id  # (an int; x.device makes a Device object each call)
    if kind == TORCH:
        return x.get_device()
    if kind == CUDA:
        from numba import cuda
        return int(cuda.get_current_device().id)
    return None


def data_pointer(x):
    """The device address of a device array's first element."""
    return pointer_getter(type(x))(x)


@functools.lru_cache(maxsize=None)
def pointer_getter(array_type):
    """data_pointer for arrays of this type, chosen once (a replay reads its arrays' addresses
    through these on every call)."""
    package = _library_of(array_type)
    if package == "torch":
        return array_type.data_ptr
    if package == "cupy":
        return _cupy_pointer
    return _interface_pointer


def _cupy_pointer(x):
    return x.data.ptr


def _interface_pointer(x):
    return x.__cuda_array_interface__["data"][0]


def as_numpy(x):
    """Host view of a host array (NumPy, or a CPU torch tensor; bfloat16 ones as float32)."""
    if isinstance(x, np.ndarray):
        return x
    if array_kind(x) == HOST and hasattr(x, "numpy"):
        x = x.detach()
        if str(x.dtype) == "torch.bfloat16":  # NumPy has no bfloat16
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def host_like(values, ref, dtype=None):
    """NumPy `values` as a host array of ref's library (NumPy or CPU torch), in `dtype` (a name;
    default ref's dtype)."""
    if library(ref) == "torch":
        import torch
        tensor = torch.from_numpy(np.ascontiguousarray(values))
        return tensor.to(ref.dtype if dtype is None else getattr(torch, dtype))
    return values.astype(ref.dtype if dtype is None else dtype)


def device_copy_like(values, ref):
    """NumPy `values` copied to device array ref's GPU, as an array of ref's library, queued on
    the caller's current stream (caller_stream_handle's, which the launches use) without
    waiting for the work queued before it (the host copy goes through a staging buffer:
    `values` may change as soon as this returns)."""
    kind = array_kind(ref)
    values = np.ascontiguousarray(values)
    if kind == CUPY:
        import cupy
        with _on_cupy_device(ref):
            return cupy.asarray(values)
    if kind == TORCH:
        import torch
        return torch.from_numpy(values).to(ref.device, non_blocking=True)
    from numba import cuda
    with cuda.gpus[device_id(ref)]:  # (a plain to_device would wait on the legacy stream)
        stream = cuda.external_stream(caller_stream_handle(ref) or 1)  # (None: the legacy one)
        return cuda.to_device(values, stream=stream)


def empty_like_kind(ref, shape, dtype):
    """A new uninitialised C-contiguous array of the same library and device as `ref`; dtype is
    a name ('float32', 'bfloat16', ...) or a NumPy dtype."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    package = library(ref)
    if package == "torch":  # CUDA or CPU tensors (first: a replayed call allocates here)
        import torch
        return torch.empty(shape, dtype=getattr(torch, name), device=ref.device)
    if package == "cupy":
        import cupy
        with _on_cupy_device(ref):
            return cupy.empty(shape, name)
    kind = array_kind(ref)
    if kind == HOST:
        return np.empty(shape, name)
    from numba import cuda
    return cuda.device_array(shape, name)


def _on_cupy_device(x):
    """A context on CuPy array x's device: none where it is already the current one (entering
    a cupy.cuda.Device costs microseconds, on the path of every replayed call)."""
    import cupy
    device = x.data.device_id
    if cupy.cuda.runtime.getDevice() == device:
        return contextlib.nullcontext()
    return cupy.cuda.Device(device)


class _InterfaceView:
    """Another shape of an array with __cuda_array_interface__, over the same memory."""

    def __init__(self, base, shape, strides):
        interface = dict(base.__cuda_array_interface__)
        interface.update(shape=shape, strides=strides)
        self.__cuda_array_interface__, self.base = interface, base
        self.shape, self.dtype = shape, np.dtype(interface["typestr"])


def with_batch_axis(x):
    """x with a leading axis of one (a view: the same memory), for any array we know."""
    if array_kind(x) != CUDA:
        return x[None]
    interface = x.__cuda_array_interface__
    shape, itemsize = tuple(interface["shape"]), np.dtype(interface["typestr"]).itemsize
    strides = interface.get("strides") or tuple(
        int(np.prod(shape[i + 1:])) * itemsize for i in range(len(shape)))
    return _InterfaceView(x, (1,) + shape, (0,) + tuple(strides))


@functools.lru_cache(maxsize=None)
def _torch_current_stream():
    """device ordinal -> the raw handle of torch's current stream there, without building a
    torch.cuda.Stream (microseconds per call); the public route where a build lacks it."""
    import torch
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw_stream or (lambda device: torch.cuda.current_stream(device).cuda_stream)


def caller_stream_handle(x):
    """The caller's current stream for this array, as __cuda_array_interface__ encodes streams:
    a cudaStream_t, or 1 / None for the legacy default stream, 2 for the per-thread one."""
    kind = array_kind(x)
    if kind == CUPY:
        import cupy
        with _on_cupy_device(x):  # the stream current on the array's device
            return cupy.cuda.get_current_stream().ptr or 1
    if kind == TORCH:
        return _torch_current_stream()(x.get_device()) or 1
    if kind == CUDA:  # the producer's stream, if the interface names one
        return x.__cuda_array_interface__.get("stream")
    return None


def detached(x):
    """torch tensors that require grad refuse to export their memory; the kernels only read it."""
    return x.detach() if library(x) == "torch" else x


def convert_like(x, ref):
    """Return x (an array of any library) as the library and device of `ref`, without copying
    when the library already matches (DLPack / __cuda_array_interface__ are zero-copy)."""
    if type(x) is type(ref) and (_kind_of(type(x)) != TORCH or x.is_cuda == ref.is_cuda):
        return x  # (a replayed call's results: the usual case, first)
    kind = array_kind(ref)
    if array_kind(x) == kind and library(x) == library(ref):  # (subclasses: nn.Parameter)
        return x
    if kind == HOST:
        if library(ref) == "torch":  # a CPU torch tensor in, one out
            import torch
            return torch.from_numpy(np.ascontiguousarray(as_numpy(x)))
        return as_numpy(x)
    if kind == CUPY:
        import cupy
        return cupy.asarray(x)
    if kind == TORCH:
        import torch
        return torch.from_dlpack(x)
    from numba import cuda
    return cuda.as_cuda_array(x)
