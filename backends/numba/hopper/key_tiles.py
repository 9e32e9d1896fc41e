"""The key tiles of a Hopper forward with a mask_mod, chosen at run time.

The mask_mod table's 64-key tiles (config.py) compile clean with every variant but cost 15-25 %
of the forward's speed against the plain table's 128-key tiles, where whether a call spills
depends on the mask_mod's code, the variants and the arrays' layouts (a document mask_mod with
softcap and GQA compiled clean for contiguous arrays, and spilled for strided ones). So the
engine asks the compiled kernel: the 128-key tiles where their forward keeps nothing in local
memory for the call's argument types, else the mask_mod table's. The 128-key kernel is
compiled (and kept for the launch) on the first call of its argument types; where it spills,
the 64-key one is compiled too.
"""
import threading

from ..launch import argument_types, local_memory
from .config import mask_mod_wide_forward_config
from .fwd import hopper_forward_launch

#: the choice per call signature: the spec, the device, the block mask's batch and heads and
#: each array's dtype, shape and strides (what the launch's argument types are made of:
#: typing them takes some 50 µs, and a mask_mod call is not replayed)
_choices = {}
_lock = threading.Lock()
#: choices kept; past this the oldest goes (a loop whose shapes keep changing)
MAX_CHOICES = 1024


def mask_mod_forward_config(spec, q, k, v, out, lse, extras, tiles, maps):
    """The Hopper forward's config for a call (launch_hopper_forward's arguments; tiles: a
    mask_mod's TileTables, else None): mask_mod_wide_forward_config's where its kernel
    compiles without local memory for this call, else None: hopper_forward_config's (always
    under the simulator, which compiles nothing)."""
    wide = mask_mod_wide_forward_config(int(q.shape[3]), spec)
    if wide is None:
        return None
    key = (spec, tiles.device, tiles.block_mask.batch, tiles.block_mask.nheads,
           *((x.dtype, x.shape, x.strides) for x in (q, k, v, out, lse, maps, *extras,
                                                     *tiles.mod_arrays)))
    clean = _choices.get(key)
    if clean is None:
        clean = _compiles_clean(spec, wide, q, k, v, out, lse, extras, tiles, maps)
        with _lock:
            if len(_choices) >= MAX_CHOICES:
                del _choices[next(iter(_choices))]
            _choices[key] = clean
    return wide if clean else None


def _compiles_clean(spec, config, q, k, v, out, lse, extras, tiles, maps):
    """Whether the forward on `config` keeps nothing in local memory for this call, compiled
    for its argument types (the tile tables' stand-ins': none is built) and kept for the
    launch (launch.local_memory)."""
    launched, kernel, _, _, _, args = hopper_forward_launch(spec, q, k, v, out, lse, config,
                                                            extras, tiles.stand_ins(), maps)
    # (its maps refused: cp.async, whose tiles the table says)
    return launched.copy_engine and local_memory(kernel, argument_types(args),
                                                 tiles.device) == 0
