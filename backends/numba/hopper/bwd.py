"""The Hopper backward (sm_90a): D = rowsum(dO ∘ O) (device/delta.py), then the dK/dV kernel
(bwd_dk_dv.py) and the dQ kernel (bwd_dq.py), deterministic (no atomics); P recomputed from
Q, K and the saved lse, as every backward here. Where the dK/dV blocks are few, a GQA group
split over blocks (grids.py) ends with the sums of its parts (device/group_sums.py)."""
import dataclasses
import functools

import numpy as np
from numba import cuda

from ..device.constants import LOG2E
from ..device.delta import launch_delta
from ..device.group_sums import launch_group_sums
from ..device.intrinsics import SIMULATED
from ..device.sequence import grid_extent
from ..launch import kernel_extras_unused, launch, scratch_like
from ..tile_classes import tile_arguments
from .bwd_dk_dv import hopper_dk_dv_kernel_function
from .bwd_dq import hopper_dq_kernel_function
from .config import hopper_backward_config, hopper_backward_shared_bytes
from .grids import backward_grid, grid_shape
from .tensor_maps import MAP_COUNT, check_map_slots, map_slots, map_templates, no_templates


def _compiled(function, config, spec):
    if SIMULATED:  # (the simulator takes no launch bounds)
        return cuda.jit(function)
    # launch_bounds=(threads, 1): the register cap at entry that setmaxnreg needs; no disk
    # cache with a mask_mod (its key would not see mask_mod's code)
    return cuda.jit(function, cache=spec.mask_mod is None, launch_bounds=(config.threads, 1))


@functools.lru_cache(maxsize=None)
def hopper_dk_dv_kernel(config, spec, split, keys_slowest):
    """The compiled dK/dV kernel of one HopperBackwardConfig, kernel spec and layout."""
    return _compiled(hopper_dk_dv_kernel_function(config, spec, split, keys_slowest), config,
                     spec)


@functools.lru_cache(maxsize=None)
def hopper_dq_kernel(config, spec, queries_slowest):
    """The compiled dQ kernel of one HopperBackwardConfig, kernel spec and layout."""
    return _compiled(hopper_dq_kernel_function(config, spec, queries_slowest), config, spec)


def launch_hopper_backward(spec, dout, q, k, v, out, lse, delta, dq, dk, dv, stream=0,
                           config=None, extras=None, tiles=None, maps=None, multiprocessors=0,
                           grid=None, scratch=None):
    """All 16-bit arrays are uint16 views (batch, seqlen, nheads, headdim) with contiguous,
    16-byte aligned rows, headdim the padded head dim (64 or 128); lse, delta (scratch):
    float32 (batch, nheads, seqlen_q). `extras` and `tiles` as launch_hopper_forward's;
    `maps`: the two kernels' scratch slots for their tensor maps (dK/dV's, dQ's), each as
    launch_hopper_forward's. `multiprocessors`: the GPU's, for the grids' layout (grids.py;
    0: the plain layout), which `grid` (a BackwardGrid) overrides; a split group's
    float32 parts come from scratch(shape, dtype) (default: launch.scratch_like(dk)). `config`
    overrides hopper_backward_config (tests, tuning)."""
    _, _, nheads, head_dim = q.shape
    extras = extras or kernel_extras_unused(lse)
    seqlen_q, batch = grid_extent(spec, q, extras[1], 0)
    seqlen_k, _ = grid_extent(spec, k, extras[2], 1)
    chosen = config is None
    config = config or hopper_backward_config(head_dim, spec)
    if config is None:
        raise ValueError(f"no Hopper backward config for head_dim {head_dim}")
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
    sequences = batch if spec.varlen else 1  # (varlen: maps per sequence, tensor_maps.py)
    dk_dv_maps, dq_maps = maps or [map_slots(lse, sequences) for _ in range(2)]
    check_map_slots(dk_dv_maps, sequences)
    check_map_slots(dq_maps, sequences)
    kernel_spec = spec.for_kernels(head_dim=head_dim)
    key_tiles, kv_heads = -(-seqlen_k // config.rows), k.shape[2]
    query_tiles = -(-seqlen_q // config.rows)
    grid = grid or backward_grid(spec, key_tiles, kv_heads, query_tiles, nheads, batch,
                                 multiprocessors)
    if spec.group % grid.split:
        raise ValueError(f"a split of {grid.split} does not divide the GQA group of "
                         f"{spec.group}")
    scale = np.float32(spec.softmax_scale)
    scale_log2 = np.float32(spec.softmax_scale * float(LOG2E))
    dk_dv_bytes, dq_bytes = hopper_backward_shared_bytes(config, head_dim)
    launch_delta(dout, out, delta, "bf16" if spec.bf16 else "f16", stream)
    dk_dv_out = (dk, dv)
    if grid.split > 1:
        parts = tuple(k.shape[:2]) + (kv_heads * grid.split, head_dim)
        dk_dv_out = [(scratch or scratch_like(dk))(parts, "float32") for _ in range(2)]
    slots = kv_heads * grid.split
    launch(hopper_dk_dv_kernel(config, kernel_spec, grid.split, grid.keys_slowest),
           grid_shape(key_tiles, slots, batch, grid.keys_slowest),
           config.threads, stream, dk_dv_bytes, q, k, v, dout, lse, delta, *dk_dv_out,
           scale_log2, scale, dk_dv_maps, dk_dv_templates, *extras,
           *tile_arguments(tiles, lse, config.block_m, config.rows, along_keys=True))
    launch(hopper_dq_kernel(config, kernel_spec, grid.queries_slowest),
           grid_shape(query_tiles, nheads, batch, grid.queries_slowest), config.threads,
           stream, dq_bytes, q, k, v, dout, lse, delta, dq, scale_log2, scale, dq_maps,
           dq_templates, *extras,
           *tile_arguments(tiles, lse, config.rows, config.block_n))
    if grid.split > 1:
        launch_group_sums(spec, grid.split, *dk_dv_out, dk, dv, extras[1], extras[2], stream)
