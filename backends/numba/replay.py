"""Replays: the kernel launches of one call, repeated on new arrays of the same signature.

The first call of a signature runs the backend's Python (engine choice, views, padded copies,
kernel lookup, parameter packing) inside `recording()`, which notes each allocation the backend
makes (`note_allocation`), each launch (`note_launch`, from launch.launch) and each array
whose address and values every call of the signature shares (`note_constant`: a block mask's
tile tables). If every address a launch took is the address of exactly one of the call's
arrays, allocations or constants, `build_replay` turns the record into a `Replay`: later
calls of the same signature only allocate, read the new addresses and launch.
numba_flash/call_cache.py keys replays by signature, so everything that decided the record
(shapes, strides, dtypes, device, alignment of the addresses, which inputs share an address,
the spec, backend, the block mask) is the same when a replay runs.
"""
import contextlib
import threading

from numba_flash import _arrays

_active = threading.local()


class Recording:
    """A call's allocations [(shape, dtype, array)], constants [array] and launches
    [(prepared, addresses)]."""

    def __init__(self):
        self.allocations, self.constants, self.launches = [], [], []


@contextlib.contextmanager
def recording():
    """Within the block, allocations and launches on this thread are noted in the Recording
    it yields."""
    record, previous = Recording(), getattr(_active, "record", None)
    _active.record = record
    try:
        yield record
    finally:
        _active.record = previous


def note_allocation(shape, dtype, array):
    record = getattr(_active, "record", None)
    if record is not None:
        record.allocations.append((shape, dtype, array))


def note_constant(array):
    """`array` is the same, at the same address, for every call of the signature (the replay
    keeps it alive)."""
    record = getattr(_active, "record", None)
    if record is not None:
        record.constants.append(array)


def note_launch(prepared, pointers):
    record = getattr(_active, "record", None)
    if record is not None:
        record.launches.append((prepared, pointers))


class Replay:
    """Calling it with the call's arrays (inputs) returns what the recorded call returned,
    freshly allocated and computed. As in the recorded call, the input at position `ref` (q)
    decides the library of the allocations (`backend._new`, looked up per call, so a test that
    patches it still sees every allocation), the stream (`backend._stream`) and the GPU made
    current (`backend._on_device`). The constants' addresses follow the allocations'."""
    __slots__ = ("backend", "allocations", "launches", "results", "ref", "pointer_getters",
                 "constants", "constant_pointers")

    def __init__(self, backend, allocations, launches, results, ref, pointer_getters,
                 constants=()):
        self.backend, self.allocations = backend, allocations
        self.launches, self.results, self.ref = launches, results, ref
        self.pointer_getters = pointer_getters  # (per array: the types are the signature's)
        self.constants = constants  # (kept alive)
        self.constant_pointers = [_arrays.data_pointer(x) for x in constants]

    def __call__(self, *inputs):
        backend, ref = self.backend, inputs[self.ref]
        with backend._on_device(ref):
            arrays = list(inputs)
            arrays += [backend._new(ref, shape, dtype) for shape, dtype in self.allocations]
            pointers = [get(x) for get, x in zip(self.pointer_getters, arrays)]
            pointers += self.constant_pointers
            stream = backend._stream(ref)
            for prepared, roles in self.launches:
                prepared(stream, [pointers[role] for role in roles])
        return tuple(arrays[i] for i in self.results)


def build_replay(backend, record, inputs, results, ref=0):
    """A Replay of `record`, made by a call of `backend` on `inputs` that returned `results`,
    with inputs[ref] the array the backend allocated like and took the stream of; None where
    an address does not name exactly one array (scratch freed within the call, an allocation
    or a constant at an input's address, a view at an offset): such calls take the full path
    every time. Inputs that share an address (one object passed twice, k = q.detach()) are
    one array to the replay: call_cache's signature keeps such calls apart from those whose
    inputs lie apart."""
    arrays = list(inputs) + [array for _, _, array in record.allocations]
    constants = {_arrays.data_pointer(x): x for x in record.constants}  # (one per address)
    pointers = [_arrays.data_pointer(x) for x in arrays] + list(constants)
    role_of = {}
    for role, pointer in enumerate(pointers):
        first = role_of.setdefault(pointer, role)
        if first != role and role >= len(inputs):
            return None
    if not record.launches:
        return None
    try:
        launches = tuple((prepared, tuple(role_of[p] for p in launch_pointers))
                         for prepared, launch_pointers in record.launches)
        result_roles = tuple(next(role for role in range(len(inputs), len(arrays))
                                  if arrays[role] is result) for result in results)
    except (KeyError, StopIteration):
        return None
    allocations = tuple((shape, dtype) for shape, dtype, _ in record.allocations)
    getters = tuple(_arrays.pointer_getter(type(x)) for x in arrays)
    return Replay(backend, allocations, launches, result_roles, ref, getters,
                  tuple(constants.values()))
