"""Warp- and warpgroup-level data exchange for the CUDA simulator, which has neither.

The simulator runs every thread of a block as a Python thread and implements syncthreads()
as a block-wide barrier. A collective of a group of threads (a warp's shuffle or mma, a
warpgroup's wgmma) is emulated among the group's own threads: each posts its value, the
group meets at a barrier, each reads its group's values, and a second barrier keeps the next
exchange from overwriting them early. So a twin that exchanges must be called by every thread
of its group together (as on the GPU), and only by them: the other threads of the block may
be elsewhere, e.g. a producer warpgroup waiting on an mbarrier.
Per-thread state (thread_state) holds what a thread has in flight, e.g. its cp.async copies.
"""
import threading
from collections import Counter

import numpy as np

WARP_SIZE = 32
WARPGROUP_SIZE = 128
#: how often a waiting thread wakes to look for an abort or a deadlock (a notify wakes it
#: at once; frequent wakes of hundreds of waiters starve the threads that compute)
POLL_SECONDS = 2.0


class SimulatedDeadlock(RuntimeError):
    pass


_PROGRESS = [0]  # how many simulated barriers have completed, anywhere


def note_progress():
    """A barrier completed (a generation, an mbarrier phase): the kernel is moving."""
    _PROGRESS[0] += 1


def _stuck_threads(thread, what):
    """Where each live thread of `thread`'s block (which waits for `what`) waits, or None if
    one of them runs, may go on (its condition holds: notified, not yet scheduled) or is
    being released from syncthreads."""
    waits = []
    for other in threading.enumerate():
        if getattr(other, "_manager", None) is not thread._manager or not other.is_alive():
            continue
        if other is thread:
            waits.append(what)
            continue
        waiting = getattr(other, "waiting_on", None)
        if waiting is not None:
            where, condition = waiting
            if condition():
                return None
        elif getattr(other, "syncthreads_blocked", False):
            where = "syncthreads"
        else:
            return None
        waits.append(where)
    return waits


def _deadlock_message(what, waits):
    places = "; ".join(f"{n} at {where}" for where, n in sorted(Counter(waits).items()))
    return f"{what}: every thread of the block waits and none can go on ({places})"


def wait_until(condition, lock, what):
    """Wait on `lock` (a threading.Condition, held) until condition() is true; raise if the
    simulator aborts the block (another thread raised) or the block is deadlocked: every
    live thread of it waits (here, for a condition that does not hold, or at syncthreads),
    twice in a row POLL_SECONDS apart with no barrier completed anywhere in between. Wall
    time alone decides nothing: a long wait while other threads compute (one warpgroup's turn
    while the other runs its softmax) or while notified threads wait for the interpreter is
    not a deadlock, however slow the simulation. The lock's notify wakes the waiter; the
    timeout only paces the checks."""
    thread = threading.current_thread()
    stuck_at = None  # the progress count when the block was last seen stuck
    while not condition():
        thread.waiting_on = (what, condition)
        lock.wait(POLL_SECONDS)
        thread.waiting_on = None
        if getattr(thread, "abort", False):
            raise RuntimeError(f"abort flag set while waiting on {what}")
        if condition():
            break
        progress = _PROGRESS[0]
        waits = _stuck_threads(thread, what)
        if waits is None or progress != stuck_at:
            stuck_at = None if waits is None else progress
            continue
        raise SimulatedDeadlock(_deadlock_message(what, waits))


class GroupBarrier:
    """A reusable barrier of `count` threads."""

    def __init__(self, count, what):
        self.count, self.what = count, what
        self.arrived, self.generation = 0, 0
        self.lock = threading.Condition()

    def arrive(self):
        """Count the calling thread and go on (bar.arrive)."""
        with self.lock:
            self.arrived += 1
            if self.arrived == self.count:
                self.arrived, self.generation = 0, self.generation + 1
                note_progress()
                self.lock.notify_all()

    def wait(self):
        with self.lock:
            generation = self.generation
            self.arrived += 1
            if self.arrived == self.count:
                self.arrived, self.generation = 0, generation + 1
                note_progress()
                self.lock.notify_all()
                return
            wait_until(lambda: self.generation != generation, self.lock, self.what)


_LOCK = threading.Lock()


def _block_dict(name):
    """A dict kept on the calling thread's block manager (made on first use)."""
    manager = threading.current_thread()._manager
    with _LOCK:
        return manager.__dict__.setdefault(name, {})


def _block_threads():
    return int(np.prod(threading.current_thread()._manager._block_dim))


def group_barrier(size):
    """The barrier of the calling thread's group of `size` consecutive threads (a warp, a
    warpgroup); the last group of a block may be short."""
    thread = threading.current_thread()
    first = thread.thread_id - thread.thread_id % size
    barriers = _block_dict(f"_numba_flash_barriers_{size}")
    with _LOCK:
        if first not in barriers:
            count = min(size, _block_threads() - first)
            barriers[first] = GroupBarrier(count, f"the group of {size} threads from {first}")
    return barriers[first]


def group_exchange(value, size):
    """All values (a list indexed by position in the group) of the calling thread's group of
    `size` threads."""
    thread = threading.current_thread()
    board = _block_dict("_numba_flash_exchange")
    board[thread.thread_id] = value
    barrier = group_barrier(size)
    barrier.wait()
    first = thread.thread_id - thread.thread_id % size
    values = [board.get(first + i) for i in range(barrier.count)]
    barrier.wait()
    return values


def warp_exchange(value):
    """All 32 lanes' values (a list indexed by lane) of the calling thread's warp."""
    return group_exchange(value, WARP_SIZE)


def lane_id():
    return threading.current_thread().thread_id % WARP_SIZE


def thread_index():
    """The calling thread's linear index in its block."""
    return threading.current_thread().thread_id


def warp_barrier():
    """A warp barrier (__syncwarp): the calling thread waits for the other lanes of its warp
    only, as on the GPU, so that a kernel which relies on it to order another warp's writes
    fails in the simulator too."""
    group_barrier(WARP_SIZE).wait()


def named_barrier(barrier_id, count):
    """The block's named barrier `barrier_id` of `count` threads (bar.sync waits at it,
    bar.arrive counts and goes on)."""
    barriers = _block_dict("_numba_flash_named_barriers")
    with _LOCK:
        barrier = barriers.get(barrier_id)
        if barrier is None or barrier.count != count:
            barrier = barriers[barrier_id] = GroupBarrier(count, f"named barrier {barrier_id}")
    return barrier


def block_state(name, factory):
    """A value shared by the threads of the calling block (made by factory() on first use),
    e.g. the mbarriers."""
    states = _block_dict("_numba_flash_block_state")
    with _LOCK:
        if name not in states:
            states[name] = factory()
        return states[name]


def thread_state(name, factory):
    """A per-thread value of the calling simulated thread (made by factory() on first use),
    e.g. the cp.async copies it has in flight. It lives as long as the thread: one block."""
    thread = threading.current_thread()
    state = thread.__dict__.setdefault("_numba_flash_state", {})
    if name not in state:
        state[name] = factory()
    return state[name]


def check_aligned(array, *index):
    """The hardware needs 16-byte aligned addresses here (ldmatrix, cp.async); the simulator
    would not notice, so the twins check."""
    address = array.ctypes.data + sum(int(i) * s for i, s in zip(index, array.strides))  # (int:
    #                                            a NumPy int32 index would overflow there)
    if address % 16:
        raise ValueError(f"address of element {index} is not 16-byte aligned")
