"""Shared-memory access Numba lacks: 16-byte float32 loads, tiles carved out of dynamic
shared memory, and 32-bit shared addresses: of an element (shared_address, opaque) for
ldmatrix_x4_at, of an array's start rounded up to an alignment (shared_base) for the Hopper
kernels' swizzled tiles and mbarriers."""
from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.cuda.extending import intrinsic

from ._llvm import SIMULATED, asm, element_address, i32, i64, name_for_cache


@intrinsic
def _load_f32x4(typingctx, array, row, col):
    """(array[row, col], ..., array[row, col + 3]) of a 2-D float32 array as one 16-byte load.

    The caller guarantees that &array[row, col] is 16-byte aligned (aligned array, row stride
    and col multiples of 4). Plain indexing cannot give this: Numba's negative-index wraparound
    keeps LLVM from merging the four loads into one `ld.shared.v4.f32`."""
    if not (isinstance(array, types.Array) and array.ndim == 2 and
            array.dtype == types.float32):
        return None
    sig = types.UniTuple(types.float32, 4)(array, row, col)

    def codegen(context, builder, sig, args):
        array_type, row_type, col_type = sig.args
        array_value = context.make_array(array_type)(context, builder, args[0])
        indices = [context.cast(builder, args[1], row_type, types.intp),
                   context.cast(builder, args[2], col_type, types.intp)]
        pointer = cgutils.get_item_pointer(context, builder, array_type, array_value, indices,
                                           wraparound=False)
        vector_type = ir.VectorType(ir.FloatType(), 4)
        vector = builder.load(builder.bitcast(pointer, vector_type.as_pointer()), align=16)
        parts = [builder.extract_element(vector, ir.Constant(ir.IntType(32), k))
                 for k in range(4)]
        return context.make_tuple(builder, sig.return_type, parts)

    return sig, codegen


def _load_f32x4_python(array, row, col):
    return (array[row, col], array[row, col + 1], array[row, col + 2], array[row, col + 3])


@intrinsic
def _shared_tile(typingctx, smem, offset, rows, cols, dtype):
    """The (rows, cols) C-order tile of `dtype` elements that starts `offset` bytes into a 1-D
    shared array (the kernel's dynamic shared memory), for literal offset, rows and cols.
    Numba's reshape of a slice would check sizes at run time and keep the shape in local
    memory; this view has a static shape and costs one address add."""
    literals = (offset, rows, cols)
    if not (isinstance(smem, types.Array) and smem.ndim == 1 and
            isinstance(dtype, types.NumberClass) and
            all(isinstance(x, types.IntegerLiteral) for x in literals)):
        return None
    start, n_rows, n_cols = (x.literal_value for x in literals)
    if start % 16:
        raise ValueError(f"shared_tile: offset {start} is not a multiple of 16 bytes")
    tile_type = types.Array(dtype.instance_type, 2, "C")
    sig = tile_type(smem, offset, rows, cols, dtype)

    def codegen(context, builder, sig, args):
        base = context.make_array(sig.args[0])(context, builder, args[0])
        tile = context.make_array(tile_type)(context, builder)
        itemsize = context.get_abi_sizeof(context.get_data_type(tile_type.dtype))
        byte_pointer = builder.bitcast(base.data, ir.IntType(8).as_pointer())
        data = builder.bitcast(builder.gep(byte_pointer, [ir.Constant(i64(), start)]),
                               tile.data.type)
        intp = lambda value: context.get_constant(types.intp, value)  # noqa: E731
        context.populate_array(tile, data=data, shape=[intp(n_rows), intp(n_cols)],
                               strides=[intp(n_cols * itemsize), intp(itemsize)],
                               itemsize=intp(itemsize), meminfo=None)
        return tile._getvalue()

    return sig, codegen


def _shared_tile_python(smem, offset, rows, cols, dtype):
    if offset % 16:
        raise ValueError(f"shared_tile: offset {offset} is not a multiple of 16 bytes")
    dtype = np.dtype(str(dtype))
    size = rows * cols * dtype.itemsize
    return smem.view(np.uint8)[offset:offset + size].view(dtype).reshape(rows, cols)


# Addresses for ldmatrix_x4_at: why kernels read at an address plus an offset, see the comment
# above ldmatrix._LDMATRIX_AT.

