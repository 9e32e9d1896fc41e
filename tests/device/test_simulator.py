"""The simulator's deadlock check (device/intrinsics/sim_warp.py): a block whose every thread
waits at a barrier nobody else will reach is reported, naming where each waits; a block in
which some threads wait long while another computes is not, however long that takes."""
import re
import time

import numpy as np
import pytest
from numba import cuda

from numba_flash.backends.numba.device.intrinsics import (SIMULATED, named_barrier_arrive,
                                                          named_barrier_sync, sim_warp)

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
