"""wgmma (sm_90a): a warpgroup's asynchronous matrix product D = A B (+ D), m64nNk16, float32
accumulators, float16 or bfloat16 inputs; B (and A, or A from registers) read from shared
memory through 64-bit matrix descriptors; with the fences that order it, and their simulator
twins.

A warpgroup is 4 consecutive warps (threads 128·i ..); every thread calls each of these
together. Registers (PTX ISA, "Register Fragments" of wgmma; warp w of the warpgroup owns
rows 16w..16w+15, g = lane // 4, t = lane % 4):
    D (64 x N, float32): d[4j + 0], d[4j + 1] = D[16w + g, 8j + 2t], D[16w + g, 8j + 2t + 1]
                         d[4j + 2], d[4j + 3] = the same columns of row 16w + g + 8
      -- each 8-column block j as mma.sync's C fragment, so a (..., N // 8, 4) float32 array
         in C order holds it;
    A from registers (64 x 16): a0 = A[16w + g, 2t:2t+2]   a1 = A[16w + g + 8, 2t:2t+2]
                                a2 = A[16w + g, 2t+8:2t+10]  a3 = A[16w + g + 8, 2t+8:2t+10]
      -- mma.sync's A fragment, two 16-bit values per uint32, the first in the low half; so
         the D layout of two adjacent 8-column blocks, packed, is the A of a 16-wide chunk.
Shared-memory operands use the 128-byte swizzle: a tile is stored as rows of 128 bytes (64
16-bit elements), 8 rows making a 1024-byte atom, the 16-byte chunk c of row r at chunk
c ^ (r % 8) (the hardware applies it to address bits 4-6 from bits 7-9, so atoms start at
multiples of 1024 bytes). K-major operand (A, or B stored [n][k]): rows are M or N, the
stride between 8-row groups is `stride_bytes`, and a k16 step is 32 bytes further along the
row. MN-major operand (B stored [k][n], e.g. V for P V): rows are K, 8-row groups
`stride_bytes` apart, 64-column blocks of N `leading_bytes` apart.

Issue order: fence_operands(acc) on registers that ordinary code wrote, wgmma_fence(), the
products, wgmma_commit(); later wgmma_wait(n) (at most n committed groups still running),
then fence_operands(acc) before ordinary code reads them. fence_operands emits no
instruction: it ties the registers to that point, so the compiler moves no access to them
across the asynchronous product (ptxas would otherwise serialise the products: warning
C7515).
"""
import functools

import numpy as np
from numba import types
from numba.cuda.extending import intrinsic

from . import sim_warp
from ._llvm import (SIMULATED, asm, f32, i32, i64, literal_instruction, name_for_cache,
                    void_instruction)
from .mma import _unpack_bf16x2_python, _unpack_f16x2_python
from .shared import _SharedAddress

#: descriptor layout type of the 128-byte swizzle (bits 62-63)
_SWIZZLE_128B = 1
ATOM_BYTES = 1024  # 8 rows of 128 bytes


@intrinsic
def _make_descriptor(typingctx, address, leading_bytes, stride_bytes):
    """The 64-bit matrix descriptor of a 128-byte-swizzled operand starting at `address` (a
    32-bit shared address): start address, leading and stride byte offsets in 16-byte units,
    base offset 0, layout type 128B swizzle."""
    sig = types.uint64(address, leading_bytes, stride_bytes)

    def codegen(context, builder, sig, args):
        start, leading, stride = [builder.zext(context.cast(builder, v, t, types.uint32), i64())
                                  for v, t in zip(args, sig.args)]
        field = lambda value, shift, bits: builder.shl(  # noqa: E731
            builder.and_(builder.lshr(value, value.type(4)), value.type((1 << bits) - 1)),
            value.type(shift))
        descriptor = builder.or_(field(start, 0, 14), field(leading, 16, 14))
        descriptor = builder.or_(descriptor, field(stride, 32, 14))
        return builder.or_(descriptor, i64()(_SWIZZLE_128B << 62))

    return sig, codegen


