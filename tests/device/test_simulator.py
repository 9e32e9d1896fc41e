"""The simulator's deadlock check (device/intrinsics/sim_warp.py): a block whose every thread
waits at a barrier nobody else will reach is reported, naming where each waits; a block in
which some threads wait long while another computes is not, however long that takes. And the
block manager that replaces Numba's (device/intrinsics/sim_block.py): syncthreads() orders a
block's threads, and one thread's exception stops the block and reaches the caller."""
import re
import time

import numpy as np
import pytest
from numba import cuda

from numba_flash.backends.numba.device.intrinsics import (SIMULATED, named_barrier_arrive,
                                                          named_barrier_sync, sim_block,
                                                          sim_warp)

pytestmark = pytest.mark.skipif(not SIMULATED, reason="checks the simulator itself")


@pytest.fixture
def quick_polls(monkeypatch):
    monkeypatch.setattr(sim_warp, "POLL_SECONDS", 0.1)


def crossed_waits_kernel(out):
    """Each warp waits at its own named barrier for the other warp, which never arrives."""
    warp = cuda.threadIdx.x // 32
    named_barrier_sync(1 + warp, 64)
    out[cuda.threadIdx.x] = 1


def slow_arrival_kernel(out):
    """Warp 1 waits at a named barrier while warp 0 computes (sleeps) for many polls, then
    arrives."""
    tid = cuda.threadIdx.x
    if tid < 32:
        time.sleep(1.0)  # (a plain Python call: this kernel runs only in the simulator)
        named_barrier_arrive(1, 64)
    else:
        named_barrier_sync(1, 64)
    out[tid] = 1


def test_a_block_whose_every_thread_waits_is_a_deadlock(quick_polls):
    out = np.zeros(64, np.int32)
    start = time.monotonic()
    with pytest.raises(sim_warp.SimulatedDeadlock) as raised:
        cuda.jit(crossed_waits_kernel)[1, 64](out)
    assert time.monotonic() - start < 20
    message = str(raised.value)
    # (threads of the block that found the deadlock first have already left with it)
    assert re.search(r"\d+ at named barrier 1;", message)
    assert re.search(r"\d+ at named barrier 2\)", message)
    assert not out.any()


def test_a_long_wait_while_another_warp_computes_is_not_a_deadlock(quick_polls):
    out = np.zeros(64, np.int32)
    cuda.jit(slow_arrival_kernel)[1, 64](out)
    assert out.tolist() == [1] * 64


def rotate_kernel(values, out):
    """Each of three rounds: every thread writes its value to shared memory, the block meets,
    each thread takes its neighbour's; a barrier released early shows as a wrong value."""
    tile = cuda.shared.array(96, np.float64)
    tid = cuda.threadIdx.x
    value = values[tid]
    for _ in range(3):
        tile[tid] = value
        cuda.syncthreads()
        value = tile[(tid + 1) % 96]
        cuda.syncthreads()
    out[tid] = value


def failing_kernel(out):
    """Thread 5 raises while the others wait at syncthreads for it."""
    if cuda.threadIdx.x == 5:
        raise ValueError("thread five fails")
    cuda.syncthreads()
    out[cuda.threadIdx.x] = 1


def test_the_block_manager_is_numbas_replacement():
    from numba.cuda.simulator import kernel
    assert kernel.BlockManager.run is sim_block.run_block


def test_syncthreads_orders_the_blocks_threads():
    values = np.random.default_rng().standard_normal(96)
    out = np.full(96, np.nan)
    cuda.jit(rotate_kernel)[1, 96](values, out)
    assert out.tolist() == np.roll(values, -3).tolist()


def test_one_threads_exception_reaches_the_caller():
    out = np.zeros(64, np.int32)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"tid=\[5, 0, 0\].*thread five fails"):
        cuda.jit(failing_kernel)[1, 64](out)
    assert time.monotonic() - start < 20
    assert not out.any()
