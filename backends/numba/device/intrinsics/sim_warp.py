"""Warp-level data exchange for the CUDA simulator, which has no warp operations.

The simulator runs every thread of a block as a Python thread and implements syncthreads()
as a block-wide barrier. A warp collective is emulated the same way the simulator emulates
syncthreads_count: each thread posts its value, all threads meet at a barrier, each reads its
warp's 32 values, and a second barrier keeps the next exchange from overwriting them early.
So, like syncthreads(), a twin that exchanges must be called by every thread of the block.
The warp barrier (warp_barrier) is the exception: the lanes of a warp meet among themselves.
Per-thread state (thread_state) holds what a thread has in flight, e.g. its cp.async copies.
"""
import threading

import numpy as np

WARP_SIZE = 32


def warp_exchange(value):
    """All 32 lanes' values (a list indexed by lane) of the calling thread's warp."""
    thread = threading.current_thread()
    board = thread._manager.__dict__.setdefault("_numba_flash_exchange", {})
    board[thread.thread_id] = value
    thread.syncthreads()
    first = thread.thread_id - thread.thread_id % WARP_SIZE
    values = [board.get(first + lane) for lane in range(WARP_SIZE)]
    thread.syncthreads()
    return values


def lane_id():
    return threading.current_thread().thread_id % WARP_SIZE


_BARRIERS_LOCK = threading.Lock()


def warp_barrier():
    """A warp barrier (__syncwarp): the calling thread waits for the other lanes of its warp
    only, as on the GPU, so that a kernel which relies on it to order another warp's writes
    fails in the simulator too. (The simulator's block barrier releases once every thread is
    waiting in it; a warp's lanes meet here before any of them can get there.)"""
    thread = threading.current_thread()
    first = thread.thread_id - thread.thread_id % WARP_SIZE
    with _BARRIERS_LOCK:
        barriers = thread._manager.__dict__.setdefault("_numba_flash_warp_barriers", {})
        if first not in barriers:
            lanes = min(WARP_SIZE, int(np.prod(thread._manager._block_dim)) - first)
            barriers[first] = threading.Barrier(lanes)
    barriers[first].wait()


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
