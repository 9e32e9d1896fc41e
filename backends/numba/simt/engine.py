"""The SIMT engine: the CUDA-core kernels (float32 arithmetic) for float32, float16 and, on
sm_80 and newer, bfloat16, head dims up to 256, on any CUDA GPU and under the simulator."""
from numba_flash import _arrays

from .. import marshal
from ..engine import Engine
from ..gpu import (SHARED_MEMORY_BYTES, TENSOR_CORE_CC, compute_capability, shared_memory_limit,
                   simulator_enabled)
from ..tile_classes import call_tiles
from .bwd import launch_backward
from .fwd import launch_forward

DTYPES = ("float16", "bfloat16", "float32")


class SimtEngine(Engine):
    name = "SIMT"

    def reason(self, spec, q, k, v):
        if spec.dtype not in DTYPES:
            return f"the SIMT kernels take float16, bfloat16 or float32, not {spec.dtype}"
        if spec.bf16 and not simulator_enabled():
            cc = compute_capability(_arrays.device_id(q))
            if cc < TENSOR_CORE_CC:  # rounding to bfloat16 (cvt.rn.bf16x2) is sm_80 and newer
                return (f"bfloat16 needs compute capability {TENSOR_CORE_CC[0]}."
                        f"{TENSOR_CORE_CC[1]} or newer; this GPU has {cc[0]}.{cc[1]}")
        return None

    def _loads(self, spec, q):
        """(async_copy, shared_limit) for q's call: float32 inputs with rows of a multiple of 4
        floats are read by cp.async on sm_80 and newer (2-3x faster than plain loads; views
        whose rows are not 16-byte aligned are copied first); tiles are sized to the GPU's
        shared memory per block (48 KiB under the simulator, to keep simulated tiles small)."""
        if simulator_enabled():
            async_capable, shared_limit = True, SHARED_MEMORY_BYTES
        else:
            device = _arrays.device_id(q)
            async_capable = compute_capability(device) >= TENSOR_CORE_CC
            shared_limit = shared_memory_limit(device)
        return async_capable and spec.dtype == "float32" and spec.head_dim % 4 == 0, shared_limit

    def _inputs(self, spec, arrays, async_copy, alloc, stream):
        """The kernels' views of their tile inputs: cp.async-ready (aligned copies where
        needed) with async_copy, else as they are (bfloat16 as bit patterns)."""
        if async_copy:
            return [marshal.tile_ready_input(x, alloc, spec.head_dim, stream) for x in arrays]
        return [marshal.view(x, spec.bf16) for x in arrays]

    def forward(self, spec, q, k, v, out, lse, alloc, stream, extras):
        async_copy, shared_limit = self._loads(spec, q)
        inputs = self._inputs(spec, (q, k, v), async_copy, alloc, stream)
        lse_view = marshal.view(lse)
        kernel_extras = marshal.kernel_extras(spec, extras, *inputs[:2], lse_view)
        launch_forward(spec, *inputs, marshal.view(out, spec.bf16), lse_view, stream,
                       async_copy=async_copy, shared_limit=shared_limit, extras=kernel_extras,
                       tiles=call_tiles(spec, extras, kernel_extras, *inputs[:2], alloc, stream))

    def backward(self, spec, dout, q, k, v, out, lse, delta, grads, alloc, stream, extras):
        async_copy, shared_limit = self._loads(spec, q)
        dout, q, k, v = self._inputs(spec, (dout, q, k, v), async_copy, alloc, stream)
        views = ([marshal.view(out, spec.bf16), marshal.view(lse), marshal.view(delta)]
                 + [marshal.view(g, spec.bf16) for g in grads])
        kernel_extras = marshal.kernel_extras(spec, extras, q, k, views[1])
        launch_backward(spec, dout, q, k, v, *views, stream, async_copy=async_copy,
                        shared_limit=shared_limit, extras=kernel_extras,
                        tiles=call_tiles(spec, extras, kernel_extras, q, k, alloc, stream))
