"""cp.async (16 bytes, global to shared: from an array element to a tile element, or from a
global address to a 32-bit shared address) with its commit and wait, and their simulator
twins. The twin keeps each thread's copies in flight
(their bytes NaN) until a cp_async_wait covers them, as the hardware may."""
from typing import NamedTuple

import numpy as np
from numba import types
from numba.cuda.extending import intrinsic

from . import sim_warp
from ._llvm import (SHARED_ADDRESS, SIMULATED, asm, element_address, i64,
                    literal_instruction, name_for_cache, row_element_address, void_instruction)
from .shared import _SharedAddress

_CP_ASYNC = ("{ .reg .u64 sa, ga; .reg .u32 s; " + SHARED_ADDRESS.format("$0") +
             " cvta.to.global.u64 ga, $1; cp.async.cg.shared.global [s], [ga], 16, $2; }")


@intrinsic
def _cp_async_16(typingctx, dst, drow, dcol, src, b, n, h, d, src_bytes):
    """Copy 16 bytes from &src[b, n, h, d] to &dst[drow, dcol]; with src_bytes = 0 the
    destination is zero-filled instead (tails). Both addresses must be 16-byte aligned, and
    src's last dimension must be contiguous (its stride is taken to be the item size)."""
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array) and dst.ndim == 2 and
            src.ndim == 4):
        return None
    sig = types.void(dst, drow, dcol, src, b, n, h, d, src_bytes)

    def codegen(context, builder, sig, args):
        dst_address = element_address(context, builder, sig.args[0], args[0], sig.args[1:3],
                                      args[1:3])
        src_address = row_element_address(context, builder, sig.args[3], args[3],
                                          sig.args[4:8], args[4:8])
        size = context.cast(builder, args[8], sig.args[8], types.uint32)
        asm(builder, _CP_ASYNC, "l,l,r,~{memory}", [dst_address, src_address, size],
            side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _global_address(typingctx, src, b, n, h, d):
    """The address of src[b, n, h, d] (a 4-D array whose last dimension is contiguous) as a
    uint64, for cp_async_16_from."""
    if not (isinstance(src, types.Array) and src.ndim == 4):
        return None
    sig = types.uint64(src, b, n, h, d)

    def codegen(context, builder, sig, args):
        return row_element_address(context, builder, sig.args[0], args[0], sig.args[1:],
                                   args[1:])

    return sig, codegen


@intrinsic
def _advance(typingctx, address, byte_count):
    """A global address (global_address) plus byte_count, as a uint64 from an instruction the
    compiler may neither move nor look through (so that a loop of copies keeps one address
    and adds to it, instead of holding one address per copy)."""
    sig = types.uint64(address, byte_count)

    def codegen(context, builder, sig, args):
        values = [context.cast(builder, value, type_, types.uint64)
                  for value, type_ in zip(args, sig.args)]
        return asm(builder, "add.u64 $0, $1, $2;", "=l,l,l", values, outputs=[i64()],
                   side_effect=True)[0]

    return sig, codegen


_CP_ASYNC_FROM = ("{ .reg .u64 ga; cvta.to.global.u64 ga, $1; "
                  "cp.async.cg.shared.global [$0], [ga], 16, $2; }")


@intrinsic
def _cp_async_16_from(typingctx, address, source, src_bytes):
    """cp_async_16 from a global address (global_address, 16-byte aligned) to a 32-bit shared
    address (16-byte aligned)."""
    sig = types.void(address, source, src_bytes)

    def codegen(context, builder, sig, args):
        destination = context.cast(builder, args[0], sig.args[0], types.uint32)
        source = context.cast(builder, args[1], sig.args[1], types.uint64)
        size = context.cast(builder, args[2], sig.args[2], types.uint32)
        asm(builder, _CP_ASYNC_FROM, "r,l,r,~{memory}", [destination, source, size],
            side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


def _source_bytes(src, b, n, h, d, src_bytes, itemsize):
    """The 16 bytes a copy lands: src_bytes of src[b, n, h, d:], then zeros."""
    sim_warp.check_aligned(src, b, n, h, d)
    if not 0 <= src_bytes <= 16:
        raise ValueError(f"src_bytes must be in 0..16; got {src_bytes}")
    values = np.zeros(16 // itemsize, src.dtype)
    copied = src_bytes // itemsize
    values[:copied] = src[b, n, h, d:d + copied]  # (read at issue, as the hardware may)
    return values


def _cp_async_16_python(dst, drow, dcol, src, b, n, h, d, src_bytes):
    """Copy src_bytes (0..16) and zero-fill the rest of the 16 bytes, as cp.async does, but
    only when a cp_async_wait covers the copy: until then the 16 bytes hold NaN patterns, so a
    kernel that reads a tile before waiting for it computes garbage in the simulator too."""
    sim_warp.check_aligned(dst, drow, dcol)
    values = _source_bytes(src, b, n, h, d, src_bytes, dst.itemsize)
    target = dst[drow, dcol:dcol + len(values)]
    target.view(_NOT_YET_COPIED[dst.itemsize].dtype)[:] = _NOT_YET_COPIED[dst.itemsize]
    sim_warp.thread_state("cp_async_issued", list).append((target, values))


class _GlobalAddress(NamedTuple):
    """The simulator's global address: a C-contiguous array (the simulator hands kernels whole
    buffers) and a byte offset into it; adding an integer moves it by that many bytes."""
    array: object
    byte_offset: int

    def __add__(self, offset):
        return _GlobalAddress(self.array, self.byte_offset + int(offset))

    __radd__ = __add__


def _global_address_python(src, b, n, h, d):
    if not src.flags.c_contiguous:
        raise ValueError("the simulator's global addresses are into C-contiguous arrays")
    return _GlobalAddress(src, sum(int(i) * s for i, s in zip((b, n, h, d), src.strides)))


def _advance_python(address, byte_count):
    if not isinstance(address, _GlobalAddress):
        raise TypeError(f"advance takes a global address; got {address!r}")
    return address + byte_count


def _cp_async_16_from_python(address, source, src_bytes):
    if not isinstance(address, _SharedAddress) or not isinstance(source, _GlobalAddress):
        raise TypeError(f"cp_async_16_from takes a shared and a global address; got "
                        f"{address!r}, {source!r}")
    if address.byte_offset % 16 or source.byte_offset % 16:
        raise ValueError(f"shared byte {address.byte_offset} or global byte "
                         f"{source.byte_offset} is not 16-byte aligned")
    if not 0 <= src_bytes <= 16:
        raise ValueError(f"src_bytes must be in 0..16; got {src_bytes}")
    memory = source.array.reshape(-1).view(np.uint8)
    values = np.zeros(16, np.uint8)
    values[:src_bytes] = memory[source.byte_offset:source.byte_offset + src_bytes]
    target = address.array.view(np.uint8).reshape(-1)[address.byte_offset:
                                                      address.byte_offset + 16]
    target[:] = 0xFF  # (NaN patterns in flight)
    sim_warp.thread_state("cp_async_issued", list).append((target, values))


# In flight: float NaN; for 16-bit patterns 0xFFFF, a NaN in float16 and in bfloat16.
_NOT_YET_COPIED = {4: np.float32(np.nan).view(np.uint32), 2: np.uint16(0xFFFF)}


_cp_async_commit = void_instruction("cp.async.commit_group;")
#: wait until at most `pending` (a literal int) committed groups are still in flight
_cp_async_wait = literal_instruction(lambda pending: f"cp.async.wait_group {pending};")


def _cp_async_commit_python():
    """Close the group of this thread's copies issued since its last commit."""
    issued = sim_warp.thread_state("cp_async_issued", list)
    sim_warp.thread_state("cp_async_groups", list).append(issued[:])
    issued.clear()


def _cp_async_wait_python(pending):
    """Land this thread's committed groups but the newest `pending` ones."""
    groups = sim_warp.thread_state("cp_async_groups", list)
    while len(groups) > pending:
        for target, values in groups.pop(0):
            target[:] = values


if SIMULATED:
    cp_async_16 = _cp_async_16_python
    global_address, advance = _global_address_python, _advance_python
    cp_async_16_from = _cp_async_16_from_python
    cp_async_commit, cp_async_wait = _cp_async_commit_python, _cp_async_wait_python
else:
    cp_async_16 = _cp_async_16
    global_address, advance, cp_async_16_from = _global_address, _advance, _cp_async_16_from
    cp_async_commit, cp_async_wait = _cp_async_commit, _cp_async_wait
    name_for_cache(globals(), __name__)
