"""Repeated calls: what a call signature seen before skips.

A training or inference loop calls forward and backward with the same shapes again and again.
The first call of a signature runs the checks, chooses the backend and lets the backend set its
launches up; the backend hands back a replay (Backend.forward_and_replay), kept here under the
signature. The next call with that signature runs the replay directly: for the numba backends,
allocate the outputs and launch the recorded kernels on the new addresses
(backends/numba/replay.py).

The signature holds everything those decisions read: the operation, the backend asked for (and
the default it stands for), the call's AttentionSpec and, per array, its type, shape, strides,
dtype, device and whether its address is 16-byte aligned (a mask_mod's captured arrays are
among the arrays: its replay reads their new values), and which arrays share an address (one
object passed twice, or two views of one buffer). Only CuPy arrays and CUDA torch tensors
have signatures; other calls always take the full path. A signature that failed a check is
never stored, so bad input always meets its error.

A call with a block mask launches with the block mask's tile tables, so its replays are kept
in the block mask (BlockMask.replays) rather than here: they go when it goes (a training loop
makes a block mask per batch, which all layers share).

NUMBA_FLASH_REPLAY=0 in the environment (read at import) turns replays off: every call then
takes the full path, e.g. to rule the replay out while debugging a wrong result.
"""
import os
import threading
import weakref
from collections import OrderedDict

from numba_flash import _arrays, registry

#: False under NUMBA_FLASH_REPLAY=0: no signature is kept, every call takes the full path
ENABLED = os.environ.get("NUMBA_FLASH_REPLAY", "1").strip() != "0"

#: signatures kept; past this the least recently used goes (a loop uses a handful)
MAX_ENTRIES = 256
#: signatures kept per block mask (a forward and a backward, in a dtype or two, on arrays
#: at distinct addresses or sharing some)
MAX_BLOCK_MASK_ENTRIES = 8

_replays = OrderedDict()
_block_masks = weakref.WeakSet()  # (those holding replays: for clear)
_lock = threading.Lock()


def _array_signature(x):
    """(x's part of the signature, its address), or None for what has no signature."""
    package = _arrays.library(x)
    try:
        if package == "torch" and x.is_cuda:
            pointer = x.data_ptr()
            return (type(x), x.shape, x.stride(), x.dtype, x.get_device(),
                    pointer % 16 == 0), pointer
        if package == "cupy":
            pointer = x.data.ptr
            return (type(x), x.shape, x.strides, x.dtype, x.data.device_id,
                    pointer % 16 == 0), pointer
    except (AttributeError, RuntimeError, TypeError):  # not a dense array: the checks say so
        return None
    return None


def signature(operation, backend, spec, arrays):
    """The call's signature (arrays: a tuple), or None for a call that is not cached. It says
    which arrays share an address (varlen's one cu_seqlens for self-attention,
    attention(x, x, x), k = q.detach()): a replay of such a call reads that address from one
    of them, so it serves only calls whose arrays share the same addresses."""
    if not ENABLED or type(backend) is not str:
        return None
    described = tuple(map(_array_signature, arrays))
    if None in described:
        return None
    if backend == registry.AUTO:
        backend = (backend, registry.default_backend())
    arrays_described, pointers = zip(*described)
    shared = None
    if len(set(pointers)) < len(pointers):
        shared = tuple(map(pointers.index, pointers))
    return operation, backend, spec, arrays_described, shared


def get(key, block_mask=None):
    """The replay stored under `key` (in block_mask, for a call with one), or None."""
    if key is None:
        return None
    replays = _replays if block_mask is None else block_mask.replays
    replay = replays.get(key)
    if replay is not None:
        try:
            replays.move_to_end(key)
        except KeyError:  # evicted by another thread meanwhile
            pass
    return replay


def put(key, replay, block_mask=None):
    if key is None:
        return
    replays, limit = _replays, MAX_ENTRIES
    if block_mask is not None:
        replays, limit = block_mask.replays, MAX_BLOCK_MASK_ENTRIES
    with _lock:
        if block_mask is not None:
            _block_masks.add(block_mask)
        if len(replays) >= limit:
            replays.popitem(last=False)
        replays[key] = replay


def clear():
    """Forget every replay (the next call of each signature takes the full path)."""
    with _lock:
        _replays.clear()
        for block_mask in _block_masks:
            block_mask.replays.clear()