@intrinsic
def _shared_address(typingctx, array, row, col):
    """The 32-bit shared-state-space address of array[row, col], for ldmatrix_x4_at: the array
    must be in shared memory (a 2-d tile of 16-bit elements). Why kernels read at an address
    plus an offset instead of at (tile, row, col): the comment above ldmatrix._LDMATRIX_AT."""
    if not (isinstance(array, types.Array) and array.ndim == 2 and array.dtype.bitwidth == 16):
        return None
    sig = types.uint32(array, row, col)

    def codegen(context, builder, sig, args):
        address = element_address(context, builder, sig.args[0], args[0], sig.args[1:],
                                  args[1:])
        return asm(builder, "{ .reg .u64 sa; cvta.to.shared.u64 sa, $1; cvt.u32.u64 $0, sa; }",
                   "=r,l", [address], outputs=[i32()])[0]

    return sig, codegen


@intrinsic
def _opaque(typingctx, value):
    """value as uint32 (a shared address, possibly plus an offset: it must fit in 32 bits),
    from an instruction the compiler may neither move nor look through."""
    if not isinstance(value, types.Integer):
        return None
    sig = types.uint32(value)

    def codegen(context, builder, sig, args):
        value = context.cast(builder, args[0], sig.args[0], types.uint32)
        return asm(builder, "mov.b32 $0, $1;", "=r,r", [value], outputs=[i32()],
                   side_effect=True)[0]

    return sig, codegen


@intrinsic
def _shared_base(typingctx, array, alignment):
    """The 32-bit shared address of a shared array's first element, rounded up to a multiple
    of `alignment` (a literal power of two): a kernel that needs its dynamic shared memory
    aligned beyond what Numba declares asks for `alignment` more bytes and starts there."""
    if not (isinstance(array, types.Array) and isinstance(alignment, types.IntegerLiteral)):
        return None
    align = alignment.literal_value
    if align < 1 or align & (align - 1):
        raise ValueError(f"shared_base: alignment {align} is not a power of two")
    sig = types.uint32(array, alignment)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        text = ("{ .reg .u64 sa; .reg .u32 s; cvta.to.shared.u64 sa, $1; cvt.u32.u64 s, sa; "
                f"add.u32 s, s, {align - 1}; and.b32 $0, s, {-align & 0xFFFFFFFF}; }}")
        return asm(builder, text, "=r,l", [builder.ptrtoint(data, i64())], outputs=[i32()])[0]

    return sig, codegen


class _SharedAddress(NamedTuple):
    """The simulator's shared address: the array and a byte offset into it; adding an integer
    moves it by that many bytes, as on the device."""
    array: object
    byte_offset: int

    def __add__(self, offset):
        return _SharedAddress(self.array, self.byte_offset + int(offset))

    __radd__ = __add__

    def __sub__(self, other):
        """Bytes from `other` (an address in the same array) to this one, or this address
        moved back by `other` bytes."""
        if isinstance(other, _SharedAddress):
            if other.array is not self.array:
                raise ValueError("the distance between addresses in different shared arrays")
            return self.byte_offset - other.byte_offset
        return _SharedAddress(self.array, self.byte_offset - int(other))


def _shared_address_python(array, row, col):
    return _SharedAddress(array, row * array.strides[0] + col * array.strides[1])


def _opaque_python(value):
    """(The twin checks what the device would truncate: 32 bits.)"""
    if not (isinstance(value, _SharedAddress) or 0 <= int(value) < 2**32):
        raise ValueError(f"opaque takes a 32-bit value (a shared address); got {value!r}")
    return value


def _shared_base_python(array, alignment):
    """The simulator's array starts at every alignment: its addresses count bytes from it."""
    return _SharedAddress(array, 0)


if SIMULATED:
    load_f32x4 = _load_f32x4_python
    shared_tile = _shared_tile_python
    shared_address, opaque = _shared_address_python, _opaque_python
    shared_base = _shared_base_python
else:
    load_f32x4 = _load_f32x4
    shared_tile = _shared_tile
    shared_address, opaque = _shared_address, _opaque
    shared_base = _shared_base
    name_for_cache(globals(), __name__)
