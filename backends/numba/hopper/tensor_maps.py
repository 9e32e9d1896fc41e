"""The copy engine's tensor maps in the Hopper kernels: on the host, the templates of a call's
maps (device/intrinsics/tensor_copy.py: everything but the address, encoded once per shape,
strides and box) and the scratch slots a kernel publishes its maps to; on the device, a
producer warp's making and publishing of them.

A kernel takes up to MAP_COUNT maps in a scratch of its own (the backward's two kernels each
publish theirs: their boxes differ). With varlen each sequence has its own MAP_COUNT slots: a
sequence's maps start at its first row and end at its last, so that a box stops at the
sequence's end (zeros past it, as cp.async's loaders fill) and the copies take the sequence's
own row coordinates.
"""
import functools
import warnings

import numpy as np
from numba import cuda

from ..device.intrinsics import (MAP_WORDS, TensorMapRefused, global_address, map_slot,
                                 syncwarp, tensor_map_address, tensor_map_publish,
                                 tensor_map_rows, tensor_map_store, tensor_map_template)
from ..launch import scratch_like

#: the maps of one kernel: the forward's q, k, v; each backward kernel's q, dout, k, v
MAP_COUNT = 4
#: a producer warp's shared scratch for its maps: MAP_COUNT of them, aligned to 128 bytes
#: within (shared_base(scratch, 128))
SCRATCH_WORDS = (MAP_COUNT + 1) * MAP_WORDS


def no_templates(count):
    """The template words of a launch that copies with cp.async (the kernel never reads them)."""
    return ((np.uint64(0),) * MAP_WORDS,) * count


def map_slot_shape(sequences):
    """The shape of the int64 slots of one kernel's maps (16 words each) in a call of
    `sequences` packed sequences (1 without varlen: one set of maps for every block)."""
    return (sequences * MAP_COUNT, MAP_WORDS)


def check_map_slots(maps, sequences):
    """Refuse a scratch of map slots too small for a call of `sequences` sequences (the
    kernels would publish past it)."""
    if maps.shape[0] < sequences * MAP_COUNT:
        raise ValueError(f"maps: {sequences * MAP_COUNT} slots for {sequences} sequences "
                         f"(map_slot_shape); got {maps.shape[0]}")


def map_slots(like, sequences=1):
    """A scratch array for the maps of one kernel of a call (launch.scratch_like's)."""
    return scratch_like(like)(map_slot_shape(sequences), np.int64)


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


@functools.lru_cache(maxsize=None)
def make_map_writer(varlen):
    """write_map(scratch, index, array, template, row0, rows): (one lane) map `index` in the
    warp's shared scratch, the template with the address of array's row `row0` (0 without
    varlen); with varlen the tensor's rows set to the sequence's `rows` (at least one: an
    empty sequence's map is written but never copied through)."""

    @cuda.jit(device=True, inline="always")
    def write_map(scratch, index, array, template, row0, rows):
        tensor_map_store(scratch + 128 * index, template)
        tensor_map_address(scratch + 128 * index, global_address(array, 0, row0, 0, 0))
        if varlen:
            tensor_map_rows(scratch + 128 * index, max(rows, 1))

    return write_map


@cuda.jit(device=True, inline="always")
def publish_maps(scratch, maps, first, count):
    """(The whole warp, after write_map of maps 0..count-1 by one lane) the maps copied from
    the scratch to the global slots first..first+count-1, fenced for the copy engine's reads."""
    syncwarp()
    for i in range(count):
        tensor_map_publish(map_slot(maps, first + i), scratch + 128 * i)
