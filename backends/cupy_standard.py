"""CuPy backend: standard attention on the GPU, materialising the full score matrix.

This is the baseline FlashAttention is measured against: cuBLAS matmuls and element-wise
softmax in the input precision, with O(N²) memory per head. It refuses calls whose score
matrices would not fit in the free device memory, saying how much they would need.
"""
from numba_flash import _arrays
from numba_flash.backends.base import Backend
from numba_flash.extras import NO_EXTRAS
from numba_flash.reference import attention_backward, attention_forward
from numba_flash.reference_kvcache import append, attention_forward_kvcache

# Peak number of (batch, nheads, seqlen_q, seqlen_k) temporaries alive at once (scores, the
# masked/shifted copy, P, and dS in the backward), used for the memory estimate.
SCORE_COPIES = 4


def _cupy():
    import cupy
    return cupy


class CupyStandardBackend(Backend):
    name = "cupy"
    dtypes = ("float16", "float32", "float64")

    def available(self):
        """None if CuPy can run here, else the reason."""
        try:
            cupy = _cupy()
        except ImportError:
            return "CuPy is not installed (pip install 'numba-flash[cupy]')"
        try:
            if cupy.cuda.runtime.getDeviceCount() < 1:
                return "CuPy found no CUDA GPU"
        except Exception as exc:  # CuPy raises its own CUDARuntimeError without a driver
            return f"CuPy cannot reach a CUDA GPU ({exc})"
        return None

    def score_bytes(self, spec, q, k):
        """Bytes of the score temporaries (varlen: of the longest sequences, one at a time)."""
        itemsize = 8 if _arrays.dtype_name(q) == "float64" else 4
        if spec.varlen:
            return (SCORE_COPIES * int(q.shape[1]) * spec.max_seqlen_q * spec.max_seqlen_k
                    * itemsize)
        batch, seqlen_q, nheads, _ = (int(s) for s in q.shape)
        return SCORE_COPIES * batch * nheads * seqlen_q * int(k.shape[1]) * itemsize

    def _takes(self, q):
        """None if CuPy runs here and takes q's kind of array and dtype, else why not."""
        reason = self.available()
        if reason:
            return reason
        if _arrays.array_kind(q) not in (_arrays.CUPY, _arrays.TORCH, _arrays.CUDA):
            return "it runs on the GPU and takes device arrays (CuPy, torch, Numba) only"
        if _arrays.dtype_name(q) not in self.dtypes:
            return f"dtype {_arrays.dtype_name(q)} is not supported (it supports {self.dtypes})"
        return None

    def supports(self, spec, q, k, v):
        reason = self._takes(q)
        if reason:
            return reason
        need = self.score_bytes(spec, q, k)
        free = _cupy().cuda.Device(_arrays.device_id(q)).mem_info[0]
        if need > free:
            return (f"standard attention would need {need / 2**30:.1f} GiB for the "
                    f"seqlen_q x seqlen_k score matrices, but only {free / 2**30:.1f} GiB is free")
        return None

    def _compute_dtype(self, q):
        return "float64" if _arrays.dtype_name(q) == "float64" else _arrays.dtype_name(q)

    def forward(self, spec, q, k, v, extras=NO_EXTRAS):
        cupy = _cupy()
        dtype = self._compute_dtype(q)
        with cupy.cuda.Device(_arrays.device_id(q)):
            q, k, v = (cupy.asarray(_arrays.detached(x)) for x in (q, k, v))
            out, lse = attention_forward(cupy, q, k, v, spec, dtype, _on_gpu(cupy, extras))
            return cupy.ascontiguousarray(out), lse.astype(cupy.float32)

    def backward(self, spec, dout, q, k, v, out, lse, extras=NO_EXTRAS):
        cupy = _cupy()
        dtype = self._compute_dtype(q)
        with cupy.cuda.Device(_arrays.device_id(q)):
            arrays = [cupy.asarray(_arrays.detached(x)) for x in (dout, q, k, v, out, lse)]
            grads = attention_backward(cupy, *arrays, spec, dtype, _on_gpu(cupy, extras))
            return tuple(cupy.ascontiguousarray(g) for g in grads)

    def supports_kvcache(self, spec, q, k_cache):
        return self._takes(q)

    def forward_kvcache(self, spec, q, cache, extras=NO_EXTRAS):
        """One sequence at a time: scores of (nheads, seqlen_q, seqlen_k) per sequence."""
        cupy = _cupy()
        with cupy.cuda.Device(_arrays.device_id(q)):
            arrays = [cupy.asarray(_arrays.detached(x)) for x in (q, cache.k_cache, cache.v_cache)]
            new = [None if x is None else cupy.asarray(_arrays.detached(x))
                   for x in (cache.k_new, cache.v_new)]
            cache = cache._replace(k_cache=arrays[1], v_cache=arrays[2], k_new=new[0],
                                   v_new=new[1])
            append(cache)
            out, lse = attention_forward_kvcache(cupy, *arrays, cache, spec,
                                                 self._compute_dtype(q), _on_gpu(cupy, extras))
            return cupy.ascontiguousarray(out), lse.astype(cupy.float32)


def _on_gpu(cupy, extras):
    return extras.with_arrays([cupy.asarray(_arrays.detached(x)) for x in extras.arrays()])
