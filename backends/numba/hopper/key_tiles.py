"""The key tiles of a Hopper forward with a mask_mod, chosen at run time.

The mask_mod table's 64-key tiles (config.py) compile clean with every variant but cost 15-25 %
of the forward's speed against the plain table's 128-key tiles, where whether a call spills
depends on the mask_mod's code, the variants and the arrays' layouts (a document mask_mod with
softcap and GQA compiled clean for contiguous arrays, and spilled for strided ones). So the
engine asks the compiled kernel: the 128-key tiles where their forward keeps nothing in local
memory for the call's argument types, else the mask_mod table's. The 128-key kernel is
compiled (and kept for the launch: launch.local_memory) on the first call of its argument
types; where it spills, the 64-key one is compiled too. The question costs a call's full path
some 50 µs (typing the arguments); its replays do not ask it.
"""
from ..launch import argument_types, local_memory
from .config import mask_mod_wide_forward_config
from .fwd import hopper_forward_launch


def mask_mod_forward_config(spec, q, k, v, out, lse, extras, tiles, maps, multiprocessors=0):
    """The Hopper forward's config for a call (launch_hopper_forward's arguments; tiles: a
    mask_mod's TileTables, else None): mask_mod_wide_forward_config's where its kernel
    compiles without local memory for this call, else None: hopper_forward_config's (always
    under the simulator, which compiles nothing)."""
    wide = mask_mod_wide_forward_config(int(q.shape[3]), spec)
    if wide is None:
        return None
    # (typed with the tile tables' stand-ins: none is built before the choice)
    launched, kernel, _, _, _, args = hopper_forward_launch(spec, q, k, v, out, lse, wide,
                                                            extras, tiles.stand_ins(), maps,
                                                            multiprocessors)
    # (its maps refused: cp.async, whose tiles the mask_mod table says)
    clean = launched.copy_engine and local_memory(kernel, argument_types(args),
                                                  tiles.device) == 0
    return wide if clean else None
