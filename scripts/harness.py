"""Helpers shared by the scripts (verify.py, bench.py, bench_variants.py, ...; not part of the
package)."""
import contextlib
import fcntl
import json
import os


def gpu_ready():
    """None if CuPy sees a CUDA GPU, else the reason (without importing numba)."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA GPU"
    except Exception as exc:  # CUDARuntimeError when there is no driver
        return f"no usable CUDA GPU ({exc.__class__.__name__})"
    return None


def optional_torch(leave_out=False):
    """torch for the SDPA peers, or None: left out (--no-torch), or not installed (said)."""
    if leave_out:
        return None
    try:
        import torch
    except ImportError:
        print("torch not installed: SDPA peers left out")
        return None
    return torch


@contextlib.contextmanager
def gpu_turn(lock_path):
    """The GPU to this process alone while the block runs, among the processes given the same
    lock file (an exclusive flock, waited for); None: no lock. Two trees' benches then
    compile side by side and time in turns (scripts/bench_compare.sh)."""
    if not lock_path:
        yield
        return
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_json(path, results):
    """The results so far into `path` (the --json option; None: nothing), rewritten after each
    case, so that a run cut short by a time limit keeps what it measured."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def use_simulator():
    """Run the Numba kernels in the CUDA simulator; must happen before numba is imported."""
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


def random_inputs(xp, rng, batch, seqlen_q, seqlen_k, nheads, headdim, dtype):
    """q, k, v and dout: standard normal, drawn on the host and moved to xp."""
    def draw(seqlen):
        return xp.asarray(rng.standard_normal((batch, seqlen, nheads, headdim)).astype(dtype))
    return draw(seqlen_q), draw(seqlen_k), draw(seqlen_k), draw(seqlen_q)


def poison_memory_pool(nbytes):
    """Fill nbytes of CuPy's memory pool with NaN and give it back, so the next allocations
    start out as NaN: an output element a kernel forgets to write then shows up as NaN."""
    import cupy
    block = cupy.empty(nbytes // 4 + 1, cupy.float32)
    block.fill(cupy.nan)
    cupy.cuda.get_current_stream().synchronize()
    del block


def peak_extra_bytes(fn):
    """Run fn() and return (its result, the peak device memory it took from CuPy's pool).

    The pool is emptied first; every allocation fn makes (outputs and temporaries) comes from
    it and freed blocks stay cached, so the pool's total afterwards is the peak of the call."""
    import cupy
    pool = cupy.get_default_memory_pool()
    cupy.cuda.get_current_stream().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    result = fn()
    cupy.cuda.get_current_stream().synchronize()
    return result, pool.total_bytes() - before


def median_ms(run, repeats=7):
    """Median milliseconds of run() over `repeats` calls, by CUDA events on CuPy's current
    stream (for the tile-config sweeps; bench.py's Timer also adapts the repeat count)."""
    import statistics

    import cupy
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeats):
        start.record()
        run()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)
