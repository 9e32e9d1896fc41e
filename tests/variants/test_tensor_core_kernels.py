"""Every variant through the tensor-core kernels (float16, bfloat16), forward and backward,
in the simulator, through their launchers with one-warp tile configs (the simulator runs a
Python thread per lane): fixed cases for each kind, then a sampled grid of their combinations
(hypothesis, a fixed budget)."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mma_cases import run_backward, run_forward
from variant_cases import (FIXED, MASK_MOD_CASES, MASK_MOD_IDS, MMA_BACKWARD, MMA_FORWARD,
                           OPTIONS, spec_options)


# The fixed cases but the two of windows alone (wider than the sequence, left only), whose
# rules are the shared device modules' and whose SIMT runs cover them, the simulated tensor
# cores being slow; bfloat16 differs from float16 only in the conversions: one case here (with
# a bfloat16 mask), more sampled.
MMA_CASES = [case + ("float16",) for case in FIXED if case[0] in (
    "mqa-causal", "gqa2-window-within-a-tile", "rows-that-see-no-key", "gqa4-softcap-causal",
    "alibi-causal-gqa2", "varlen-causal-gqa2", "bool-mask-causal-gqa2",
    "float-mask-alibi-softcap")]
MMA_CASES.append(("bfloat16-mask-causal", (1, 18, 18, 2, 16), 1, True,
                  dict(attn_mask="bfloat16"), "bfloat16"))


@pytest.mark.parametrize("name, shape, kv_heads, causal, options, dtype", MMA_CASES,
                         ids=[f"{case[0]}-{case[5]}" for case in MMA_CASES])
def test_tensor_core_kernels(rng, name, shape, kv_heads, causal, options, dtype):
    run_forward(rng, shape, causal, dtype, MMA_FORWARD, kv_heads, **options)
    run_backward(rng, shape, causal, dtype, MMA_BACKWARD, kv_heads, **options)


@pytest.mark.parametrize("name, shape, kv_heads, causal, options, loads", MASK_MOD_CASES[::2],
                         ids=MASK_MOD_IDS[::2])
def test_tensor_core_kernels_with_a_mask_mod(rng, name, shape, kv_heads, causal, options,
                                             loads):
    """(float16; the document mask and varlen's striped one: the tile tables' two sources)"""
    run_forward(rng, shape, causal, "float16", MMA_FORWARD, kv_heads, **options)
    run_backward(rng, shape, causal, "float16", MMA_BACKWARD, kv_heads, **options)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**OPTIONS, dtype=st.sampled_from(["float16", "bfloat16"]))
def test_tensor_core_kernels_on_sampled_combinations(seqlen_q, seqlen_k, group, causal, window,
                                                     softcap, alibi, varlen, mask, seed,
                                                     dtype):
    """(one batch, or two varlen sequences, and one key/value head: the simulated tensor
    cores are slow)"""
    rng = np.random.default_rng(seed)
    shape, kv_heads = (1, seqlen_q, seqlen_k, group, 16), 1
    options = spec_options(window, softcap, alibi, varlen, 2, seqlen_q, seqlen_k, seed,
                           mask)
    run_forward(rng, shape, causal, dtype, MMA_FORWARD, kv_heads, **options)
    run_backward(rng, shape, causal, dtype, MMA_BACKWARD, kv_heads, **options)
