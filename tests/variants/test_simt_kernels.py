"""Every variant through the SIMT kernels (float32 arithmetic; float32 with cp.async and plain
loads, float16), forward and backward, in the simulator: fixed cases for each kind, then a
sampled grid of their combinations (hypothesis, a fixed budget). Launched with one-warp tile
configs into poisoned outputs; every result checked by the accuracy rule against float64."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from variant_cases import (FIXED, FIXED_IDS, MASK_MOD_CASES, MASK_MOD_IDS, OPTIONS, run_simt,
                           spec_options)


@pytest.mark.parametrize("name, shape, kv_heads, causal, options", FIXED, ids=FIXED_IDS)
@pytest.mark.parametrize("dtype, async_copy", [("float32", True), ("float16", False)])
def test_simt_kernels(rng, name, shape, kv_heads, causal, options, dtype, async_copy):
    run_simt(rng, shape, kv_heads, causal, dtype, async_copy, options)


@pytest.mark.parametrize("name, shape, kv_heads, causal, options, loads", MASK_MOD_CASES,
                         ids=MASK_MOD_IDS)
def test_simt_kernels_with_a_mask_mod(rng, name, shape, kv_heads, causal, options, loads):
    run_simt(rng, shape, kv_heads, causal, *loads, options)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**OPTIONS, batch=st.integers(1, 2), kv_heads=st.integers(1, 2),
       head_dim=st.sampled_from([4, 12, 24]),
       loads=st.sampled_from([("float32", True), ("float32", False), ("float16", False)]))
def test_simt_kernels_on_sampled_combinations(batch, seqlen_q, seqlen_k, kv_heads, group,
                                              causal, window, softcap, alibi, varlen, mask,
                                              seed, head_dim, loads):
    shape = (batch, seqlen_q, seqlen_k, kv_heads * group, head_dim)
    run_simt(np.random.default_rng(seed), shape, kv_heads, causal, *loads,
             spec_options(window, softcap, alibi, varlen, batch, seqlen_q, seqlen_k, seed,
                          mask))
