"""1 / x as rcp.approx.ftz.f32 (one MUFU.RCP), with its simulator twin."""
import numpy as np
from numba import types
from numba.cuda.extending import intrinsic

from ._llvm import SIMULATED, asm, f32, name_for_cache


@intrinsic
def _reciprocal(typingctx, x):
    """1 / x within one unit in the last place, where a float32 division (div.rn.f32) is a
    reciprocal, two fused multiply-adds and a slow path for large or tiny divisors; results
    below 2**-126 are flushed to zero, 1 / inf is 0."""
    sig = types.float32(x)

    def codegen(context, builder, sig, args):
        value = context.cast(builder, args[0], sig.args[0], types.float32)
        return asm(builder, "rcp.approx.ftz.f32 $0, $1;", "=f,f", [value], outputs=[f32()])[0]

    return sig, codegen


_FLT_MIN = np.float32(2.0 ** -126)


def _reciprocal_python(x):
    with np.errstate(divide="ignore", over="ignore"):
        y = np.float32(1.0) / np.float32(x)
    return np.copysign(np.float32(0.0), y) if abs(y) < _FLT_MIN else y  # (ftz keeps the sign)


if SIMULATED:
    reciprocal = _reciprocal_python
else:
    reciprocal = _reciprocal
    name_for_cache(globals(), __name__)
