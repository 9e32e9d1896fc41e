"""What every intrinsic module shares: inline-PTX and address helpers for codegen, whether
kernels run in the simulator, and the uuids that let Numba's on-disk cache find kernels that
reach an intrinsic."""
from llvmlite import ir
from numba import config, types
from numba.core import cgutils

SIMULATED = bool(config.ENABLE_CUDASIM)
#: the alignment to request for shared tiles read with 16-byte loads (the simulator rejects
#: any alignment argument)
SHARED_ALIGN = None if SIMULATED else 16


def i32():
    """A fresh LLVM i32 type. The codegen functions build their types when they run: a
    module-level type object would be pickled with the kernels that reach it (the closure hash
    of Numba's on-disk cache) and its pickle changes once it has been printed, so a kernel
    looked up before its first compilation would be saved under another key."""
    return ir.IntType(32)


def i64():
    return ir.IntType(64)


def f32():
    return ir.FloatType()


def asm(builder, text, constraints, args, outputs=(), side_effect=False):
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


def void_instruction(text):
    """An intrinsic of no arguments that emits `text` (an instruction the compiler keeps in
    place: side effects, memory clobbered)."""
    from numba.cuda.extending import intrinsic

    @intrinsic
    def instruction(typingctx):
        sig = types.void()

        def codegen(context, builder, sig, args):
            asm(builder, text, "~{memory}", [], side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    return instruction


def literal_instruction(make_text, check=None):
    """An intrinsic of one literal int argument n that emits make_text(n) (as
    void_instruction; check(n) may raise for a value the instruction does not take)."""
    from numba.cuda.extending import intrinsic

    @intrinsic
    def instruction(typingctx, literal):
        if not isinstance(literal, types.IntegerLiteral):
            return None
        if check is not None:
            check(literal.literal_value)
        text = make_text(literal.literal_value)
        sig = types.void(literal)

        def codegen(context, builder, sig, args):
            asm(builder, text, "~{memory}", [], side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    return instruction


def operand_instruction(text, kinds):
    """An intrinsic of len(kinds) arguments that emits `text` (a void instruction the
    compiler keeps in place, memory clobbered) with argument i cast to kinds[i] (a Numba
    integer type: uint32 a "r" operand, as shared addresses are; int32 too; uint64 an "l")."""
    from numba.cuda.extending import intrinsic
    constraints = ",".join("l" if kind.bitwidth == 64 else "r" for kind in kinds)

    def codegen(context, builder, sig, args):
        values = [context.cast(builder, value, type_, kind)
                  for value, type_, kind in zip(args, sig.args, kinds)]
        asm(builder, text, constraints + ",~{memory}", values, side_effect=True)
        return context.get_dummy_value()

    # (Numba lowers an intrinsic's *args as one tuple: one signature per arity taken)
    if len(kinds) == 1:
        def typer(typingctx, a):
            return types.void(a), codegen
    elif len(kinds) == 2:
        def typer(typingctx, a, b):
            return types.void(a, b), codegen
    elif len(kinds) == 7:
        def typer(typingctx, a, b, c, d, e, f, g):
            return types.void(a, b, c, d, e, f, g), codegen
    else:
        raise ValueError(f"operand_instruction takes 1, 2 or 7 operands; got {len(kinds)}")
    return intrinsic(typer)


def array_and_indices(context, builder, array_type, array_value, index_types, index_values):
    array = context.make_array(array_type)(context, builder, array_value)
    return array, [context.cast(builder, v, t, types.intp)
                   for v, t in zip(index_values, index_types)]


def element_address(context, builder, array_type, array_value, index_types, index_values):
    """Generic address (i64) of array[indices], without negative-index wraparound."""
    array, indices = array_and_indices(context, builder, array_type, array_value, index_types,
                                       index_values)
    pointer = cgutils.get_item_pointer(context, builder, array_type, array, indices,
                                       wraparound=False)
    return builder.ptrtoint(pointer, i64())


def row_element_address(context, builder, array_type, array_value, index_types, index_values):
    """Generic address (i64) of array[indices] for an array whose last dimension is contiguous:
    the last index counts items, whatever stride the array type carries. A strided ("A") array
    then costs no more registers than a C-contiguous one: no per-thread product with a run-time
    stride is kept alive across the kernel's loop."""
    array, indices = array_and_indices(context, builder, array_type, array_value, index_types,
                                       index_values)
    strides = cgutils.unpack_tuple(builder, array.strides, array_type.ndim)
    itemsize = context.get_abi_sizeof(context.get_data_type(array_type.dtype))
    offset = builder.mul(indices[-1], ir.Constant(i64(), itemsize))
    for index, stride in zip(indices[:-1], strides[:-1]):
        offset = builder.add(offset, builder.mul(index, stride))
    return builder.add(builder.ptrtoint(array.data, i64()), offset)


def casts(context, builder, values, from_types, to_type):
    return [context.cast(builder, v, t, to_type) for v, t in zip(values, from_types)]


SHARED_ADDRESS = "cvta.to.shared.u64 sa, {0}; cvt.u32.u64 s, sa;"


def name_for_cache(namespace, module_name):
    """Give each @intrinsic in `namespace` (a module's globals) its import path as its uuid.

    Numba's on-disk cache finds a kernel by a hash of its pickled closure, and an @intrinsic
    pickles with a uuid drawn at random in each process unless one is set: every kernel that
    reaches one (through a device function or a closure variable) would then miss the cache
    in each new process."""
    if SIMULATED:
        return
    named = set()
    for name, value in list(namespace.items()):
        if hasattr(value, "_set_uuid") and id(value) not in named:
            value._set_uuid(f"{module_name}.{name}")
            named.add(id(value))
