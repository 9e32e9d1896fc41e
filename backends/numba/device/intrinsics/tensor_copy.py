"""The copy engine (sm_90's tensor memory accelerator): tensor maps made on the device, 4-D
tile copies from global into shared memory that complete on an mbarrier, and their simulator
twins.

A tensor map (128 opaque bytes) describes a global tensor and the box one copy brings. The host
encodes everything but the tensor's address once per shape and strides
(`tensor_map_template`) and passes those 16 words to the kernel as scalars; on the device one
thread writes them into shared memory (`tensor_map_store`) and puts the address in
(`tensor_map_address`), and its warp copies the map to a 128-byte slot of global memory
(`tensor_map_publish`, a release for the copy engine, which reads maps from global memory
only); the thread that issues copies fences once for them (`tensor_map_acquire`). Every block
of a launch writes the same bytes to the same slot: the slots are scratch of that one call.

A copy (`tensor_copy_4d`) brings the box at coordinates (c0, c1, c2, c3), innermost first,
into shared memory in the 128-byte swizzle (16-byte chunk j of a 128-byte row r of a
1024-byte aligned destination lands at chunk j ^ (r % 8): hopper/layout.py's layout),
elements outside the tensor as zeros, and counts its bytes on the mbarrier as completed
transactions; `mbarrier_expect_tx` arrives on it announcing those bytes.
"""
import threading
import weakref

import numpy as np
from numba import types
from numba.cuda.extending import intrinsic

from . import sim_warp
from ._llvm import SIMULATED, asm, element_address, name_for_cache, operand_instruction
from .cp_async import _GlobalAddress
from .mbarrier import complete_transaction
from .shared import _SharedAddress

MAP_WORDS = 16  # 128 bytes
#: the box's innermost extent in bytes: one 128-byte swizzle row
BOX_ROW_BYTES = 128


