"""Device intrinsics that Numba has no API for, each with a pure-Python twin for the simulator.

Under NUMBA_ENABLE_CUDASIM=1 kernels run as Python, where an @intrinsic cannot be called, so
every public name here is bound at import time to either the compiled intrinsic (PTX through
llvmlite inline assembly) or its Python twin; kernels call the name and run unchanged in both.

Warp-collective twins (mma, ldmatrix, shuffles) exchange lane values through block barriers
(numba_flash._sim_warp), so in kernels they must be called by every thread of the block
together, like syncthreads(); the syncwarp twin waits for the lanes of the caller's warp
only, as on the GPU. The cp.async twin keeps each thread's copies in flight
(their bytes NaN) until a cp_async_wait covers them, as the hardware may.

Register fragments of f16/bf16 data are uint32 holding two 16-bit values, the first element
in the low half. Fragment layouts of mma.m16n8k16 (PTX ISA, "Matrix Fragments for
mma.m16n8k16"), with g = lane // 4 and t = lane % 4:
    A (16x16, row-major): a0 = A[g, 2t:2t+2]  a1 = A[g+8, 2t:2t+2]
                          a2 = A[g, 2t+8:2t+10]  a3 = A[g+8, 2t+8:2t+10]
    B (16x8, K x N):      b0 = B[2t:2t+2, g]  b1 = B[2t+8:2t+10, g]
    C, D (16x8, f32):     c0, c1 = C[g, 2t], C[g, 2t+1]   c2, c3 = C[g+8, 2t], C[g+8, 2t+1]

SHARED_ALIGN is the alignment to request for shared tiles read with 16-byte loads (the
simulator rejects any alignment argument, so it is None there).
"""
from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import config, types
from numba.core import cgutils
from numba.cuda.extending import intrinsic

from numba_flash import _sim_warp

SIMULATED = bool(config.ENABLE_CUDASIM)
SHARED_ALIGN = None if SIMULATED else 16


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


# -- helpers for writing intrinsics ----------------------------------------------------------------

_I32, _I64, _F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()


def _asm(builder, text, constraints, args, outputs=(), side_effect=False):
    """Call inline PTX; returns the list of output values (LLVM types in `outputs`)."""
    if len(outputs) == 0:
        ret = ir.VoidType()
    elif len(outputs) == 1:
        ret = outputs[0]
    else:
        ret = ir.LiteralStructType(list(outputs))
    fnty = ir.FunctionType(ret, [a.type for a in args])
    result = builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=side_effect), args)
    if len(outputs) <= 1:
        return [result] if outputs else []
    return [builder.extract_value(result, i) for i in range(len(outputs))]


def _array_and_indices(context, builder, array_type, array_value, index_types, index_values):
    array = context.make_array(array_type)(context, builder, array_value)
    return array, [context.cast(builder, v, t, types.intp)
                   for v, t in zip(index_values, index_types)]


def _element_address(context, builder, array_type, array_value, index_types, index_values):
    """Generic address (i64) of array[indices], without negative-index wraparound."""
    array, indices = _array_and_indices(context, builder, array_type, array_value, index_types,
                                        index_values)
    pointer = cgutils.get_item_pointer(context, builder, array_type, array, indices,
                                       wraparound=False)
    return builder.ptrtoint(pointer, _I64)


def _row_element_address(context, builder, array_type, array_value, index_types, index_values):
    """Generic address (i64) of array[indices] for an array whose last dimension is contiguous:
    the last index counts items, whatever stride the array type carries. A strided ("A") array
    then costs no more registers than a C-contiguous one: no per-thread product with a run-time
    stride is kept alive across the kernel's loop."""
    array, indices = _array_and_indices(context, builder, array_type, array_value, index_types,
                                        index_values)
    strides = cgutils.unpack_tuple(builder, array.strides, array_type.ndim)
    itemsize = context.get_abi_sizeof(context.get_data_type(array_type.dtype))
    offset = builder.mul(indices[-1], ir.Constant(_I64, itemsize))
    for index, stride in zip(indices[:-1], strides[:-1]):
        offset = builder.add(offset, builder.mul(index, stride))
    return builder.add(builder.ptrtoint(array.data, _I64), offset)


def _casts(context, builder, values, from_types, to_type):
    return [context.cast(builder, v, t, to_type) for v, t in zip(values, from_types)]


_SHARED_ADDRESS = "cvta.to.shared.u64 sa, {0}; cvt.u32.u64 s, sa;"


# -- mma.sync m16n8k16 -----------------------------------------------------------------------------

