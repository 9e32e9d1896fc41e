"""The Hopper engine: wgmma kernels for float16 and bfloat16 on compute capability 9.0 (sm_90a),
head dims up to 256 (run padded to 64, 128 or 256), up to 128 with an attn_mask or a mask_mod
(config.py: their tiles would be too small above).

Its forward is the Hopper forward (fwd.py), on 128-key tiles for a mask_mod where they
compile without local memory (key_tiles.py). Its backward is the Hopper backward (bwd.py:
head dims up to 128), and for larger head dims another engine's: the backend hands it one
(the tensor-core engine's mma.sync kernels, which read the same out and lse).

Under the simulator the kernels run through the intrinsics' Python twins, slowly: only an
engine made with run_in_simulator=True (the "numba-hopper" backend's) takes calls there.
"""
from numba_flash import _arrays

from .. import marshal
from ..engine import Engine
from ..gpu import compute_capability, multiprocessors, simulator_enabled
from ..tile_classes import call_tiles
from .bwd import launch_hopper_backward
from .config import hopper_backward_config, hopper_forward_config
from .fwd import launch_hopper_forward
from .key_tiles import mask_mod_forward_config
from .tensor_maps import map_slot_shape

DTYPES = ("float16", "bfloat16")
HOPPER_CC = (9, 0)


def hopper_head_dim(head_dim):
    """The head dim the Hopper kernels run head_dim at (64, 128 or 256), or None above 256."""
    for padded in (64, 128, 256):
        if head_dim <= padded:
            return padded
    return None


class HopperEngine(Engine):
    name = "Hopper (wgmma)"

    def __init__(self, backward_engine, run_in_simulator=False):
        self.backward_engine = backward_engine
        self.run_in_simulator = run_in_simulator

    def reason(self, spec, q, k, v):
        if spec.dtype not in DTYPES:
            return f"the Hopper kernels take float16 or bfloat16, not {spec.dtype}"
        head_dim = hopper_head_dim(spec.head_dim)
        if head_dim is None:
            return f"the Hopper kernels cover headdim <= 256, not {spec.head_dim}"
        if hopper_forward_config(head_dim, spec) is None:
            return (f"the Hopper kernels take an attn_mask or a mask_mod up to headdim 128, "
                    f"not {spec.head_dim}")
        if simulator_enabled():
            if not self.run_in_simulator:
                return ("under the CUDA simulator only backend 'numba-hopper' runs the Hopper "
                        "kernels")
        else:
            cc = compute_capability(_arrays.device_id(q))
            if cc != HOPPER_CC:
                return (f"the Hopper kernels (wgmma, sm_90a) need compute capability 9.0; this "
                        f"GPU has {cc[0]}.{cc[1]}")
        return self.backward_engine.reason(spec, q, k, v)

    def forward(self, spec, q, k, v, out, lse, alloc, stream, extras):
        head_dim = hopper_head_dim(spec.head_dim)
        inputs = [marshal.tile_ready_input(x, alloc, head_dim, stream, bits=True)
                  for x in (q, k, v)]
        out_view, out_final = marshal.tile_ready_output(out, alloc, head_dim)
        lse_view = marshal.view(lse)
        kernel_extras = marshal.kernel_extras(spec, extras, *inputs[:2], lse_view)
        tiles = call_tiles(spec, extras, kernel_extras, *inputs[:2], alloc, stream)
        maps = marshal.view(alloc(map_slot_shape(map_sequences(spec, kernel_extras)), "int64"))
        # (before the tile tables are built: they are built for the chosen tiles)
        sms = grid_multiprocessors(q)
        config = mask_mod_forward_config(spec, *inputs, out_view, lse_view, kernel_extras,
                                         tiles, maps, sms)
        launch_hopper_forward(spec, *inputs, out_view, lse_view, stream, config=config,
                              extras=kernel_extras, tiles=tiles, maps=maps,
                              multiprocessors=sms)
        if out_final is not None:
            marshal.copy_padded(out_view, out_final, stream)

    def backward(self, spec, dout, q, k, v, out, lse, delta, grads, alloc, stream, extras):
        head_dim = hopper_head_dim(spec.head_dim)
        if not hopper_backward_config(head_dim, spec):
            self.backward_engine.backward(spec, dout, q, k, v, out, lse, delta, grads, alloc,
                                          stream, extras)
            return
        inputs = [marshal.tile_ready_input(x, alloc, head_dim, stream, bits=True)
                  for x in (dout, q, k, v, out)]
        outputs = [marshal.tile_ready_output(g, alloc, head_dim) for g in grads]
        lse_view = marshal.view(lse)
        kernel_extras = marshal.kernel_extras(spec, extras, *inputs[1:3], lse_view)
        sequences = map_sequences(spec, kernel_extras)
        launch_hopper_backward(spec, *inputs, lse_view, marshal.view(delta),
                               *(kernel_view for kernel_view, _ in outputs), stream,
                               extras=kernel_extras,
                               tiles=call_tiles(spec, extras, kernel_extras, *inputs[1:3],
                                                alloc, stream),
                               maps=[marshal.view(alloc(map_slot_shape(sequences), "int64"))
                                     for _ in range(2)],
                               multiprocessors=grid_multiprocessors(q),
                               scratch=lambda shape, dtype: marshal.view(alloc(shape, dtype)))
        for kernel_view, final in outputs:
            if final is not None:
                marshal.copy_padded(kernel_view, final, stream)


def map_sequences(spec, kernel_extras):
    """The sequences whose tensor maps a call's kernels keep apart: varlen's (each its own,
    tensor_maps.py), else 1."""
    return int(kernel_extras[1].shape[0]) - 1 if spec.varlen else 1


def grid_multiprocessors(q):
    """The multiprocessors the kernels lay their grids for (hopper/grids.py): q's GPU's;
    none under the simulator (its blocks run one after another)."""
    return 0 if simulator_enabled() else multiprocessors(_arrays.device_id(q))
