"""The Numba backends: FlashAttention kernels written as Numba CUDA kernels.

Two kernel families ("engines") serve them:
  - tensor cores (backends/numba_mma_*.py): float16 and bfloat16 on GPUs of compute capability
    8.0 or newer, head dims up to 256 (padded to a multiple of 16, of 32 above 128);
  - SIMT (backends/numba_simt_*.py): float32 and float16 on any GPU, bfloat16 on sm_80 and
    newer, head dims up to 256 (float32 arithmetic throughout).
"numba" picks the first engine that can run a call, in that order; "numba-mma" and
"numba-simt" use one engine only (for comparisons, benchmarks and tests).

They take device arrays (CuPy, torch, Numba, anything with __cuda_array_interface__) and launch
on the caller's current stream. Under Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, for
machines without a GPU) they take host arrays (NumPy, or CPU torch tensors for bfloat16)
instead; there "numba" uses SIMT only, and "numba-mma" runs the tensor-core kernels through
the intrinsics' Python twins. Numba is imported only when a backend is first used.
"""
import contextlib
import functools

import numpy as np

from numba_flash import _arrays
from numba_flash.backend_base import Backend
from numba_flash.config import SHARED_MEMORY_BYTES, mma_backward_config, mma_forward_config

from . import numba_replay
from .numba_launch import DeviceView, device_view, on_device

MMA = "tensor cores"
SIMT = "SIMT"
SIXTEEN_BIT = ("float16", "bfloat16")
#: compute capability of the first GPUs with bf16 mma.sync, ldmatrix and cp.async
TENSOR_CORE_CC = (8, 0)


def simulator_enabled():
    from numba import config
    return bool(config.ENABLE_CUDASIM)


@functools.lru_cache(maxsize=None)
def compute_capability(device_id):
    from numba import cuda
    with cuda.gpus[device_id]:
        return tuple(cuda.get_current_device().compute_capability)


@functools.lru_cache(maxsize=None)
def shared_memory_limit(device_id):
    """The most shared memory a block may take on this GPU (opting in above 48 KiB)."""
    from numba import cuda
    with cuda.gpus[device_id]:
        return int(cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)