def _make_mma(input_type):
    text = (f"mma.sync.aligned.m16n8k16.row.col.f32.{input_type}.{input_type}.f32 "
            "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")

    @intrinsic
    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        sig = types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

        def codegen(context, builder, sig, args):
            regs = _casts(context, builder, args[:6], sig.args[:6], types.uint32)
            accs = _casts(context, builder, args[6:], sig.args[6:], types.float32)
            parts = _asm(builder, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", regs + accs,
                         outputs=[_F32] * 4)
            return context.make_tuple(builder, sig.return_type, parts)

        return sig, codegen

    return mma


def _mma_python(unpack):
    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        lanes = _sim_warp.warp_exchange((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))
        a = np.zeros((16, 16), np.float32)
        b = np.zeros((16, 8), np.float32)
        c = np.zeros((16, 8), np.float32)
        for lane, regs in enumerate(lanes):
            g, t = lane // 4, lane % 4
            a[g, 2 * t:2 * t + 2] = unpack(regs[0])
            a[g + 8, 2 * t:2 * t + 2] = unpack(regs[1])
            a[g, 2 * t + 8:2 * t + 10] = unpack(regs[2])
            a[g + 8, 2 * t + 8:2 * t + 10] = unpack(regs[3])
            b[2 * t:2 * t + 2, g] = unpack(regs[4])
            b[2 * t + 8:2 * t + 10, g] = unpack(regs[5])
            c[g, 2 * t:2 * t + 2] = regs[6:8]
            c[g + 8, 2 * t:2 * t + 2] = regs[8:10]
        d = a @ b + c
        g, t = _sim_warp.lane_id() // 4, _sim_warp.lane_id() % 4
        return (d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1])
    return mma


# -- f16x2 / bf16x2 packing ------------------------------------------------------------------------

def _make_pack(kind):
    text = f"cvt.rn.{kind}x2.f32 $0, $1, $2;"  # the first source goes to the upper half

    @intrinsic
    def pack(typingctx, lo, hi):
        sig = types.uint32(lo, hi)

        def codegen(context, builder, sig, args):
            lo_value, hi_value = _casts(context, builder, args, sig.args, types.float32)
            return _asm(builder, text, "=r,f,f", [hi_value, lo_value], outputs=[_I32])[0]

        return sig, codegen

    return pack


def _make_unpack(text):
    @intrinsic
    def unpack(typingctx, packed):
        sig = types.UniTuple(types.float32, 2)(packed)

        def codegen(context, builder, sig, args):
            value = context.cast(builder, args[0], sig.args[0], types.uint32)
            parts = _asm(builder, text, "=f,=f,r", [value], outputs=[_F32, _F32])
            return context.make_tuple(builder, sig.return_type, parts)

        return sig, codegen

    return unpack


_UNPACK_F16X2 = ("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                 "cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }")
_UNPACK_BF16X2 = ("{ .reg .b32 lo, hi; shl.b32 lo, $2, 16; and.b32 hi, $2, 0xffff0000; "
                  "mov.b32 $0, lo; mov.b32 $1, hi; }")  # bf16 is the top half of an f32


def _bits_to_f16x2(lo_bits, hi_bits):
    return np.uint32(int(lo_bits) | (int(hi_bits) << 16))


def _pack_f16x2_python(lo, hi):
    bits = np.array([lo, hi], np.float32).astype(np.float16).view(np.uint16)
    return _bits_to_f16x2(bits[0], bits[1])


def _unpack_f16x2_python(packed):
    packed = int(packed)
    halves = np.array([packed & 0xFFFF, packed >> 16], np.uint16).view(np.float16)
    return float(np.float32(halves[0])), float(np.float32(halves[1]))


def _to_bf16_bits(x):
    """float32 -> bfloat16 bits, rounding to nearest even (as cvt.rn.bf16x2.f32)."""
    bits = int(np.array([x], np.float32).view(np.uint32)[0])
    if np.isnan(np.float32(x)):
        return (bits >> 16) | 0x40
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def _pack_bf16x2_python(lo, hi):
    return _bits_to_f16x2(_to_bf16_bits(lo), _to_bf16_bits(hi))


def _unpack_bf16x2_python(packed):
    packed = int(packed)
    words = np.array([(packed & 0xFFFF) << 16, packed & 0xFFFF0000], np.uint32)
    lo, hi = words.view(np.float32)
    return float(lo), float(hi)


# -- ldmatrix --------------------------------------------------------------------------------------

