"""Random attention inputs for the tests (never zeros, fresh per test), and test-case lists."""
import dataclasses

import pytest


def random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, headdim, dtype):
    q = rng.standard_normal((batch, seqlen_q, nheads, headdim)).astype(dtype)
    k = rng.standard_normal((batch, seqlen_k, nheads, headdim)).astype(dtype)
    v = rng.standard_normal((batch, seqlen_k, nheads, headdim)).astype(dtype)
    return q, k, v


def simulator_and_gpu_cases(simulator_shapes, gpu_shapes):
    """pytest params ("simulator" | "gpu", shape): the gpu ones marked `gpu`."""
    name = lambda shape: "x".join(map(str, shape))  # noqa: E731
    return ([pytest.param("simulator", s, id="sim-" + name(s)) for s in simulator_shapes] +
            [pytest.param("gpu", s, id="gpu-" + name(s), marks=pytest.mark.gpu)
             for s in gpu_shapes])


def gpu_cannot_run(shared_bytes, async_copy):
    """Why the GPU cannot run a SIMT kernel config that takes shared_bytes of shared memory per
    block (with cp.async loads if async_copy), or None if it can; None under the simulator."""
    from numba import config, cuda
    if config.ENABLE_CUDASIM:
        return None
    device = cuda.get_current_device()
    limit = device.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    if shared_bytes > limit:
        return f"the config takes {shared_bytes} bytes of shared memory; this GPU gives {limit}"
    if async_copy and tuple(device.compute_capability) < (8, 0):
        return "cp.async loads need compute capability 8.0 or newer"
    return None


def simt_kernel_cases(simulator_cases, gpu_cases):
    """pytest params (config, shape, async_copy) of a SIMT kernel's (config, shape) cases, the
    gpu ones marked `gpu`: both kinds of loads where cp.async can copy the rows (head dims that
    are multiples of 4), plain loads elsewhere."""
    params = []
    for mode, cases in (("sim", simulator_cases), ("gpu", gpu_cases)):
        for config, shape in cases:
            for async_copy in (False, True)[:1 + (shape[-1] % 4 == 0)]:
                name = "-".join((mode, "x".join(map(str, dataclasses.astuple(config))),
                                 "x".join(map(str, shape)), "cp.async" if async_copy else "plain"))
                marks = [pytest.mark.gpu] if mode == "gpu" else []
                params.append(pytest.param(config, shape, async_copy, id=name, marks=marks))
    return params
