"""Warp specialisation (sm_90a): register reallocation between warpgroups (setmaxnreg) and
named barriers among some warps of a block (bar.sync / bar.arrive with an id and a thread
count), with their simulator twins.

setmaxnreg moves registers between the warpgroups of a block: a producer warpgroup gives
some back (dec), consumer warpgroups take them (inc). ptxas honours it only in a kernel
compiled with a register cap at entry (launch_bounds=(threads, 1)), with each role one branch
of a single if/else; otherwise it warns (C7508) and ignores it.
"""
from numba import types
from numba.cuda.extending import intrinsic

from . import sim_warp
from ._llvm import SIMULATED, asm, literal_instruction, name_for_cache


def _named_barrier(operation):
    """bar.<operation> id, threads with literal ints: `sync` waits until `threads` threads
    (whole warps) have arrived at id, counting itself; `arrive` counts itself and goes on."""

    @intrinsic
    def named_barrier(typingctx, barrier_id, threads):
        if not all(isinstance(x, types.IntegerLiteral) for x in (barrier_id, threads)):
            return None
        _check_barrier(barrier_id.literal_value, threads.literal_value)
        text = f"bar.{operation} {barrier_id.literal_value}, {threads.literal_value};"
        sig = types.void(barrier_id, threads)

        def codegen(context, builder, sig, args):
            asm(builder, text, "~{memory}", [], side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    return named_barrier


def _check_registers(count):
    if not (24 <= count <= 256 and count % 8 == 0):
        raise ValueError(f"setmaxnreg takes a multiple of 8 in 24..256; got {count}")


def _check_barrier(barrier_id, threads):
    if not (1 <= barrier_id <= 15):  # (0 is syncthreads')
        raise ValueError(f"named barrier ids are 1..15; got {barrier_id}")
    if threads <= 0 or threads % 32:
        raise ValueError(f"a named barrier counts whole warps; got {threads} threads")


def _setmaxnreg_python(count):
    _check_registers(count)


def _named_barrier_sync_python(barrier_id, threads):
    _check_barrier(barrier_id, threads)
    sim_warp.named_barrier(barrier_id, threads).wait()


def _named_barrier_arrive_python(barrier_id, threads):
    _check_barrier(barrier_id, threads)
    sim_warp.named_barrier(barrier_id, threads).arrive()


if SIMULATED:
    setmaxnreg_inc = setmaxnreg_dec = _setmaxnreg_python
    named_barrier_sync = _named_barrier_sync_python
    named_barrier_arrive = _named_barrier_arrive_python
else:
    setmaxnreg_inc = literal_instruction(
        lambda count: f"setmaxnreg.inc.sync.aligned.u32 {count};", _check_registers)
    setmaxnreg_dec = literal_instruction(
        lambda count: f"setmaxnreg.dec.sync.aligned.u32 {count};", _check_registers)
    named_barrier_sync, named_barrier_arrive = _named_barrier("sync"), _named_barrier("arrive")
    name_for_cache(globals(), __name__)
