"""mma.sync m16n8k16 (f16 and bf16 inputs, f32 accumulators) and the f16x2 / bf16x2 packing
of register fragments, with their simulator twins.

Register fragments of f16/bf16 data are uint32 holding two 16-bit values, the first element
in the low half. Fragment layouts of mma.m16n8k16 (PTX ISA, "Matrix Fragments for
mma.m16n8k16"), with g = lane // 4 and t = lane % 4:
    A (16x16, row-major): a0 = A[g, 2t:2t+2]  a1 = A[g+8, 2t:2t+2]
                          a2 = A[g, 2t+8:2t+10]  a3 = A[g+8, 2t+8:2t+10]
    B (16x8, K x N):      b0 = B[2t:2t+2, g]  b1 = B[2t+8:2t+10, g]
    C, D (16x8, f32):     c0, c1 = C[g, 2t], C[g, 2t+1]   c2, c3 = C[g+8, 2t], C[g+8, 2t+1]
The twin of mma exchanges the warp's fragments among its lanes (sim_warp), so in kernels it
must be called by every lane of the warp together, as on the GPU.
"""
import numpy as np
from numba import types
from numba.cuda.extending import intrinsic

from . import sim_warp
from ._llvm import SIMULATED, asm, casts, f32, i32, name_for_cache


def _make_mma(input_type):
    text = (f"mma.sync.aligned.m16n8k16.row.col.f32.{input_type}.{input_type}.f32 "
            "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")

    @intrinsic
    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        sig = types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

        def codegen(context, builder, sig, args):
            regs = casts(context, builder, args[:6], sig.args[:6], types.uint32)
            accs = casts(context, builder, args[6:], sig.args[6:], types.float32)
            parts = asm(builder, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", regs + accs,
                        outputs=[f32()] * 4)
            return context.make_tuple(builder, sig.return_type, parts)

        return sig, codegen

    return mma


def _mma_python(unpack):
    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        lanes = sim_warp.warp_exchange((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))
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
        g, t = sim_warp.lane_id() // 4, sim_warp.lane_id() % 4
        return (d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1])
    return mma


def _make_pack(kind):
    text = f"cvt.rn.{kind}x2.f32 $0, $1, $2;"  # the first source goes to the upper half

    @intrinsic
    def pack(typingctx, lo, hi):
        sig = types.uint32(lo, hi)

        def codegen(context, builder, sig, args):
            lo_value, hi_value = casts(context, builder, args, sig.args, types.float32)
            return asm(builder, text, "=r,f,f", [hi_value, lo_value], outputs=[i32()])[0]

        return sig, codegen

    return pack


def _make_unpack(text):
    @intrinsic
    def unpack(typingctx, packed):
        sig = types.UniTuple(types.float32, 2)(packed)

        def codegen(context, builder, sig, args):
            value = context.cast(builder, args[0], sig.args[0], types.uint32)
            parts = asm(builder, text, "=f,=f,r", [value], outputs=[f32(), f32()])
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


if SIMULATED:
    mma_f16 = _mma_python(_unpack_f16x2_python)
    mma_bf16 = _mma_python(_unpack_bf16x2_python)
    pack_f16x2, unpack_f16x2 = _pack_f16x2_python, _unpack_f16x2_python
    pack_bf16x2, unpack_bf16x2 = _pack_bf16x2_python, _unpack_bf16x2_python
else:
    mma_f16 = _make_mma("f16")
    mma_bf16 = _make_mma("bf16")
    pack_f16x2, unpack_f16x2 = _make_pack("f16"), _make_unpack(_UNPACK_F16X2)
    pack_bf16x2, unpack_bf16x2 = _make_pack("bf16"), _make_unpack(_UNPACK_BF16X2)
    name_for_cache(globals(), __name__)
