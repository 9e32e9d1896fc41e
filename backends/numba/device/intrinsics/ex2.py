"""exp2 as ex2.approx.ftz.f32, with its simulator twin."""
import numpy as np
from numba import types
from numba.cuda.extending import intrinsic

from ._llvm import SIMULATED, asm, f32, name_for_cache


@intrinsic
def _exp2(typingctx, x):
    """2**x by ex2.approx.ftz.f32. math.exp2 gives ex2.approx.f32 without .ftz, which ptxas
    wraps in a denormal fix-up (a compare, two multiplies and a select around each MUFU.EX2);
    softmax terms below 2**-126 count for nothing next to the row's largest term, which is 1."""
    sig = types.float32(x)

    def codegen(context, builder, sig, args):
        value = context.cast(builder, args[0], sig.args[0], types.float32)
        return asm(builder, "ex2.approx.ftz.f32 $0, $1;", "=f,f", [value], outputs=[f32()])[0]

    return sig, codegen


_FLT_MIN = np.float32(2.0 ** -126)


def _exp2_python(x):
    with np.errstate(over="ignore"):
        y = np.exp2(np.float32(x))
    return np.float32(0.0) if y < _FLT_MIN else y


if SIMULATED:
    exp2 = _exp2_python
else:
    exp2 = _exp2
    name_for_cache(globals(), __name__)