def _make_ldmatrix(transpose):
    text = ("{ .reg .u64 sa; .reg .u32 s; " + _SHARED_ADDRESS.format("$4") +
            f" ldmatrix.sync.aligned.m8n8.x4{'.trans' if transpose else ''}.shared.b16 "
            "{$0,$1,$2,$3}, [s]; }")

    @intrinsic
    def ldmatrix(typingctx, array, row, col):
        if not (isinstance(array, types.Array) and array.ndim == 2 and
                array.dtype.bitwidth == 16):
            return None
        sig = types.UniTuple(types.uint32, 4)(array, row, col)

        def codegen(context, builder, sig, args):
            address = _element_address(context, builder, sig.args[0], args[0], sig.args[1:],
                                       args[1:])
            parts = _asm(builder, text, "=r,=r,=r,=r,l", [address], outputs=[_I32] * 4,
                         side_effect=True)
            return context.make_tuple(builder, sig.return_type, parts)

        return sig, codegen

    return ldmatrix


# ldmatrix in a loop, from a 32-bit shared address plus a constant offset. With a (tile, row,
# col) address, every distinct address in a loop body is loop-invariant, so LLVM computes each
# once before the loop and keeps it in a register (dozens of them); ptxas cannot then fold the
# constant parts into the instruction's [register + immediate] form. A kernel instead takes
# each lane's address once (shared_address), passes it through `opaque` at the top of every
# iteration (nothing derived from it can move out of the loop), and reads at address +
# offset: one register per tile, the offsets immediates.

_LDMATRIX_AT = ("ldmatrix.sync.aligned.m8n8.x4{0}.shared.b16 {{$0,$1,$2,$3}}, [$4];")


@intrinsic
def _shared_address(typingctx, array, row, col):
    """The 32-bit shared-state-space address of array[row, col], for ldmatrix_x4_at: the array
    must be in shared memory (a 2-d tile of 16-bit elements). Why kernels read at an address
    plus an offset instead of at (tile, row, col): the comment above _LDMATRIX_AT."""
    if not (isinstance(array, types.Array) and array.ndim == 2 and array.dtype.bitwidth == 16):
        return None
    sig = types.uint32(array, row, col)

    def codegen(context, builder, sig, args):
        address = _element_address(context, builder, sig.args[0], args[0], sig.args[1:],
                                   args[1:])
        return _asm(builder, "{ .reg .u64 sa; cvta.to.shared.u64 sa, $1; cvt.u32.u64 $0, sa; }",
                    "=r,l", [address], outputs=[_I32])[0]

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
        return _asm(builder, "mov.b32 $0, $1;", "=r,r", [value], outputs=[_I32],
                    side_effect=True)[0]

    return sig, codegen


def _make_ldmatrix_at(transpose):
    text = _LDMATRIX_AT.format(".trans" if transpose else "")

    @intrinsic
    def ldmatrix_at(typingctx, address, offset):
        """ldmatrix (x4) at shared address + offset bytes (offset: a constant once unrolled)."""
        if address != types.uint32 or not isinstance(offset, types.Integer):
            return None
        sig = types.UniTuple(types.uint32, 4)(address, offset)

        def codegen(context, builder, sig, args):
            offset = context.cast(builder, args[1], sig.args[1], types.uint32)
            parts = _asm(builder, text, "=r,=r,=r,=r,r", [builder.add(args[0], offset)],
                         outputs=[_I32] * 4, side_effect=True)
            return context.make_tuple(builder, sig.return_type, parts)

        return sig, codegen

    return ldmatrix_at


class _SharedAddress(NamedTuple):
    """The simulator's shared address: the array and a byte offset into it; adding an integer
    moves it by that many bytes, as on the device."""
    array: object
    byte_offset: int

    def __add__(self, offset):
        return _SharedAddress(self.array, self.byte_offset + int(offset))

    __radd__ = __add__


def _shared_address_python(array, row, col):
    return _SharedAddress(array, row * array.strides[0] + col * array.strides[1])


def _opaque_python(value):
    return value


def _ldmatrix_at_python(transpose):
    ldmatrix = _ldmatrix_python(transpose)

    def ldmatrix_at(address, offset):
        """The hardware needs a 16-byte aligned address in the tile; so does the twin."""
        array = address.array
        row, rest = divmod(address.byte_offset + offset, array.strides[0])
        col, odd = divmod(rest, array.strides[1])
        if odd or not (0 <= row < array.shape[0] and col + 8 <= array.shape[1]):
            raise ValueError(f"ldmatrix at byte {address.byte_offset + offset} is not the start "
                             f"of 8 elements of a row of the {array.shape} tile")
        return ldmatrix(array, row, col)
    return ldmatrix_at