@intrinsic
def _descriptor_at(typingctx, descriptor, byte_offset):
    """The descriptor moved `byte_offset` bytes (a multiple of 16) further in shared memory."""
    sig = types.uint64(descriptor, byte_offset)

    def codegen(context, builder, sig, args):
        offset = context.cast(builder, args[1], sig.args[1], types.uint64)
        return builder.add(context.cast(builder, args[0], sig.args[0], types.uint64),
                           builder.lshr(offset, i64()(4)))

    return sig, codegen


#: wait until at most `pending` (a literal) committed groups of products still run
_wgmma_wait = literal_instruction(lambda pending: f"wgmma.wait_group.sync.aligned {pending};")


def _element_pointers(context, builder, array_type, array_value, count):
    data = context.make_array(array_type)(context, builder, array_value).data
    return [builder.gep(data, [i64()(i)]) for i in range(count)]


def _register_type(dtype):
    return (f32(), "f") if dtype == types.float32 else (i32(), "r")


@functools.lru_cache(maxsize=None)
def make_fence_operands(count):
    """fence_operands(array): the first `count` elements (C order) of a float32 or uint32
    register array pass through an empty asm statement that the compiler may not move."""
    @intrinsic
    def fence_operands(typingctx, array):
        if not (isinstance(array, types.Array) and array.dtype in (types.float32, types.uint32)):
            return None
        sig = types.void(array)

        def codegen(context, builder, sig, args):
            register, letter = _register_type(sig.args[0].dtype)
            pointers = _element_pointers(context, builder, sig.args[0], args[0], count)
            values = [builder.load(p) for p in pointers]
            constraints = ",".join([f"={letter}"] * count + [str(i) for i in range(count)])
            outputs = asm(builder, "", constraints, values, outputs=[register] * count,
                          side_effect=True)
            for pointer, value in zip(pointers, outputs):
                builder.store(value, pointer)
            return context.get_dummy_value()

        return sig, codegen

    if SIMULATED:
        return _fence_operands_python
    name_for_cache({"fence_operands": fence_operands}, f"{__name__}.fence_operands_{count}")
    return fence_operands


@functools.lru_cache(maxsize=None)
def make_wgmma(n, bf16, a_from_registers=False, b_mn_major=False):
    """wgmma(acc, a, desc_b, accumulate): acc[:n // 2] (C order) = A B + (acc if accumulate
    else 0), one m64nNk16 product of the warpgroup. A is `a`: a descriptor (K-major) or, with
    a_from_registers, a 4-tuple of uint32 fragments; B's descriptor is K-major ([n][k] in
    shared memory) or, with b_mn_major, MN-major ([k][n])."""
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"wgmma's N is a multiple of 8 in 8..256; got {n}")
    if SIMULATED:
        return _wgmma_python(n, bf16, a_from_registers, b_mn_major)
    kind = "bf16" if bf16 else "f16"
    registers = n // 2
    d = ",".join(f"${i}" for i in range(registers))
    if a_from_registers:
        a = "{" + ",".join(f"${registers + i}" for i in range(4)) + "}"
        b, scale, flags = f"${registers + 4}", f"${registers + 5}", f"1, 1, {int(b_mn_major)}"
        operand_constraints = "r,r,r,r,l,r"
    else:
        a, b, scale = f"${registers}", f"${registers + 1}", f"${registers + 2}"
        flags = f"1, 1, 0, {int(b_mn_major)}"
        operand_constraints = "l,l,r"
    text = ("{ .reg .pred accumulate; " f"setp.ne.b32 accumulate, {scale}, 0; "
            f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind} "
            f"{{{d}}}, {a}, {b}, accumulate, {flags}; }}")
    constraints = ",".join(["=f"] * registers + [operand_constraints] +
                           [str(i) for i in range(registers)] + ["~{memory}"])

    @intrinsic
    def wgmma(typingctx, acc, a, desc_b, accumulate):
        if not (isinstance(acc, types.Array) and acc.dtype == types.float32):
            return None
        if a_from_registers and not (isinstance(a, types.BaseTuple) and len(a) == 4):
            return None
        sig = types.void(acc, a, desc_b, accumulate)

        def codegen(context, builder, sig, args):
            acc_type, a_type, b_type, flag_type = sig.args
            pointers = _element_pointers(context, builder, acc_type, args[0], registers)
            values = [builder.load(p) for p in pointers]
            if a_from_registers:
                a_values = [context.cast(builder, builder.extract_value(args[1], i),
                                         a_type[i], types.uint32) for i in range(4)]
            else:
                a_values = [context.cast(builder, args[1], a_type, types.uint64)]
            operands = a_values + [context.cast(builder, args[2], b_type, types.uint64),
                                   context.cast(builder, args[3], flag_type, types.uint32)]
            outputs = asm(builder, text, constraints, operands + values,
                          outputs=[f32()] * registers, side_effect=True)
            for pointer, value in zip(pointers, outputs):
                builder.store(value, pointer)
            return context.get_dummy_value()

        return sig, codegen

    name_for_cache({"wgmma": wgmma},
                   f"{__name__}.wgmma_{n}_{kind}_{int(a_from_registers)}_{int(b_mn_major)}")
    return wgmma


