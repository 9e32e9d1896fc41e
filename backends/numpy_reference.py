"""NumPy reference backend: standard attention in float64 on the CPU.

It is the truth every other backend is checked against. Results come back in the input dtype
(lse in float32, as the API promises); the tests call numba_flash.reference directly
when they want the float64 values themselves.
"""
import numpy as np

from numba_flash import _arrays
from numba_flash.backends.base import Backend
from numba_flash.extras import NO_EXTRAS
from numba_flash.reference import attention_backward, attention_forward
from numba_flash.reference_kvcache import append, attention_forward_kvcache


class NumpyReferenceBackend(Backend):
    name = "numpy"
    dtypes = ("float16", "bfloat16", "float32", "float64")

    def supports(self, spec, q, k, v):
        if _arrays.array_kind(q) != _arrays.HOST:
            return "it runs on the CPU and takes host arrays (NumPy, CPU torch tensors) only"
        if _arrays.dtype_name(q) not in self.dtypes:
            return f"dtype {_arrays.dtype_name(q)} is not supported (it supports {self.dtypes})"
        return None

    def forward(self, spec, q, k, v, extras=NO_EXTRAS):
        arrays = [_arrays.as_numpy(x) for x in (q, k, v)]
        out, lse = attention_forward(np, *arrays, spec, np.float64, _host(extras))
        return _arrays.host_like(out, q), _arrays.host_like(lse, q, "float32")

    def backward(self, spec, dout, q, k, v, out, lse, extras=NO_EXTRAS):
        arrays = [_arrays.as_numpy(x) for x in (dout, q, k, v, out, lse)]
        grads = attention_backward(np, *arrays, spec, np.float64, _host(extras))
        return tuple(_arrays.host_like(g, x) for g, x in zip(grads, (q, k, v)))

    def supports_kvcache(self, spec, q, k_cache):
        return self.supports(spec, q, k_cache, k_cache)

    def forward_kvcache(self, spec, q, cache, extras=NO_EXTRAS):
        append(cache)
        arrays = [_arrays.as_numpy(x) for x in (q, cache.k_cache, cache.v_cache)]
        out, lse = attention_forward_kvcache(np, *arrays, cache, spec, np.float64, _host(extras))
        return _arrays.host_like(out, q), _arrays.host_like(lse, q, "float32")


def _host(extras):
    return extras.with_arrays([_arrays.as_numpy(x) for x in extras.arrays()])
