"""Property tests: random small shapes (hypothesis) through the numba kernels in the simulator,
forward and backward, against the float64 reference under the accuracy rule."""
import numpy as np
from error_rule import assert_within_rule
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import numba_flash
from numba_flash.standard_attention import attention_backward, attention_forward


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 2), seqlen_q=st.integers(1, 24), seqlen_k=st.integers(1, 24),
       nheads=st.integers(1, 2), headdim=st.integers(1, 72), causal=st.booleans(),
       dtype=st.sampled_from(["float32", "float16"]), seed=st.integers(0, 2**32 - 1))
def test_forward_and_backward_on_random_shapes(batch, seqlen_q, seqlen_k, nheads, headdim,
                                               causal, dtype, seed):
    rng = np.random.default_rng(seed)
    shape = lambda n: (batch, n, nheads, headdim)  # noqa: E731
    q, k, v = (rng.standard_normal(shape(n)).astype(dtype) for n in (seqlen_q, seqlen_k, seqlen_k))
    dout = rng.standard_normal(q.shape).astype(dtype)
    scale = headdim ** -0.5
    plain = np.dtype(dtype).type

    out, lse = numba_flash.forward(q, k, v, causal=causal, backend="numba")
    ref_out, ref_lse = attention_forward(np, q, k, v, causal, scale, np.float64)
    base_out, base_lse = attention_forward(np, q, k, v, causal, scale, plain)
    assert_within_rule("out", out, base_out, ref_out, dtype)
    assert_within_rule("lse", lse, base_lse, ref_lse, dtype)

    out_in = np.ascontiguousarray(ref_out, dtype)
    lse_in = np.ascontiguousarray(ref_lse, np.float32)
    grads = numba_flash.backward(dout, q, k, v, out_in, lse_in, causal=causal, backend="numba")
    refs = attention_backward(np, dout, q, k, v, out_in, lse_in, causal, scale, np.float64)
    bases = attention_backward(np, dout, q, k, v, out_in, lse_in, causal, scale, plain)
    for name, got, base, ref in zip(("dq", "dk", "dv"), grads, bases, refs):
        assert_within_rule(name, got, base, ref, dtype)
