"""The SIMT backward kernels (backends/numba/simt/bwd.py) for their tile configs, one and two
stages, and both kinds of loads (cp.async, plain) against the float64 reference: under the
simulator, small configs at small sizes; with `-m gpu`, every candidate of the config table."""
import numpy as np
import pytest
from error_rule import assert_within_rule
from inputs import gpu_cannot_run, simt_kernel_cases

from numba_flash.backends.numba.simt.bwd import backward_kernel_functions, launch_backward
from numba_flash.backends.numba.simt.config import (SimtBackwardConfig, simt_backward_candidates,
                                                    simt_backward_shared_bytes)
from numba_flash.reference import attention_backward, attention_forward
from numba_flash.spec import AttentionSpec, make_spec

# (config, shape): head dims 24 and 16 (most output columns padding), 100, 1 (plain loads
# only); one and two stages;
# ragged tiles both ways, seqlen_q > seqlen_k (causal rows that see no key) and the reverse.
SIMULATOR_CASES = [(SimtBackwardConfig(1, 1, 2, 1, 2, stages=1), (1, 17, 37, 2, 24)),
                   (SimtBackwardConfig(1, 2, 2, 2, 2), (1, 37, 17, 1, 24)),
                   (SimtBackwardConfig(2, 2, 4, 2, 4), (1, 45, 50, 1, 16)),
                   (SimtBackwardConfig(2, 1, 2, 1, 2, stages=1), (1, 20, 30, 1, 100)),
                   (SimtBackwardConfig(1, 1, 2, 1, 2), (1, 9, 11, 1, 1)),
                   # two stages reused: at least 3 streamed tiles in both kernels
                   (SimtBackwardConfig(2, 1, 2, 1, 2), (1, 21, 50, 1, 12)),
                   (SimtBackwardConfig(2, 1, 2, 1, 2), (1, 50, 21, 1, 12))]
GPU_CASES = ([(config, (2, 300, 517, 3, head_dim)) for head_dim in (32, 64, 128, 256)
              for config in simt_backward_candidates(head_dim)]
             + [(simt_backward_candidates(64)[0], (1, 517, 300, 2, 64))])  # rows see no key


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config, shape, async_copy",
                         simt_kernel_cases(SIMULATOR_CASES, GPU_CASES))
def test_simt_backward_matches_reference(rng, config, shape, causal, async_copy):
    batch, seqlen_q, seqlen_k, nheads, head_dim = shape
    reason = gpu_cannot_run(max(simt_backward_shared_bytes(config, head_dim)), async_copy)
    if reason:
        pytest.skip(reason)
    draw = lambda n: rng.standard_normal((batch, n, nheads, head_dim)).astype(  # noqa: E731
        np.float32)
    q, k, v, dout = draw(seqlen_q), draw(seqlen_k), draw(seqlen_k), draw(seqlen_q)
    spec = make_spec(q, causal=causal, softmax_scale=float(rng.uniform(0.05, 0.5)))
    ref_out, ref_lse = attention_forward(np, q, k, v, spec, np.float64)
    out = np.ascontiguousarray(ref_out, np.float32)
    lse = np.ascontiguousarray(ref_lse, np.float32)
    grads = [np.full(x.shape, np.nan, np.float32) for x in (q, k, v)]  # poisoned
    delta = np.full(lse.shape, np.nan, np.float32)
    launch_backward(spec, dout, q, k, v, out, lse, delta, *grads, 0, async_copy=async_copy,
                    config=config)
    refs = attention_backward(np, dout, q, k, v, out, lse, spec, np.float64)
    bases = attention_backward(np, dout, q, k, v, out, lse, spec, np.float32)
    for name, got, base, ref in zip(("dq", "dk", "dv"), grads, bases, refs):
        assert_within_rule(name, got, base, ref, "float32")


def test_cp_async_loads_are_refused_where_rows_are_not_whole_16_byte_copies():
    with pytest.raises(ValueError, match="cp.async loads take float32 rows of a multiple of 4 "
                                         "floats; got head_dim 30"):
        backward_kernel_functions(SimtBackwardConfig(1, 2, 2, 2, 2), AttentionSpec(30, "float32"),
                                  True)
    with pytest.raises(ValueError, match="got head_dim 32 in bfloat16"):
        backward_kernel_functions(SimtBackwardConfig(1, 2, 2, 2, 2), AttentionSpec(32, "bfloat16"),
                                  True)


def test_a_query_tile_wider_than_the_block_is_refused():
    with pytest.raises(ValueError, match="a dk/dv query tile of 64 rows needs as many threads"):
        backward_kernel_functions(SimtBackwardConfig(1, 2, 8, 2, 2), AttentionSpec(32, "float32"))
