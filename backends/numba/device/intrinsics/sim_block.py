"""The simulator's block scheduler, made to pause between its polls.

Numba's CUDA simulator runs a block as one Python thread per CUDA thread; the launching thread
(the block's manager) polls them to release syncthreads() once every live thread waits there.
Its loop never pauses, so it holds the interpreter lock for much of every switch interval and
the simulated threads run in what is left: with most of a block's threads waiting (consumer
warpgroups at an mbarrier while the producer copies, lanes at a warp barrier) the manager
took most of the time. `install()` gives the manager a loop that sleeps between polls, with the
same rules: syncthreads() is released when every live thread of the block waits there, and
the first exception a thread raises aborts the block's other threads (before any further
barrier is released) and is raised again in the launching thread. A kernel test then runs
several times faster (docs/RELIABILITY.md, twentieth session).
"""
import time

import numpy as np

#: the manager's pause between two polls: the most a released barrier waits for it
POLL_PAUSE_SECONDS = 0.0005


def _raise_from(thread):
    error, traceback = thread.exception
    raise error.with_traceback(traceback)


def _abort(threads):
    """Wake every thread with its abort flag set (syncthreads() and the twins' waits raise)."""
    for thread in threads:
        thread.abort = True
        thread.syncthreads_blocked = False
        thread.syncthreads_event.set()


def run_block(manager, grid_point, *args):
    """BlockManager.run: every thread of block `grid_point` runs the kernel on `args`."""
    from numba.cuda.simulator.kernel import BlockThread

    def kernel():
        manager._f(*args)

    threads = [BlockThread(kernel, manager, grid_point, thread_point, manager._debug)
               for thread_point in np.ndindex(*manager._block_dim)]
    for thread in threads:
        thread.start()
    live = threads
    while live:
        time.sleep(POLL_PAUSE_SECONDS)  # why: the simulated threads need the interpreter lock
        running = [thread for thread in live if thread.is_alive()]
        # (the threads that ended since the last poll included: a thread sets its exception
        # before it ends, so no barrier is released once a thread has failed)
        failed = next((thread for thread in live if thread.exception), None)
        if failed is not None:
            _abort(threads)
            _raise_from(failed)
        live = running
        if live and all(thread.syncthreads_blocked for thread in live):
            for thread in live:
                thread.syncthreads_blocked = False
                thread.syncthreads_event.set()
    failed = next((thread for thread in threads if thread.exception), None)
    if failed is not None:  # (raised as the thread ended, after the last poll)
        _raise_from(failed)


def install():
    """Make the simulator's block managers run blocks with run_block."""
    from numba.cuda.simulator import kernel
    kernel.BlockManager.run = run_block
