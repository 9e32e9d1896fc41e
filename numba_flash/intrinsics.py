"""Device intrinsics that Numba has no API for, each with a pure-Python twin for the simulator.

Under NUMBA_ENABLE_CUDASIM=1 kernels run as Python, where an @intrinsic cannot be called, so
every name here is bound at import time to either the compiled intrinsic or its Python twin;
the kernels call the name and run unchanged in both worlds.

SHARED_ALIGN is the alignment to request for shared tiles read with load_f32x4 (the simulator
rejects any alignment argument, so it is None there).
"""
from numba import config, types
from numba.core import cgutils
from numba.cuda.extending import intrinsic
from llvmlite import ir

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


load_f32x4 = _load_f32x4_python if SIMULATED else _load_f32x4
