"""The "numba" backend: FlashAttention kernels written as Numba CUDA kernels.

It takes device arrays (CuPy, torch, Numba, anything with __cuda_array_interface__) and
launches on the caller's current stream. Under Numba's CUDA simulator
(NUMBA_ENABLE_CUDASIM=1, for machines without a GPU) it takes NumPy arrays instead.
Numba is imported only when the backend is first used.
"""
import contextlib
import warnings

import numpy as np

from numba_flash import _arrays
from numba_flash.backend_base import Backend


def simulator_enabled():
    from numba import config
    return bool(config.ENABLE_CUDASIM)


class NumbaBackend(Backend):
    name = "numba"
    dtypes = ("float16", "float32")

    def available(self):
        """None if the kernels can run here (a CUDA GPU, or the simulator), else the reason."""
        if simulator_enabled():
            return None
        from numba import cuda
        if not cuda.is_available():
            return ("Numba found no usable CUDA GPU (set NUMBA_ENABLE_CUDASIM=1 before importing "
                    "numba to run the kernels in Numba's CUDA simulator)")
        return None

    def supports(self, q, k, v, *, causal=False, softmax_scale=None):
        reason = self.available()
        if reason:
            return reason
        dtype = _arrays.dtype_name(q)
        if dtype not in self.dtypes:
            return f"dtype {dtype} is not supported (it supports {', '.join(self.dtypes)})"
        kind = _arrays.array_kind(q)
        if simulator_enabled():
            if kind != _arrays.HOST:
                return "under the CUDA simulator it takes host (NumPy) arrays only"
        elif not _arrays.is_device_kind(kind):
            return ("it runs on the GPU and takes device arrays (CuPy, torch, Numba); got host "
                    "arrays: copy them to the GPU first, e.g. cupy.asarray(q)")
        return None

    @staticmethod
    @contextlib.contextmanager
    def _quiet_launch():
        """Numba warns about grids smaller than the GPU; for small inputs that is expected."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*will likely result in GPU "
                                                      "under-utilization")
            yield

    # -- launching -----------------------------------------------------------------------------

    def _prepare(self, ref, arrays):
        """(stream, kernel views of arrays) for a launch on the caller's current stream."""
        if simulator_enabled():
            return 0, [np.ascontiguousarray(_arrays.as_numpy(x)) for x in arrays]
        from numba import cuda
        handle = _arrays.caller_stream_handle(ref)
        if handle in (None, 1):
            stream = cuda.legacy_default_stream()
        elif handle == 2:
            stream = cuda.per_thread_default_stream()
        else:
            stream = cuda.external_stream(handle)
        # sync=False: the caller's stream already orders the producer of these arrays before us.
        return stream, [cuda.as_cuda_array(_arrays.detached(x), sync=False) for x in arrays]

    def _on_device(self, ref):
        """Numba's current device set to the arrays' GPU for the allocations and launches."""
        if simulator_enabled():
            return contextlib.nullcontext()
        from numba import cuda
        return cuda.gpus[_arrays.device_id(ref)]

    def _new(self, ref, shape, dtype):
        """A new output array like ref's (C-contiguous, so _prepare hands the kernels the array
        itself)."""
        if simulator_enabled():
            return np.empty(shape, dtype)
        return _arrays.empty_like_kind(ref, shape, dtype)

    def forward(self, q, k, v, *, causal, softmax_scale):
        from .numba_simt_fwd import launch_forward
        batch, seqlen_q, nheads, _ = (int(s) for s in q.shape)
        with self._on_device(q):
            out = self._new(q, tuple(int(s) for s in q.shape), _arrays.dtype_name(q))
            lse = self._new(q, (batch, nheads, seqlen_q), np.float32)
            stream, (qv, kv, vv, outv, lsev) = self._prepare(q, [q, k, v, out, lse])
            with self._quiet_launch():
                launch_forward(qv, kv, vv, outv, lsev, causal, softmax_scale, stream)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, causal, softmax_scale):
        from .numba_simt_bwd import launch_backward
        batch, seqlen_q, nheads, _ = (int(s) for s in q.shape)
        dtype = _arrays.dtype_name(q)
        with self._on_device(q):
            grads = [self._new(q, tuple(int(s) for s in x.shape), dtype) for x in (q, k, v)]
            delta = self._new(q, (batch, nheads, seqlen_q), np.float32)
            stream, views = self._prepare(q, [dout, q, k, v, out, lse, delta] + grads)
            with self._quiet_launch():
                launch_backward(*views, causal, softmax_scale, stream)
        return tuple(grads)