# -- twins ------------------------------------------------------------------------------------
#
# A product is computed when a wgmma_wait covers its commit group, reading shared memory then
# (as the hardware may read it any time before): a kernel that lets a stage be overwritten
# before waiting for the products that read it computes garbage in the simulator too, and
# its accumulator registers hold their old values until the wait.

class _Descriptor:
    """The simulator's matrix descriptor: where the operand starts and its byte offsets."""
    __slots__ = ("address", "leading", "stride")

    def __init__(self, address, leading, stride):
        self.address, self.leading, self.stride = address, int(leading), int(stride)

    def moved(self, byte_offset):
        if byte_offset % 16:
            raise ValueError(f"a descriptor moves by multiples of 16 bytes; got {byte_offset}")
        return _Descriptor(self.address + byte_offset, self.leading, self.stride)


def _make_descriptor_python(address, leading_bytes, stride_bytes):
    if not isinstance(address, _SharedAddress):
        raise TypeError(f"a matrix descriptor takes a shared address; got {address!r}")
    return _Descriptor(address, leading_bytes, stride_bytes)


def _descriptor_at_python(descriptor, byte_offset):
    return descriptor.moved(int(byte_offset))


def _swizzled(byte_addresses):
    return byte_addresses ^ (((byte_addresses >> 7) & 7) << 4)


def _halves(descriptor, byte_addresses):
    """The 16-bit patterns at these (unswizzled) byte addresses of the descriptor's array."""
    memory = descriptor.address.array.view(np.uint8).reshape(-1)
    physical = _swizzled(byte_addresses)
    if physical.min() < 0 or physical.max() + 1 >= memory.size:
        raise ValueError("a wgmma operand reaches outside its shared array")
    return memory[physical].astype(np.uint16) | (memory[physical + 1].astype(np.uint16) << 8)


def _check_start(descriptor, k_major):
    start = descriptor.address.byte_offset
    within_atom = start % ATOM_BYTES
    if k_major and (within_atom >= 128 or within_atom % 32):
        raise ValueError(f"a K-major operand starts on a 1024-byte atom plus a multiple of 32 "
                         f"bytes below 128 (a k16 step); got byte {start}")
    if not k_major and within_atom:
        raise ValueError(f"an MN-major operand starts on a 1024-byte atom; got byte {start}")
    return start


