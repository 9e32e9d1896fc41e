"""The host's part of the copy engine for the Hopper kernels: the templates of a call's tensor
maps (device/intrinsics/tensor_copy.py: everything but the address, encoded once per shape,
strides and box) and the scratch slots the kernels publish the maps to."""
import functools
import warnings

import numpy as np
from numba import cuda

from ..device.intrinsics import MAP_WORDS, TensorMapRefused, tensor_map_template

#: the slots of a call's maps (16 words each): q, k and v
MAP_SLOTS = (3, MAP_WORDS)
#: the template words of a launch that copies with cp.async (the kernel never reads them)
NO_TEMPLATES = ((np.uint64(0),) * MAP_WORDS,) * MAP_SLOTS[0]


def map_slots(like):
    """A scratch array for a call's maps: on the host if `like` is a NumPy array (launches
    copy those), else a Numba device array (tests and tools; the engine allocates the slots
    as it does other scratch)."""
    if isinstance(like, np.ndarray):
        return np.zeros(MAP_SLOTS, np.int64)
    return cuda.device_array(MAP_SLOTS, np.int64)


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