@intrinsic
def _tensor_map_store(typingctx, scratch, words):
    """Write a map's 16 words (a UniTuple of uint64) at the 32-bit shared address `scratch`
    (128-byte aligned)."""
    if not (isinstance(words, types.UniTuple) and len(words) == MAP_WORDS):
        return None
    sig = types.void(scratch, words)

    def codegen(context, builder, sig, args):
        address = context.cast(builder, args[0], sig.args[0], types.uint32)
        for i in range(MAP_WORDS):
            word = context.cast(builder, builder.extract_value(args[1], i), sig.args[1].dtype,
                                types.uint64)
            asm(builder, f"st.shared.u64 [$0+{8 * i}], $1;", "r,l,~{memory}", [address, word],
                side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _map_slot(typingctx, maps, index):
    """The generic address of slot `index` of a (slots, 16) uint64 array of map slots."""
    if not (isinstance(maps, types.Array) and maps.ndim == 2):
        return None
    sig = types.uint64(maps, index)

    def codegen(context, builder, sig, args):
        zero = context.get_constant(types.intp, 0)
        return element_address(context, builder, sig.args[0], args[0],
                               (sig.args[1], types.intp), (args[1], zero))

    return sig, codegen


_U32, _U64, _I32 = types.uint32, types.uint64, types.int32
#: put a tensor's address (generic, as global_address gives it) into the map at a shared
#: address
_tensor_map_address = operand_instruction(
    "{ .reg .u64 ga; cvta.to.global.u64 ga, $1; "
    "tensormap.replace.tile.global_address.shared::cta.b1024.b64 [$0], ga; }", (_U32, _U64))
#: set the rows (dimension 2, innermost first) of the tensor the map at a shared address
#: describes: a varlen sequence's own, so that a box stops at the sequence's end
_tensor_map_rows = operand_instruction(
    "tensormap.replace.tile.global_dim.shared::cta.b1024.b32 [$0], 2, $1;", (_U32, _U32))
#: copy the map at a shared address to a global slot (a generic address, 128-byte aligned)
#: and release it to the copy engine; every thread of the warp calls it together, after the
#: writes to the map (a warp barrier between)
_tensor_map_publish = operand_instruction(
    "{ .reg .u64 ga; cvta.to.global.u64 ga, $0; tensormap.cp_fenceproxy.global."
    "shared::cta.tensormap::generic.release.gpu.sync.aligned [ga], [$1], 128; }", (_U64, _U32))
#: acquire the published map at a slot for this thread's copies
_tensor_map_acquire = operand_instruction(
    "fence.proxy.tensormap::generic.acquire.gpu [$0], 128;", (_U64,))
#: copy the box at coordinates (c0, c1, c2, c3) of the tensor the map at `slot` describes to
#: a shared address, completing on the mbarrier at `barrier`: (destination, slot, c0, c1, c2,
#: c3, barrier)
_tensor_copy_4d = operand_instruction(
    "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
    "[$0], [$1, {$2, $3, $4, $5}], [$6];", (_U32, _U64, _I32, _I32, _I32, _I32, _U32))


# -- the host's templates -------------------------------------------------------------------------

#: the address a template is encoded with (the kernel replaces it; 16-byte aligned, as asked)
_PLACEHOLDER_ADDRESS = 1 << 20
#: the simulator's maps: its own layout, tagged
_SIMULATED_MAP = 0x5E1A_7E4B_0000_0001


class TensorMapRefused(ValueError):
    """The driver would not encode a map (dims or strides beyond its limits)."""


def tensor_map_template(shape, strides, itemsize, box_rows):
    """The 16 words (numpy.uint64) of a map of a 4-D array of this shape and byte strides
    (batch, rows, heads, columns; columns contiguous), address left out, whose box is
    BOX_ROW_BYTES of columns of one head of `box_rows` rows of one batch entry, in the 128-byte
    swizzle, zeros outside. Raises ValueError where the copy engine cannot read the array (a
    stride not a multiple of 16 bytes, an empty dimension, not 16-bit), TensorMapRefused where
    the driver does (the simulator checks what the driver would first)."""
    if itemsize != 2 or min(shape) < 1:
        raise ValueError(f"the copy engine here copies 16-bit items of a non-empty array; got "
                         f"{itemsize}-byte items, shape {shape}")
    if itemsize * shape[3] % 16 or any(s % 16 for n, s in zip(shape[:3], strides[:3]) if n > 1):
        raise ValueError(f"the copy engine reads strides that are multiples of 16 bytes; got "
                         f"{strides} for shape {shape}")
    if not 1 <= box_rows <= 256:
        raise ValueError(f"a box has 1 to 256 rows; got {box_rows}")
    dims = (shape[3], shape[2], shape[1], shape[0])  # innermost first
    # (a stride of a dimension of one element is never used: any multiple of 16 serves)
    outer_strides = (strides[2], strides[1], strides[0])
    steps = tuple(s if n > 1 else 16 for n, s in zip(dims[1:], outer_strides))
    box = (BOX_ROW_BYTES // itemsize, 1, box_rows, 1)
    if SIMULATED:
        words = (0, _SIMULATED_MAP, itemsize) + dims + steps + box
        return tuple(np.uint64(w) for w in words + (0,) * (MAP_WORDS - len(words)))
    return _encoded(itemsize, dims, steps, box)


def _encoded(itemsize, dims, steps, box):
    from cuda.bindings import driver
    wide, narrow = driver.cuuint64_t, driver.cuuint32_t  # (the binding's integer types)
    error, tensor_map = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, _PLACEHOLDER_ADDRESS,
        [wide(n) for n in dims], [wide(n) for n in steps], [narrow(n) for n in box],
        [narrow(1)] * 4,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if error != driver.CUresult.CUDA_SUCCESS:
        raise TensorMapRefused(f"cuTensorMapEncodeTiled refused dims {dims}, strides "
                               f"{steps}, box {box}: {error.name}")
    return tuple(np.uint64(int(w)) for w in tensor_map.opaque)


# -- twins ----------------------------------------------------------------------------------------

#: published maps: the slots' array (weakly: an entry goes with its call's scratch) -> {byte
#: offset: (words, the tensor's address)}
_PUBLISHED = weakref.WeakKeyDictionary()
_PUBLISHED_LOCK = threading.Lock()


def _words_at(address):
    return address.array.view(np.uint8).reshape(-1)[address.byte_offset:
                                                    address.byte_offset + 8 * MAP_WORDS]


def _tensor_map_store_python(scratch, words):
    if not isinstance(scratch, _SharedAddress) or scratch.byte_offset % 128:
        raise ValueError(f"a map is stored at a 128-byte aligned shared address; got {scratch!r}")
    _words_at(scratch).view(np.uint64)[:] = [int(w) for w in words]


def _scratch_addresses():
    return sim_warp.block_state("tensor_map_addresses", dict)


def _tensor_map_address_python(scratch, address):
    if not isinstance(address, _GlobalAddress):
        raise TypeError(f"a map takes a global address; got {address!r}")
    _scratch_addresses()[(id(scratch.array), scratch.byte_offset)] = address


def _tensor_map_rows_python(scratch, rows):
    if not 1 <= rows < 1 << 32:
        raise ValueError(f"a map's dimension has 1 to 2**32 - 1 elements; got {rows}")
    _words_at(scratch).view(np.uint64)[5] = rows  # (the twin's dims: words 3-6)


def _tensor_map_publish_python(slot, scratch):
    if not isinstance(slot, _GlobalAddress) or slot.byte_offset % 128:
        raise ValueError(f"a map slot is a 128-byte aligned global address; got {slot!r}")
    words = _words_at(scratch).view(np.uint64).copy()
    address = _scratch_addresses().get((id(scratch.array), scratch.byte_offset))
    if address is None or words[1] != _SIMULATED_MAP:
        raise RuntimeError("publishing a map that was not stored and given an address")
    sim_warp.warp_barrier()  # (.sync.aligned: the warp's threads meet)
    _words_at(slot).view(np.uint64)[:] = words
    with _PUBLISHED_LOCK:
        _PUBLISHED.setdefault(slot.array, {})[slot.byte_offset] = (words, address)


def _published(slot):
    with _PUBLISHED_LOCK:
        return _PUBLISHED.get(slot.array, {}).get(slot.byte_offset)


def _tensor_map_acquire_python(slot):
    if _published(slot) is None:
        raise RuntimeError(f"acquiring a map slot nothing was published to: {slot!r}")
    sim_warp.thread_state("tensor_maps_acquired", set).add((id(slot.array), slot.byte_offset))


def _map_slot_python(maps, index):
    if not maps.flags.c_contiguous or maps.shape[1] != MAP_WORDS:
        raise ValueError(f"map slots are a C-contiguous (slots, {MAP_WORDS}) array")
    return _GlobalAddress(maps, int(index) * maps.strides[0])


def _tensor_copy_4d_python(destination, slot, c0, c1, c2, c3, barrier):
    acquired = sim_warp.thread_state("tensor_maps_acquired", set)
    if (id(slot.array), slot.byte_offset) not in acquired:
        raise RuntimeError("a copy through a map this thread has not acquired")
    words, address = _published(slot)
    if not np.array_equal(words, _words_at(slot).view(np.uint64)):
        raise RuntimeError("the map slot changed since it was published")
    if destination.byte_offset % 1024:
        raise ValueError(f"the 128-byte swizzle needs a 1024-byte aligned destination; got "
                         f"byte {destination.byte_offset}")
    itemsize = int(words[2])
    dims, steps, box = words[3:7].astype(int), words[7:10].astype(int), words[10:14].astype(int)
    memory = address.array.reshape(-1).view(np.uint8)
    row_items, rows = int(box[0]), int(box[2])
    values = np.zeros((rows, BOX_ROW_BYTES), np.uint8)
    inside = (0 <= c1 < dims[1]) and (0 <= c3 < dims[3])
    for r in range(rows):
        row = c2 + r
        if not (inside and 0 <= row < dims[2]):
            continue
        start = address.byte_offset + c1 * steps[0] + row * steps[1] + c3 * steps[2]
        for i in range(row_items):
            if 0 <= c0 + i < dims[0]:
                at = start + (c0 + i) * itemsize
                values[r, i * itemsize:(i + 1) * itemsize] = memory[at:at + itemsize]
    swizzled = np.empty_like(values)
    for r in range(rows):
        chunks = values[r].reshape(8, 16)
        swizzled[r].reshape(8, 16)[[j ^ (r % 8) for j in range(8)]] = chunks
    size = rows * BOX_ROW_BYTES
    target = destination.array.view(np.uint8).reshape(-1)[destination.byte_offset:
                                                          destination.byte_offset + size]
    target[:] = 0xFF  # (NaN patterns until the barrier's phase completes)
    complete_transaction(barrier, size, (target, swizzled.reshape(-1)))


if SIMULATED:
    tensor_map_store, tensor_map_address = _tensor_map_store_python, _tensor_map_address_python
    tensor_map_rows = _tensor_map_rows_python
    tensor_map_publish, tensor_map_acquire = _tensor_map_publish_python, _tensor_map_acquire_python
    map_slot, tensor_copy_4d = _map_slot_python, _tensor_copy_4d_python
else:
    tensor_map_store, tensor_map_address = _tensor_map_store, _tensor_map_address
    tensor_map_rows = _tensor_map_rows
    tensor_map_publish, tensor_map_acquire = _tensor_map_publish, _tensor_map_acquire
    map_slot, tensor_copy_4d = _map_slot, _tensor_copy_4d
    name_for_cache(globals(), __name__)
