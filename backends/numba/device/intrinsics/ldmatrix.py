"""ldmatrix (.x4, plain and .trans) from a (tile, row, col) address or from a 32-bit shared
address plus a constant offset, with their simulator twins (which exchange rows among the
warp's lanes: every lane of the warp calls them together)."""
import numpy as np
from numba import types
from numba.cuda.extending import intrinsic

from . import sim_warp
from ._llvm import SHARED_ADDRESS, SIMULATED, asm, element_address, i32, name_for_cache
from .mma import _bits_to_f16x2


def _make_ldmatrix(transpose):
    text = ("{ .reg .u64 sa; .reg .u32 s; " + SHARED_ADDRESS.format("$4") +
            f" ldmatrix.sync.aligned.m8n8.x4{'.trans' if transpose else ''}.shared.b16 "
            "{$0,$1,$2,$3}, [s]; }")

    @intrinsic
    def ldmatrix(typingctx, array, row, col):
        if not (isinstance(array, types.Array) and array.ndim == 2 and
                array.dtype.bitwidth == 16):
            return None
        sig = types.UniTuple(types.uint32, 4)(array, row, col)

        def codegen(context, builder, sig, args):
            address = element_address(context, builder, sig.args[0], args[0], sig.args[1:],
                                      args[1:])
            parts = asm(builder, text, "=r,=r,=r,=r,l", [address], outputs=[i32()] * 4,
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
            parts = asm(builder, text, "=r,=r,=r,=r,r", [builder.add(args[0], offset)],
                        outputs=[i32()] * 4, side_effect=True)
            return context.make_tuple(builder, sig.return_type, parts)

        return sig, codegen

    return ldmatrix_at


def _ldmatrix_python(transpose):
    def ldmatrix(array, row, col):
        """Four 8x8 b16 matrices; lane l gives the address of row l % 8 of matrix l // 8."""
        sim_warp.check_aligned(array, row, col)
        own_row = np.ascontiguousarray(array[row, col:col + 8]).view(np.uint16).copy()
        rows = sim_warp.warp_exchange(own_row)
        lane = sim_warp.lane_id()
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


if SIMULATED:
    ldmatrix_x4 = _ldmatrix_python(transpose=False)
    ldmatrix_x4_trans = _ldmatrix_python(transpose=True)
    ldmatrix_x4_at = _ldmatrix_at_python(transpose=False)
    ldmatrix_x4_trans_at = _ldmatrix_at_python(transpose=True)
else:
    ldmatrix_x4 = _make_ldmatrix(transpose=False)
    ldmatrix_x4_trans = _make_ldmatrix(transpose=True)
    ldmatrix_x4_at = _make_ldmatrix_at(transpose=False)
    ldmatrix_x4_trans_at = _make_ldmatrix_at(transpose=True)
    name_for_cache(globals(), __name__)
