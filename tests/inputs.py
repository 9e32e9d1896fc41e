"""Random attention inputs for the tests (never zeros, fresh per test), and test-case lists."""
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