def _k_major(descriptor, rows):
    """The (rows, 16) operand a K-major descriptor describes."""
    start = _check_start(descriptor, k_major=True)
    r, k = np.arange(rows)[:, None], np.arange(16)[None, :]
    return _halves(descriptor, start + (r // 8) * descriptor.stride + (r % 8) * 128 + 2 * k)


def _mn_major(descriptor, columns):
    """The (16, columns) operand an MN-major descriptor describes."""
    start = _check_start(descriptor, k_major=False)
    k, n = np.arange(16)[:, None], np.arange(columns)[None, :]
    return _halves(descriptor, start + (n // 64) * descriptor.leading + (k // 8) *
                   descriptor.stride + (k % 8) * 128 + 2 * (n % 64))


def _from_bits(bits, bf16):
    bits = np.asarray(bits, np.uint32)
    if bf16:
        return (bits << 16).view(np.float32)
    return bits.astype(np.uint16).view(np.float16).astype(np.float32)


def _a_from_fragments(fragments, unpack):
    a = np.zeros((64, 16), np.float32)
    for thread, regs in enumerate(fragments):
        row, t = 16 * (thread // 32) + (thread % 32) // 4, thread % 4
        a[row, 2 * t:2 * t + 2] = unpack(regs[0])
        a[row + 8, 2 * t:2 * t + 2] = unpack(regs[1])
        a[row, 2 * t + 8:2 * t + 10] = unpack(regs[2])
        a[row + 8, 2 * t + 8:2 * t + 10] = unpack(regs[3])
    return a


def _warpgroup_state():
    first = sim_warp.thread_index() - sim_warp.thread_index() % sim_warp.WARPGROUP_SIZE
    return sim_warp.block_state(f"wgmma_{first}", lambda: {"issued": [], "groups": []})


@functools.lru_cache(maxsize=None)
def _d_positions(n):
    """(rows, columns) of D that each thread of the warpgroup holds, (128, n // 2) each."""
    thread, register = np.arange(128)[:, None], np.arange(n // 2)[None, :]
    j, r = register // 4, register % 4
    rows = 16 * (thread // 32) + (thread % 32) // 4 + 8 * (r // 2)
    return rows, 8 * j + 2 * (thread % 4) + r % 2


def _wgmma_python(n, bf16, a_from_registers, b_mn_major):
    unpack = _unpack_bf16x2_python if bf16 else _unpack_f16x2_python

    def compute(operands):
        _, a, desc_b, accumulate = operands[0]
        if a_from_registers:
            a_matrix = _a_from_fragments([a for _, a, _, _ in operands], unpack)
        else:
            a_matrix = _from_bits(_k_major(a, 64), bf16)
        b_matrix = _from_bits(_mn_major(desc_b, n) if b_mn_major else _k_major(desc_b, n).T,
                              bf16)
        d = (a_matrix.astype(np.float64) @ b_matrix.astype(np.float64))[_d_positions(n)]
        for thread, (acc, _, _, _) in enumerate(operands):
            registers = acc.reshape(-1)[:n // 2]  # (a view: C-order register arrays)
            registers[:] = (d[thread] + registers if accumulate else d[thread]).astype(
                np.float32)

    def wgmma(acc, a, desc_b, accumulate):
        if acc.size < n // 2:
            raise ValueError(f"wgmma m64n{n}: the accumulator holds {acc.size} of {n // 2} "
                             f"registers")
        operands = sim_warp.group_exchange((acc, a, desc_b, bool(accumulate)),
                                           sim_warp.WARPGROUP_SIZE)
        if sim_warp.thread_index() % sim_warp.WARPGROUP_SIZE == 0:
            _warpgroup_state()["issued"].append(functools.partial(compute, operands))

    return wgmma


def _wgmma_fence_python():
    sim_warp.group_barrier(sim_warp.WARPGROUP_SIZE).wait()


def _wgmma_commit_python():
    barrier = sim_warp.group_barrier(sim_warp.WARPGROUP_SIZE)
    barrier.wait()  # (every product of the group issued)
    if sim_warp.thread_index() % sim_warp.WARPGROUP_SIZE == 0:
        state = _warpgroup_state()
        state["groups"].append(state["issued"][:])
        state["issued"].clear()
    barrier.wait()


def _wgmma_wait_python(pending):
    barrier = sim_warp.group_barrier(sim_warp.WARPGROUP_SIZE)
    barrier.wait()
    if sim_warp.thread_index() % sim_warp.WARPGROUP_SIZE == 0:
        groups = _warpgroup_state()["groups"]
        while len(groups) > pending:
            for product in groups.pop(0):
                product()
    barrier.wait()


def _fence_operands_python(array):
    pass


if SIMULATED:
    make_descriptor, descriptor_at = _make_descriptor_python, _descriptor_at_python
    wgmma_fence, wgmma_commit = _wgmma_fence_python, _wgmma_commit_python
    wgmma_wait = _wgmma_wait_python
else:
    make_descriptor, descriptor_at = _make_descriptor, _descriptor_at
    #: before the first product of a batch: registers written by ordinary code are settled
    wgmma_fence = void_instruction("wgmma.fence.sync.aligned;")
    #: closes the group of products issued since the last commit
    wgmma_commit = void_instruction("wgmma.commit_group.sync.aligned;")
    wgmma_wait = _wgmma_wait
    name_for_cache(globals(), __name__)
