"""Property tests: random small shapes (hypothesis) through the numba kernels in the simulator,
forward and backward, against the float64 reference under the accuracy rule: the SIMT kernels
through the API, the tensor-core kernels through their launchers with random small tile
configs (the API's configs take 4 warps, too many Python threads for the simulator)."""
import numpy as np
from error_rule import assert_within_rule
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mma_cases import run_backward, run_forward

import numba_flash
from numba_flash.backends.numba.mma.config import MmaBackwardConfig, MmaConfig
from numba_flash.reference import attention_backward, attention_forward
from numba_flash.spec import make_spec


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 2), seqlen_q=st.integers(1, 24), seqlen_k=st.integers(1, 24),
       nheads=st.integers(1, 2), headdim=st.integers(1, 72), causal=st.booleans(),
       dtype=st.sampled_from(["float32", "float16"]), seed=st.integers(0, 2**32 - 1))
def test_forward_and_backward_on_random_shapes(batch, seqlen_q, seqlen_k, nheads, headdim,
                                               causal, dtype, seed):
    rng = np.random.default_rng(seed)
    shape = lambda n: (batch, n, nheads, headdim)  # noqa: E731
    q, k, v = (rng.standard_normal(shape(n)).astype(dtype) for n in (seqlen_q, seqlen_k, seqlen_k))
    dout = rng.standard_normal(q.shape).astype(dtype)
    spec = make_spec(q, causal=causal)
    plain = np.dtype(dtype).type

    out, lse = numba_flash.forward(q, k, v, causal=causal, backend="numba")
    ref_out, ref_lse = attention_forward(np, q, k, v, spec, np.float64)
    base_out, base_lse = attention_forward(np, q, k, v, spec, plain)
    assert_within_rule("out", out, base_out, ref_out, dtype)
    assert_within_rule("lse", lse, base_lse, ref_lse, dtype)

    out_in = np.ascontiguousarray(ref_out, dtype)
    lse_in = np.ascontiguousarray(ref_lse, np.float32)
    grads = numba_flash.backward(dout, q, k, v, out_in, lse_in, causal=causal, backend="numba")
    refs = attention_backward(np, dout, q, k, v, out_in, lse_in, spec, np.float64)
    bases = attention_backward(np, dout, q, k, v, out_in, lse_in, spec, plain)
    for name, got, base, ref in zip(("dq", "dk", "dv"), grads, bases, refs):
        assert_within_rule(name, got, base, ref, dtype)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch_heads=st.sampled_from([(1, 1), (1, 2), (2, 1)]), seqlen_q=st.integers(1, 24),
       seqlen_k=st.integers(1, 24), head_dim=st.sampled_from([16, 32]), causal=st.booleans(),
       dtype=st.sampled_from(["float16", "bfloat16"]), block_n=st.sampled_from([16, 32]),
       slices=st.integers(1, 2), block_m=st.sampled_from([16, 32]), stages=st.integers(1, 2),
       seed=st.integers(0, 2**32 - 1))
def test_tensor_core_kernels_on_random_shapes(batch_heads, seqlen_q, seqlen_k, head_dim, causal,
                                              dtype, block_n, slices, block_m, stages, seed):
    """One warp per block (the simulator runs a Python thread per lane); the multi-warp tiles
    and head dims above 64 are covered by the fixed cases of test_mma_forward / _backward."""
    rng = np.random.default_rng(seed)
    (batch, nheads) = batch_heads
    shape = (batch, seqlen_q, seqlen_k, nheads, head_dim)
    run_forward(rng, shape, causal, dtype, MmaConfig(block_n=block_n, warps=1, slices=slices))
    run_backward(rng, shape, causal, dtype,
                 MmaBackwardConfig(block_m=block_m, block_n=block_n, warps=1, stages=stages))