def _check_aligned(array, *index):
    """The hardware needs 16-byte aligned addresses here; the simulator would not notice."""
    address = array.ctypes.data + sum(i * s for i, s in zip(index, array.strides))
    if address % 16:
        raise ValueError(f"address of element {index} is not 16-byte aligned")


def _ldmatrix_python(transpose):
    def ldmatrix(array, row, col):
        """Four 8x8 b16 matrices; lane l gives the address of row l % 8 of matrix l // 8."""
        _check_aligned(array, row, col)
        own_row = np.ascontiguousarray(array[row, col:col + 8]).view(np.uint16).copy()
        rows = _sim_warp.warp_exchange(own_row)
        lane = _sim_warp.lane_id()
        g, t = lane // 4, lane % 4
        regs = []
        for matrix in range(4):
            m = rows[8 * matrix:8 * matrix + 8]
            if transpose:
                regs.append(_bits_to_f16x2(m[2 * t][g], m[2 * t + 1][g]))
            else:
                regs.append(_bits_to_f16x2(m[g][2 * t], m[g][2 * t + 1]))
        return tuple(regs)
    return ldmatrix


# -- cp.async (16 bytes, global -> shared) ---------------------------------------------------------

_CP_ASYNC = ("{ .reg .u64 sa, ga; .reg .u32 s; " + _SHARED_ADDRESS.format("$0") +
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
        dst_address = _element_address(context, builder, sig.args[0], args[0], sig.args[1:3],
                                       args[1:3])
        src_address = _row_element_address(context, builder, sig.args[3], args[3],
                                           sig.args[4:8], args[4:8])
        size = context.cast(builder, args[8], sig.args[8], types.uint32)
        _asm(builder, _CP_ASYNC, "l,l,r,~{memory}", [dst_address, src_address, size],
             side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


def _cp_async_16_python(dst, drow, dcol, src, b, n, h, d, src_bytes):
    """Copy src_bytes (0..16) and zero-fill the rest of the 16 bytes, as cp.async does, but
    only when a cp_async_wait covers the copy: until then the 16 bytes hold NaN patterns, so a
    kernel that reads a tile before waiting for it computes garbage in the simulator too."""
    _check_aligned(dst, drow, dcol)
    _check_aligned(src, b, n, h, d)
    if not 0 <= src_bytes <= 16:
        raise ValueError(f"src_bytes must be in 0..16; got {src_bytes}")
    count, copied = 16 // dst.itemsize, src_bytes // dst.itemsize
    values = np.zeros(count, dst.dtype)
    values[:copied] = src[b, n, h, d:d + copied]  # (read at issue, as the hardware may)
    dst[drow, dcol:dcol + count].view(_NOT_YET_COPIED[dst.itemsize].dtype)[:] = \
        _NOT_YET_COPIED[dst.itemsize]
    _sim_warp.thread_state("cp_async_issued", list).append((dst, drow, dcol, values))


# In flight: float NaN; for 16-bit patterns 0xFFFF, a NaN in float16 and in bfloat16.
_NOT_YET_COPIED = {4: np.float32(np.nan).view(np.uint32), 2: np.uint16(0xFFFF)}


@intrinsic
def _cp_async_commit(typingctx):
    sig = types.void()

    def codegen(context, builder, sig, args):
        _asm(builder, "cp.async.commit_group;", "~{memory}", [], side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _cp_async_wait(typingctx, pending):
    """Wait until at most `pending` (a literal int) committed groups are still in flight."""
    if not isinstance(pending, types.IntegerLiteral):
        return None
    text = f"cp.async.wait_group {pending.literal_value};"
    sig = types.void(pending)

    def codegen(context, builder, sig, args):
        _asm(builder, text, "~{memory}", [], side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


def _cp_async_commit_python():
    """Close the group of this thread's copies issued since its last commit."""
    issued = _sim_warp.thread_state("cp_async_issued", list)
    _sim_warp.thread_state("cp_async_groups", list).append(issued[:])
    issued.clear()


def _cp_async_wait_python(pending):
    """Land this thread's committed groups but the newest `pending` ones."""
    groups = _sim_warp.thread_state("cp_async_groups", list)
    while len(groups) > pending:
        for dst, drow, dcol, values in groups.pop(0):
            dst[drow, dcol:dcol + len(values)] = values


# -- warp shuffle ----------------------------------------------------------------------------------

def _shfl_xor_python(value, lane_mask):
    values = _sim_warp.warp_exchange(value)
    return values[_sim_warp.lane_id() ^ lane_mask]


def _make_shfl_xor():
    from numba import cuda

    @cuda.jit(device=True, inline="always")
    def shfl_xor(value, lane_mask):
        return cuda.shfl_xor_sync(0xFFFFFFFF, value, lane_mask)

    return shfl_xor


# -- warp barrier ----------------------------------------------------------------------------------

def _make_syncwarp():
    from numba import cuda

    @cuda.jit(device=True, inline="always")
    def syncwarp():
        cuda.syncwarp(0xFFFFFFFF)

    return syncwarp


# -- tiles of dynamic shared memory ---------------------------------------------------------------

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
        data = builder.bitcast(builder.gep(byte_pointer, [ir.Constant(_I64, start)]),
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


# -- exp2 ------------------------------------------------------------------------------------------

@intrinsic
def _exp2(typingctx, x):
    """2**x by ex2.approx.ftz.f32. math.exp2 gives ex2.approx.f32 without .ftz, which ptxas
    wraps in a denormal fix-up (a compare, two multiplies and a select around each MUFU.EX2);
    softmax terms below 2**-126 count for nothing next to the row's largest term, which is 1."""
    sig = types.float32(x)

    def codegen(context, builder, sig, args):
        value = context.cast(builder, args[0], sig.args[0], types.float32)
        return _asm(builder, "ex2.approx.ftz.f32 $0, $1;", "=f,f", [value], outputs=[_F32])[0]

    return sig, codegen


_FLT_MIN = np.float32(2.0 ** -126)


def _exp2_python(x):
    with np.errstate(over="ignore"):
        y = np.exp2(np.float32(x))
    return np.float32(0.0) if y < _FLT_MIN else y


# -- the public names ------------------------------------------------------------------------------

if SIMULATED:
    load_f32x4 = _load_f32x4_python
    mma_f16 = _mma_python(_unpack_f16x2_python)
    mma_bf16 = _mma_python(_unpack_bf16x2_python)
    pack_f16x2, unpack_f16x2 = _pack_f16x2_python, _unpack_f16x2_python
    pack_bf16x2, unpack_bf16x2 = _pack_bf16x2_python, _unpack_bf16x2_python
    ldmatrix_x4 = _ldmatrix_python(transpose=False)
    ldmatrix_x4_trans = _ldmatrix_python(transpose=True)
    shared_address, opaque = _shared_address_python, _opaque_python
    ldmatrix_x4_at = _ldmatrix_at_python(transpose=False)
    ldmatrix_x4_trans_at = _ldmatrix_at_python(transpose=True)
    cp_async_16 = _cp_async_16_python
    cp_async_commit, cp_async_wait = _cp_async_commit_python, _cp_async_wait_python
    shfl_xor = _shfl_xor_python
    syncwarp = _sim_warp.warp_barrier
    exp2 = _exp2_python
    shared_tile = _shared_tile_python
else:
    load_f32x4 = _load_f32x4
    mma_f16 = _make_mma("f16")
    mma_bf16 = _make_mma("bf16")
    pack_f16x2, unpack_f16x2 = _make_pack("f16"), _make_unpack(_UNPACK_F16X2)
    pack_bf16x2, unpack_bf16x2 = _make_pack("bf16"), _make_unpack(_UNPACK_BF16X2)
    ldmatrix_x4 = _make_ldmatrix(transpose=False)
    ldmatrix_x4_trans = _make_ldmatrix(transpose=True)
    shared_address, opaque = _shared_address, _opaque
    ldmatrix_x4_at = _make_ldmatrix_at(transpose=False)
    ldmatrix_x4_trans_at = _make_ldmatrix_at(transpose=True)
    cp_async_16 = _cp_async_16
    cp_async_commit, cp_async_wait = _cp_async_commit, _cp_async_wait
    shfl_xor = _make_shfl_xor()
    syncwarp = _make_syncwarp()
    exp2 = _exp2
    shared_tile = _shared_tile


def _name_intrinsics_for_the_cache():
    """Numba's on-disk cache finds a kernel by a hash of its pickled closure, and an @intrinsic
    pickles with a uuid drawn at random in each process unless one is set: every kernel that
    reaches one of these (through a device function or a closure variable) would then miss the
    cache in each new process. Each gets its import path as its uuid instead."""
    named = {}
    for name, value in globals().items():
        if hasattr(value, "_set_uuid") and id(value) not in named:
            value._set_uuid(f"{__name__}.{name}")
            named[id(value)] = name


if not SIMULATED:
    _name_intrinsics_for_the_cache()
