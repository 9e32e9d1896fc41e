"""The SIMT forward kernel (backends/numba/simt/fwd.py) for its tile configs and both kinds of
loads (cp.async, plain) against the float64 reference: under the simulator, small configs of
each layout at small sizes; with `-m gpu`, every candidate of the config table."""
import numpy as np
import pytest
from error_rule import assert_within_rule
from inputs import gpu_cannot_run, simt_kernel_cases

from numba_flash.backends.numba.simt.config import (SimtForwardConfig, simt_forward_candidates,
                                                    simt_forward_shared_bytes)
from numba_flash.backends.numba.simt.fwd import forward_kernel_function, launch_forward
from numba_flash.reference import attention_forward
from numba_flash.spec import AttentionSpec, make_spec

# (config, shape): head dims 24 and 16 (one 4-wide column chunk per thread, most columns
# padding), 100 (read as 100 columns, the output tile padded to 128), 1 (plain loads only);
# eight rows per thread; ragged tiles both ways; rows that see no key (seqlen_q > seqlen_k,
# causal).
SIMULATOR_CASES = [(SimtForwardConfig(1, 2, 2), (1, 17, 37, 2, 24)),
                   (SimtForwardConfig(2, 8, 4), (1, 70, 37, 1, 16)),
                   (SimtForwardConfig(2, 2, 4), (1, 20, 45, 1, 100)),
                   (SimtForwardConfig(1, 2, 2), (1, 9, 11, 1, 1))]
GPU_CASES = ([(config, (2, 300, 517, 3, head_dim)) for head_dim in (32, 64, 128, 256)
              for config in simt_forward_candidates(head_dim)]
             + [(simt_forward_candidates(64)[0], (1, 517, 300, 2, 64))])  # rows see no key


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config, shape, async_copy",
                         simt_kernel_cases(SIMULATOR_CASES, GPU_CASES))
def test_simt_forward_matches_reference(rng, config, shape, causal, async_copy):
    batch, seqlen_q, seqlen_k, nheads, head_dim = shape
    reason = gpu_cannot_run(simt_forward_shared_bytes(config, head_dim), async_copy)
    if reason:
        pytest.skip(reason)
    draw = lambda n: rng.standard_normal((batch, n, nheads, head_dim)).astype(  # noqa: E731
        np.float32)
    q, k, v = draw(seqlen_q), draw(seqlen_k), draw(seqlen_k)
    out = np.full(q.shape, np.nan, np.float32)  # poisoned
    lse = np.full((batch, nheads, seqlen_q), np.nan, np.float32)
    spec = make_spec(q, causal=causal, softmax_scale=float(rng.uniform(0.05, 0.5)))
    launch_forward(spec, q, k, v, out, lse, 0, config, async_copy=async_copy)
    ref_out, ref_lse = attention_forward(np, q, k, v, spec, np.float64)
    base_out, base_lse = attention_forward(np, q, k, v, spec, np.float32)
    assert_within_rule("out", out, base_out, ref_out, "float32")
    assert_within_rule("lse", lse, base_lse, ref_lse, "float32")


def test_cp_async_loads_are_refused_where_rows_are_not_whole_16_byte_copies():
    with pytest.raises(ValueError, match="cp.async loads take float32 rows of a multiple of 4 "
                                         "floats; got head_dim 30"):
        forward_kernel_function(SimtForwardConfig(1, 2, 2), AttentionSpec(30, "float32"), True)
    with pytest.raises(ValueError, match="got head_dim 32 in bfloat16"):
        forward_kernel_function(SimtForwardConfig(1, 2, 2), AttentionSpec(32, "bfloat16"), True)