def mma_head_dim(head_dim):
    """The head dim the tensor-core kernels run head_dim at (the next multiple of 16 for which
    the forward and the backward have a config: of 32 above 128, where the backward splits the
    head dim in two), or None if there is none."""
    for padded in range(-(-head_dim // 16) * 16, head_dim + 32, 16):
        if mma_forward_config(padded) and mma_backward_config(padded):
            return padded
    return None


def is_tile_ready(view, head_dim):
    """True if cp.async can copy this view's rows (the tensor-core kernels' 16-bit views, the
    SIMT kernels' float32 ones): head_dim columns, unit stride along them and every row
    starting 16-byte aligned (cp.async copies 16 B)."""
    if int(view.shape[3]) != head_dim or int(view.strides[3]) != view.dtype.itemsize:
        return False
    pointer = view.ptr if isinstance(view, DeviceView) else view.ctypes.data
    return pointer % 16 == 0 and all(int(s) % 16 == 0 for s in view.strides[:3])


class NumbaBackend(Backend):
    name = "numba"
    dtypes = ("float16", "bfloat16", "float32")
    #: the engines this backend may use, in order of preference
    engines = (MMA, SIMT)
    #: whether the tensor-core kernels run under the simulator (slow; "numba-mma" only)
    simulate_tensor_cores = False

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
        engine, reason = self.engine(q)
        return reason

    # -- which kernels -------------------------------------------------------------------------

    def _tensor_cores_reason(self, q):
        """None if the tensor-core kernels can run q's call, else why not."""
        dtype = _arrays.dtype_name(q)
        head_dim = int(q.shape[3])
        if dtype not in SIXTEEN_BIT:
            return f"the tensor-core kernels take float16 or bfloat16, not {dtype}"
        if mma_head_dim(head_dim) is None:
            return f"the tensor-core kernels cover headdim <= 256, not {head_dim}"
        if simulator_enabled():
            if not self.simulate_tensor_cores:
                return ("under the CUDA simulator only backend 'numba-mma' runs the tensor-core "
                        "kernels")
            return None
        cc = compute_capability(_arrays.device_id(q))
        if cc < TENSOR_CORE_CC:
            return (f"the tensor-core kernels need compute capability "
                    f"{TENSOR_CORE_CC[0]}.{TENSOR_CORE_CC[1]} or newer; this GPU has "
                    f"{cc[0]}.{cc[1]}")
        return None

    def _simt_reason(self, q):
        dtype = _arrays.dtype_name(q)
        if dtype not in ("float16", "bfloat16", "float32"):
            return f"the SIMT kernels take float16, bfloat16 or float32, not {dtype}"
        if dtype == "bfloat16" and not simulator_enabled():
            cc = compute_capability(_arrays.device_id(q))
            if cc < TENSOR_CORE_CC:  # rounding to bfloat16 (cvt.rn.bf16x2) is sm_80 and newer
                return (f"bfloat16 needs compute capability {TENSOR_CORE_CC[0]}."
                        f"{TENSOR_CORE_CC[1]} or newer; this GPU has {cc[0]}.{cc[1]}")
        return None

    def engine(self, q):
        """(engine, None) for the first engine that can run q's call, else (None, reasons)."""
        reasons = []
        for engine in self.engines:
            reason = (self._tensor_cores_reason if engine == MMA else self._simt_reason)(q)
            if reason is None:
                return engine, None
            reasons.append(reason)
        return None, "; ".join(reasons)

    # -- launching (backends/numba_launch.py) -------------------------------------------------

    def _stream(self, ref):
        """The caller's current stream for a launch, as a handle (0 under the simulator)."""
        if simulator_enabled():
            return 0
        handle = _arrays.caller_stream_handle(ref)
        return 1 if handle is None else handle  # None: the legacy default stream

    def _view(self, x, bits=False):
        """The kernels' view of x, sharing its memory: a DeviceView on the GPU, a NumPy array
        under the simulator; with bits=True, its 16-bit patterns as uint16."""
        if type(x).__module__.startswith("torch"):
            x = x.detach()
            if bits:
                import torch
                x = x.view(torch.int16)  # NumPy has no bfloat16
        if simulator_enabled():  # the simulator copies its arguments, so only whole buffers
            view = np.ascontiguousarray(_arrays.as_numpy(x))
        else:
            view = device_view(x)
        return view.view(np.uint16) if bits else view

    def _on_device(self, ref):
        """The arrays' GPU made current for the allocations and launches."""
        if simulator_enabled():
            return contextlib.nullcontext()
        return on_device(_arrays.device_id(ref))

    def _new(self, ref, shape, dtype):
        """A new C-contiguous array of ref's library and device (outputs and scratch)."""
        array = _arrays.empty_like_kind(ref, shape, dtype)
        numba_replay.note_allocation(shape, dtype, array)
        return array

    # -- replays of repeated calls (backends/numba_replay.py, numba_flash/call_cache.py) --------

    def forward_and_replay(self, q, k, v, *, causal, softmax_scale):
        with numba_replay.recording() as record:
            result, fallback = super().forward_and_replay(q, k, v, causal=causal,
                                                          softmax_scale=softmax_scale)
        return result, numba_replay.build_replay(self, record, (q, k, v), result) or fallback

    def backward_and_replay(self, dout, q, k, v, out, lse, *, causal, softmax_scale):
        inputs = (dout, q, k, v, out, lse)
        with numba_replay.recording() as record:
            result, fallback = super().backward_and_replay(*inputs, causal=causal,
                                                           softmax_scale=softmax_scale)
        return result, (numba_replay.build_replay(self, record, inputs, result, ref=1)  # q
                        or fallback)

    def forward(self, q, k, v, *, causal, softmax_scale):
        batch, seqlen_q, nheads, _ = (int(s) for s in q.shape)
        dtype = _arrays.dtype_name(q)
        engine, reason = self.engine(q)
        if engine is None:
            raise ValueError(f"backend {self.name!r} cannot run this call: {reason}")
        with self._on_device(q):
            out = self._new(q, tuple(int(s) for s in q.shape), dtype)
            lse = self._new(q, (batch, nheads, seqlen_q), "float32")
            stream = self._stream(q)
            if engine == MMA:
                self._mma_forward(q, k, v, out, lse, causal, softmax_scale, stream)
            else:
                self._simt_forward(q, k, v, out, lse, causal, softmax_scale, stream)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, causal, softmax_scale):
        batch, seqlen_q, nheads, _ = (int(s) for s in q.shape)
        dtype = _arrays.dtype_name(q)
        engine, reason = self.engine(q)
        if engine is None:
            raise ValueError(f"backend {self.name!r} cannot run this call: {reason}")
        with self._on_device(q):
            grads = [self._new(q, tuple(int(s) for s in x.shape), dtype) for x in (q, k, v)]
            delta = self._new(q, (batch, nheads, seqlen_q), "float32")
            stream = self._stream(q)
            if engine == MMA:
                self._mma_backward(dout, q, k, v, out, lse, delta, grads, causal, softmax_scale,
                                   stream)
            else:
                self._simt_backward(dout, q, k, v, out, lse, delta, grads, causal,
                                    softmax_scale, stream)
        return tuple(grads)

    # -- inputs for cp.async (both engines) -----------------------------------------------------

    def _cp_async_input(self, x, ref, head_dim, stream, bits=False):
        """x's view (with bits, of its 16-bit patterns) if cp.async can read it in place (see
        is_tile_ready), else an aligned copy, zero-padded to head_dim columns."""
        from .numba_copy import copy_padded
        view = self._view(x, bits=bits)
        if is_tile_ready(view, head_dim):
            return view
        shape = tuple(int(s) for s in x.shape[:3]) + (head_dim,)
        copy = self._view(self._new(ref, shape, "int16" if bits else view.dtype.name),
                          bits=bits)
        copy_padded(view, copy, stream)
        return copy

    # -- the SIMT engine ------------------------------------------------------------------------

    def _simt_loads(self, q):
        """(async_copy, shared_limit) of the SIMT kernels for q's call: float32 inputs with
        rows of a multiple of 4 floats are read by cp.async on sm_80 and newer (2-3x faster
        than plain loads: docs/tune_simt_2026-11-30.log; misaligned views are copied first);
        tiles are sized to the GPU's shared memory per block (48 KiB under the simulator, to
        keep CI's simulated tiles small)."""
        if simulator_enabled():
            async_capable, shared_limit = True, SHARED_MEMORY_BYTES
        else:
            device = _arrays.device_id(q)
            async_capable = compute_capability(device) >= TENSOR_CORE_CC
            shared_limit = shared_memory_limit(device)
        async_copy = (async_capable and _arrays.dtype_name(q) == "float32"
                      and int(q.shape[3]) % 4 == 0)
        return async_copy, shared_limit

    def _simt_inputs(self, arrays, q, async_copy, stream):
        """The SIMT kernels' views of their tile inputs: cp.async-ready (aligned copies where
        needed) with async_copy, else as they are (bfloat16 as bit patterns)."""
        if async_copy:
            return [self._cp_async_input(x, q, int(q.shape[3]), stream) for x in arrays]
        return [self._view(x, _arrays.dtype_name(q) == "bfloat16") for x in arrays]

    def _simt_forward(self, q, k, v, out, lse, causal, softmax_scale, stream):
        from .numba_simt_fwd import launch_forward
        bf16 = _arrays.dtype_name(q) == "bfloat16"  # passed as bit patterns
        async_copy, shared_limit = self._simt_loads(q)
        inputs = self._simt_inputs((q, k, v), q, async_copy, stream)
        launch_forward(*inputs, self._view(out, bf16), self._view(lse), causal, softmax_scale,
                       stream, bf16=bf16, async_copy=async_copy, shared_limit=shared_limit)

    def _simt_backward(self, dout, q, k, v, out, lse, delta, grads, causal, softmax_scale,
                       stream):
        from .numba_simt_bwd import launch_backward
        bf16 = _arrays.dtype_name(q) == "bfloat16"  # passed as bit patterns
        async_copy, shared_limit = self._simt_loads(q)
        inputs = self._simt_inputs((dout, q, k, v), q, async_copy, stream)
        views = ([self._view(out, bf16), self._view(lse), self._view(delta)]
                 + [self._view(g, bf16) for g in grads])
        launch_backward(*inputs, *views, causal, softmax_scale, stream, bf16=bf16,
                        async_copy=async_copy, shared_limit=shared_limit)

    # -- the tensor-core engine: 16-bit views, padded copies where needed ------------------------

    def _mma_output(self, x, ref, head_dim):
        """(kernel view, the copy to make into x afterwards or None) for an output array."""
        view = self._view(x, bits=True)
        if is_tile_ready(view, head_dim):
            return view, None
        shape = tuple(int(s) for s in x.shape[:3]) + (head_dim,)
        return self._view(self._new(ref, shape, "int16"), bits=True), view

    def _mma_forward(self, q, k, v, out, lse, causal, softmax_scale, stream):
        from .numba_copy import copy_padded
        from .numba_mma_fwd import launch_mma_forward
        head_dim = mma_head_dim(int(q.shape[3]))
        qv, kv, vv = (self._cp_async_input(x, q, head_dim, stream, bits=True)
                      for x in (q, k, v))
        out_view, out_final = self._mma_output(out, q, head_dim)
        launch_mma_forward(qv, kv, vv, out_view, self._view(lse), causal, softmax_scale,
                           _arrays.dtype_name(q) == "bfloat16", stream)
        if out_final is not None:
            copy_padded(out_view, out_final, stream)

    def _mma_backward(self, dout, q, k, v, out, lse, delta, grads, causal, softmax_scale,
                      stream):
        from .numba_copy import copy_padded
        from .numba_mma_bwd import launch_mma_backward
        head_dim = mma_head_dim(int(q.shape[3]))
        inputs = [self._cp_async_input(x, q, head_dim, stream, bits=True)
                  for x in (dout, q, k, v, out)]
        outputs = [self._mma_output(g, q, head_dim) for g in grads]
        launch_mma_backward(*inputs, self._view(lse), self._view(delta),
                            *(view for view, _ in outputs), causal, softmax_scale,
                            _arrays.dtype_name(q) == "bfloat16", stream)
        for view, final in outputs:
            if final is not None:
                copy_padded(view, final, stream)


class NumbaMmaBackend(NumbaBackend):
    name = "numba-mma"
    dtypes = SIXTEEN_BIT
    engines = (MMA,)
    simulate_tensor_cores = True


class NumbaSimtBackend(NumbaBackend):
    name = "numba-simt"
    dtypes = ("float16", "bfloat16", "float32")
    engines = (SIMT,)
