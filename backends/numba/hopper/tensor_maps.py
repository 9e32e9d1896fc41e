"""The copy engine's tensor maps in the Hopper kernels: on the host, the templates of a call's
maps (device/intrinsics/tensor_copy.py: everything but the address, encoded once per shape,
strides and box) and the scratch slots a kernel publishes its maps to; on the device, a
producer warp's making and publishing of them.

A kernel takes up to MAP_COUNT maps in a scratch of its own (the backward's two kernels each
publish theirs: their boxes differ)."""
import functools
import warnings

import numpy as np
from numba import cuda

from ..device.intrinsics import (MAP_WORDS, TensorMapRefused, global_address, map_slot,
                                 syncwarp, tensor_map_address, tensor_map_publish,
                                 tensor_map_store, tensor_map_template)
from ..launch import scratch_like

#: the maps of one kernel: the forward's q, k, v; each backward kernel's q, dout, k, v
MAP_COUNT = 4
#: the slots of one kernel's maps (16 words each)
MAP_SLOTS = (MAP_COUNT, MAP_WORDS)
#: a producer warp's shared scratch for its maps: MAP_COUNT of them, aligned to 128 bytes
#: within (shared_base(scratch, 128))
SCRATCH_WORDS = (MAP_COUNT + 1) * MAP_WORDS


def no_templates(count):
    """The template words of a launch that copies with cp.async (the kernel never reads them)."""
    return ((np.uint64(0),) * MAP_WORDS,) * count


def map_slots(like):
    """A scratch array for the maps of one kernel of a call (launch.scratch_like's)."""
    return scratch_like(like)(MAP_SLOTS, np.int64)


def map_templates(arrays_and_rows):
    """The templates of maps of 16-bit (batch, seqlen, heads, headdim) arrays, each with a box
    of its `rows`, or None if the copy engine cannot read one of them (tensor_map_template's
    reasons; the engine's inputs have 16-byte rows already, marshal.tile_ready_input)."""
    templates = tuple(_template(tuple(x.shape), tuple(x.strides), rows)
                      for x, rows in arrays_and_rows)
    return None if None in templates else templates


@functools.lru_cache(maxsize=1024)
def _template(shape, strides, rows):
    """(Cached, refusals too: a call of the same shapes asks again.)"""
    try:
        return tensor_map_template(shape, strides, 2, rows)
    except TensorMapRefused as refusal:  # (dims or strides past the driver's limits)
        warnings.warn(f"{refusal}: these calls copy with cp.async", RuntimeWarning,
                      stacklevel=2)
    except ValueError:
        pass
    return None


@cuda.jit(device=True, inline="always")
def write_map(scratch, index, array, template):
    """(One lane) map `index` in the warp's shared scratch: the template with the address of
    `array`."""
    tensor_map_store(scratch + 128 * index, template)
    tensor_map_address(scratch + 128 * index, global_address(array, 0, 0, 0, 0))


@cuda.jit(device=True, inline="always")
def publish_maps(scratch, maps, count):
    """(The whole warp, after write_map of maps 0..count-1 by one lane) the maps copied from
    the scratch to their global slots, fenced for the copy engine's reads."""
    syncwarp()
    for i in range(count):
        tensor_map_publish(map_slot(maps, i), scratch + 128 * i)
