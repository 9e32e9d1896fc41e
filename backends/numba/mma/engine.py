"""The tensor-core engine: mma.sync kernels for float16 and bfloat16 on compute capability 8.0
and newer, head dims up to 256 (run padded to a multiple of 16, of 32 above 128).

Under the simulator the kernels run through the intrinsics' Python twins, slowly: only an
engine made with run_in_simulator=True (the "numba-mma" backend's) takes calls there.
"""
from numba_flash import _arrays

from .. import marshal
from ..engine import Engine
from ..gpu import TENSOR_CORE_CC, compute_capability, simulator_enabled
from ..tile_classes import call_tiles
from .bwd import launch_mma_backward
from .config import mma_head_dim
from .fwd import launch_mma_forward

DTYPES = ("float16", "bfloat16")


class MmaEngine(Engine):
    name = "tensor cores"

    def __init__(self, run_in_simulator=False):
        self.run_in_simulator = run_in_simulator

    def reason(self, spec, q, k, v):
        if spec.dtype not in DTYPES:
            return f"the tensor-core kernels take float16 or bfloat16, not {spec.dtype}"
        if mma_head_dim(spec.head_dim) is None:
            return f"the tensor-core kernels cover headdim <= 256, not {spec.head_dim}"
        if simulator_enabled():
            if not self.run_in_simulator:
                return ("under the CUDA simulator only backend 'numba-mma' runs the tensor-core "
                        "kernels")
            return None
        cc = compute_capability(_arrays.device_id(q))
        if cc < TENSOR_CORE_CC:
            return (f"the tensor-core kernels need compute capability "
                    f"{TENSOR_CORE_CC[0]}.{TENSOR_CORE_CC[1]} or newer; this GPU has "
                    f"{cc[0]}.{cc[1]}")
        return None

    def forward(self, spec, q, k, v, out, lse, alloc, stream, extras):
        head_dim = mma_head_dim(spec.head_dim)
        inputs = [marshal.tile_ready_input(x, alloc, head_dim, stream, bits=True)
                  for x in (q, k, v)]
        out_view, out_final = marshal.tile_ready_output(out, alloc, head_dim)
        lse_view = marshal.view(lse)
        kernel_extras = marshal.kernel_extras(spec, extras, *inputs[:2], lse_view)
        launch_mma_forward(spec, *inputs, out_view, lse_view, stream, extras=kernel_extras,
                           tiles=call_tiles(spec, extras, kernel_extras, *inputs[:2], alloc,
                                            stream))
        if out_final is not None:
            marshal.copy_padded(out_view, out_final, stream)

    def backward(self, spec, dout, q, k, v, out, lse, delta, grads, alloc, stream, extras):
        head_dim = mma_head_dim(spec.head_dim)
        inputs = [marshal.tile_ready_input(x, alloc, head_dim, stream, bits=True)
                  for x in (dout, q, k, v, out)]
        outputs = [marshal.tile_ready_output(g, alloc, head_dim) for g in grads]
        lse_view = marshal.view(lse)
        kernel_extras = marshal.kernel_extras(spec, extras, *inputs[1:3], lse_view)
        launch_mma_backward(spec, *inputs, lse_view, marshal.view(delta),
                            *(kernel_view for kernel_view, _ in outputs), stream,
                            extras=kernel_extras,
                            tiles=call_tiles(spec, extras, kernel_extras, *inputs[1:3], alloc,
                                             stream))
        for kernel_view, final in outputs:
            if final is not None:
                marshal.copy_padded(kernel_view, final, stream)
