"""A uint32's bits as a float32 and back (LLVM's bitcast: no instruction, and nothing the
optimiser cannot see through, unlike inline PTX), with their simulator twins."""
import numpy as np
from numba import types
from numba.cuda.extending import intrinsic

from ._llvm import SIMULATED, f32, i32, name_for_cache


@intrinsic
def _float32_from_bits(typingctx, bits):
    sig = types.float32(bits)

    def codegen(context, builder, sig, args):
        value = context.cast(builder, args[0], sig.args[0], types.uint32)
        return builder.bitcast(value, f32())

    return sig, codegen


@intrinsic
def _bits_of_float32(typingctx, value):
    """The bits of a float32 (e.g. two 16-bit values a 4-byte load brought) as a uint32."""
    if value != types.float32:
        return None
    sig = types.uint32(value)

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], i32())

    return sig, codegen


def _float32_from_bits_python(bits):
    return np.array([int(bits) & 0xFFFFFFFF], np.uint32).view(np.float32)[0]


def _bits_of_float32_python(value):
    return np.array([value], np.float32).view(np.uint32)[0]


if SIMULATED:
    float32_from_bits, bits_of_float32 = _float32_from_bits_python, _bits_of_float32_python
else:
    float32_from_bits, bits_of_float32 = _float32_from_bits, _bits_of_float32
    name_for_cache(globals(), __name__)
