"""A uint32's bits as a float32 (LLVM's bitcast: no instruction, and nothing the optimiser
cannot see through, unlike inline PTX), with its simulator twin."""
import numpy as np
from numba import types
from numba.cuda.extending import intrinsic

from ._llvm import SIMULATED, f32, name_for_cache


@intrinsic
def _float32_from_bits(typingctx, bits):
    sig = types.float32(bits)

    def codegen(context, builder, sig, args):
        value = context.cast(builder, args[0], sig.args[0], types.uint32)
        return builder.bitcast(value, f32())

    return sig, codegen


def _float32_from_bits_python(bits):
    return np.array([int(bits) & 0xFFFFFFFF], np.uint32).view(np.float32)[0]


if SIMULATED:
    float32_from_bits = _float32_from_bits_python
else:
    float32_from_bits = _float32_from_bits
    name_for_cache(globals(), __name__)
