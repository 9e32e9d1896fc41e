"""The Hopper backward (sm_90a): D = rowsum(dO ∘ O) (device/delta.py), then the dK/dV kernel
(bwd_dk_dv.py) and the dQ kernel (bwd_dq.py), deterministic (no atomics); P recomputed from
Q, K and the saved lse, as every backward here."""
import dataclasses
import functools

import numpy as np
from numba import cuda

from ..device.constants import LOG2E
from ..device.delta import launch_delta
from ..device.intrinsics import SIMULATED
from ..device.sequence import grid_extent
from ..launch import kernel_extras_unused, launch
from ..tile_classes import tile_arguments
from .bwd_dk_dv import hopper_dk_dv_kernel_function
from .bwd_dq import hopper_dq_kernel_function
from .config import copies_for, hopper_backward_config, hopper_backward_shared_bytes
from .tensor_maps import MAP_COUNT, map_slots, map_templates, no_templates


@functools.lru_cache(maxsize=None)
def hopper_backward_kernels(config, spec):
    """The compiled (dk_dv, dq) kernels of one HopperBackwardConfig and kernel spec."""
    functions = (hopper_dk_dv_kernel_function(config, spec),
                 hopper_dq_kernel_function(config, spec))
    if SIMULATED:  # (the simulator takes no launch bounds)
        return tuple(cuda.jit(f) for f in functions)
    # launch_bounds=(threads, 1): the register cap at entry that setmaxnreg needs; no disk
    # cache with a mask_mod (its key would not see mask_mod's code)
    return tuple(cuda.jit(f, cache=spec.mask_mod is None, launch_bounds=(config.threads, 1))
                 for f in functions)


def launch_hopper_backward(spec, dout, q, k, v, out, lse, delta, dq, dk, dv, stream=0,
                           config=None, extras=None, tiles=None, maps=None):
    """All 16-bit arrays are uint16 views (batch, seqlen, nheads, headdim) with contiguous,
    16-byte aligned rows, headdim the padded head dim (64 or 128); lse, delta (scratch):
    float32 (batch, nheads, seqlen_q). `extras` and `tiles` as launch_hopper_forward's;
    `maps`: the two kernels' scratch slots for their tensor maps (dK/dV's, dQ's), each as
    launch_hopper_forward's. `config` overrides hopper_backward_config
    (tests, tuning)."""
    _, _, nheads, head_dim = q.shape
    extras = extras or kernel_extras_unused(lse)
    seqlen_q, batch = grid_extent(spec, q, extras[1], 0)
    seqlen_k, _ = grid_extent(spec, k, extras[2], 1)
    chosen = config is None
    config = config or hopper_backward_config(head_dim, spec)
    if config is None:
        raise ValueError(f"no Hopper backward config for head_dim {head_dim}")
    config = copies_for(spec, config)
    # the maps of the dK/dV kernel (K, V whole row tiles; Q, dO streamed), then the dQ
    # kernel's (the other way round); each kernel's in the order q, dout, k, v
    templates = config.copy_engine and map_templates(
        ((q, config.block_m), (dout, config.block_m), (k, config.rows), (v, config.rows),
         (q, config.rows), (dout, config.rows), (k, config.block_n), (v, config.block_n)))
    if templates:
        dk_dv_templates, dq_templates = templates[:MAP_COUNT], templates[MAP_COUNT:]
    else:  # (cp.async: the config's choice, or strides the copy engine refuses)
        config = (hopper_backward_config(head_dim, spec, copy_engine=False) if chosen else
                  dataclasses.replace(config, copy_engine=False))
        dk_dv_templates = dq_templates = no_templates(MAP_COUNT)
    dk_dv_maps, dq_maps = maps or (map_slots(lse), map_slots(lse))
    dk_dv_kernel, dq_kernel = hopper_backward_kernels(config, spec.for_kernels(head_dim=head_dim))
    scale = np.float32(spec.softmax_scale)
    scale_log2 = np.float32(spec.softmax_scale * float(LOG2E))
    dk_dv_bytes, dq_bytes = hopper_backward_shared_bytes(config, head_dim)
    launch_delta(dout, out, delta, "bf16" if spec.bf16 else "f16", stream)
    launch(dk_dv_kernel, (-(-seqlen_k // config.rows), k.shape[2], batch), config.threads,
           stream, dk_dv_bytes, q, k, v, dout, lse, delta, dk, dv, scale_log2, scale,
           dk_dv_maps, dk_dv_templates, *extras,
           *tile_arguments(tiles, lse, config.block_m, config.rows, along_keys=True))
    launch(dq_kernel, (-(-seqlen_q // config.rows), nheads, batch), config.threads, stream,
           dq_bytes, q, k, v, dout, lse, delta, dq, scale_log2, scale, dq_maps, dq_templates,
           *extras,
           *tile_arguments(tiles, lse, config.rows, config.block_n))
