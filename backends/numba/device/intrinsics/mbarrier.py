"""mbarriers (sm_90: shared-memory barriers that threads arrive on and wait for by phase) and
the proxy fence between ordinary shared-memory writes and the async proxy (wgmma's reads),
with their simulator twins.

An mbarrier counts arrivals: initialised for `count` of them, its current phase completes
when the last arrives, and the next phase begins. `mbarrier_wait(address, parity)` returns
once the phase of that parity has completed, i.e. while the current phase's parity differs:
a fresh barrier (phase 0 running) makes a wait on parity 0 block and one on parity 1 return
at once, which is how a producer finds every stage of a new pipeline free. Addresses are
32-bit shared addresses of 8-byte aligned words (shared_base).
"""
import threading

from numba import types

from . import sim_warp
from ._llvm import SIMULATED, name_for_cache, operand_instruction, void_instruction
from .shared import _SharedAddress

_U32 = types.uint32

_mbarrier_init = operand_instruction("mbarrier.init.shared::cta.b64 [$0], $1;", (_U32, _U32))
#: one arrival (release semantics at CTA scope: the caller's earlier writes are seen by a
#: thread whose wait sees the phase complete)
_mbarrier_arrive = operand_instruction("mbarrier.arrive.shared::cta.b64 _, [$0];", (_U32,))
#: one arrival that also announces transaction bytes the phase waits for besides the
#: arrivals (the bytes of copies that complete on this barrier: tensor_copy.py)
_mbarrier_expect_tx = operand_instruction(
    "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", (_U32, _U32))
#: wait until the phase of this parity has completed (acquire: the arrivers' earlier writes
#: are seen)
_mbarrier_wait = operand_instruction(
    "{ .reg .pred done; WAIT_${:uid}: mbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1; "
    "@!done bra.uni WAIT_${:uid}; }", (_U32, _U32))


# -- twins ------------------------------------------------------------------------------------

class _MBarrierState:
    """Arrivals still expected in this phase, transaction bytes still to complete, and the
    copies that land when the phase completes (tensor_copy.py's twin)."""
    __slots__ = ("expected", "pending", "phase", "transactions", "landings")

    def __init__(self, count):
        self.expected = self.pending = count
        self.phase = self.transactions = 0
        self.landings = []

    def complete_if_done(self, lock):
        if self.pending == 0 and self.transactions == 0:
            for target, values in self.landings:
                target[:] = values
            self.landings.clear()
            self.phase += 1
            self.pending = self.expected
            sim_warp.note_progress()
            lock.notify_all()


def _barriers():
    return (sim_warp.block_state("mbarriers", dict),
            sim_warp.block_state("mbarrier_lock", threading.Condition))


def _key(address):
    if not isinstance(address, _SharedAddress):
        raise TypeError(f"an mbarrier's address is a shared address; got {address!r}")
    if address.byte_offset % 8:
        raise ValueError(f"an mbarrier must be 8-byte aligned; got byte {address.byte_offset}")
    return id(address.array), address.byte_offset


def _mbarrier_init_python(address, count):
    if int(count) < 1:
        raise ValueError(f"an mbarrier needs a positive arrival count; got {count}")
    barriers, lock = _barriers()
    with lock:
        barriers[_key(address)] = _MBarrierState(int(count))


def _state_of(barriers, address):
    state = barriers.get(_key(address))
    if state is None:
        raise RuntimeError(f"mbarrier at byte {address.byte_offset} used before mbarrier_init")
    return state


def _mbarrier_arrive_python(address):
    _mbarrier_expect_tx_python(address, 0)


def _mbarrier_expect_tx_python(address, transaction_bytes):
    barriers, lock = _barriers()
    with lock:
        state = _state_of(barriers, address)
        state.pending -= 1
        state.transactions += int(transaction_bytes)
        state.complete_if_done(lock)


def complete_transaction(address, transaction_bytes, landing):
    """(Twin only) a copy of `transaction_bytes` completes on the barrier: landing, a
    (target, values) pair of byte arrays, is written when the phase completes."""
    barriers, lock = _barriers()
    with lock:
        state = _state_of(barriers, address)
        state.landings.append(landing)
        state.transactions -= int(transaction_bytes)
        state.complete_if_done(lock)


def _mbarrier_wait_python(address, parity):
    barriers, lock = _barriers()
    with lock:
        state = _state_of(barriers, address)
        sim_warp.wait_until(lambda: state.phase % 2 != int(parity) % 2, lock,
                            f"mbarrier at byte {address.byte_offset}, parity {parity}")


def _nothing():
    pass


if SIMULATED:
    mbarrier_init, mbarrier_arrive = _mbarrier_init_python, _mbarrier_arrive_python
    mbarrier_wait, mbarrier_expect_tx = _mbarrier_wait_python, _mbarrier_expect_tx_python
    # The simulator's shared memory is one coherent memory: neither fence orders anything.
    fence_mbarrier_init = fence_proxy_async = _nothing
else:
    mbarrier_init, mbarrier_arrive, mbarrier_wait = _mbarrier_init, _mbarrier_arrive, _mbarrier_wait
    mbarrier_expect_tx = _mbarrier_expect_tx
    #: makes barrier initialisation visible to the async proxy and the other threads
    fence_mbarrier_init = void_instruction("fence.mbarrier_init.release.cluster;")
    #: orders this thread's ordinary (generic-proxy) shared-memory writes, cp.async's among
    #: them once waited for, before the async proxy's reads (wgmma) that follow a barrier
    fence_proxy_async = void_instruction("fence.proxy.async.shared::cta;")
    name_for_cache(globals(), __name__)
