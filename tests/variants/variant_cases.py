"""The variant cases both kernel families' variant tests share (test_simt_kernels.py,
test_tensor_core_kernels.py): fixed cases for each kind of variant, the strategies of the
sampled combinations, the one-warp tile configs, and the SIMT runner (the tensor-core runners
are tests/mma_cases.py's)."""
import numpy as np
from error_rule import assert_within_rule
from hypothesis import strategies as st
from mma_cases import make_case_spec

from numba_flash.backends.numba.mma.config import MmaBackwardConfig, MmaConfig
from numba_flash.backends.numba.simt.bwd import launch_backward
from numba_flash.backends.numba.simt.config import SimtBackwardConfig, SimtForwardConfig
from numba_flash.backends.numba.simt.fwd import launch_forward
from numba_flash.reference import attention_backward, attention_forward
from numba_flash.testing import plain16_backward, plain16_forward

SIMT_FORWARD = SimtForwardConfig(1, 2, 2)  # 8 queries x 16 keys
SIMT_BACKWARD = SimtBackwardConfig(1, 1, 2, 1, 2)  # dk/dv: 4 keys x 16 queries; dq: 4 x 16
MMA_FORWARD = MmaConfig(block_n=16, warps=1)
MMA_BACKWARD = MmaBackwardConfig(block_m=16, block_n=16, warps=1)

# (name, (batch, seqlen_q, seqlen_k, nheads, head_dim), kv_heads, causal, options)
FIXED = [
    ("mqa-causal", (1, 17, 21, 8, 16), 1, True, {}),
    ("gqa2-window-within-a-tile", (1, 30, 37, 2, 16), 1, False,
     dict(window_left=2, window_right=1)),
    ("window-wider-than-the-sequence", (2, 19, 13, 1, 16), 1, False,
     dict(window_left=100, window_right=100)),
    ("rows-that-see-no-key", (1, 29, 9, 2, 16), 1, True, dict(window_left=1)),
    ("gqa4-softcap-causal", (1, 18, 25, 4, 16), 1, True, dict(softcap=1.5)),
    ("softcap-left-window", (1, 33, 33, 1, 16), 1, False,
     dict(softcap=0.5, window_left=5, window_right=-1)),
]
FIXED_IDS = [case[0] for case in FIXED]


def run_simt(rng, shape, kv_heads, causal, dtype, async_copy, options):
    """The SIMT forward and backward (float32 arithmetic; float32 or float16 inputs)."""
    batch, seqlen_q, seqlen_k, nheads, head_dim = shape
    spec, kv_heads = make_case_spec(shape, causal, dtype, kv_heads, options)
    draw = lambda n, h: rng.standard_normal((batch, n, h, head_dim)).astype(dtype)  # noqa: E731
    q, k, v, dout = (draw(n, h) for n, h in ((seqlen_q, nheads), (seqlen_k, kv_heads),
                                             (seqlen_k, kv_heads), (seqlen_q, nheads)))
    if dtype == "float32":
        plain_forward = lambda *a: attention_forward(np, *a, np.float32)  # noqa: E731
        plain_backward = lambda *a: attention_backward(np, *a, np.float32)  # noqa: E731
    else:
        plain_forward = lambda *a: plain16_forward(np, *a, dtype)  # noqa: E731
        plain_backward = lambda *a: plain16_backward(np, *a, dtype)  # noqa: E731
    out = np.full(q.shape, np.nan, dtype)  # poisoned
    lse = np.full((batch, nheads, seqlen_q), np.nan, np.float32)
    launch_forward(spec, q, k, v, out, lse, 0, SIMT_FORWARD, async_copy=async_copy)
    ref_out, ref_lse = attention_forward(np, q, k, v, spec, np.float64)
    base_out, base_lse = plain_forward(q, k, v, spec)
    assert_within_rule("out", out, base_out, ref_out, dtype)
    assert_within_rule("lse", lse, base_lse, ref_lse, "float32")

    out = np.ascontiguousarray(ref_out, dtype)
    lse = np.ascontiguousarray(ref_lse, np.float32)
    grads = [np.full(x.shape, np.nan, dtype) for x in (q, k, v)]  # poisoned
    delta = np.full(lse.shape, np.nan, np.float32)
    launch_backward(spec, dout, q, k, v, out, lse, delta, *grads, 0, async_copy=async_copy,
                    config=SIMT_BACKWARD)
    refs = attention_backward(np, dout, q, k, v, out, lse, spec, np.float64)
    bases = plain_backward(dout, q, k, v, out, lse, spec)
    for name, got, base, ref in zip(("dq", "dk", "dv"), grads, bases, refs):
        assert_within_rule(name, got, base, ref, dtype)


WINDOW_SIDE = st.sampled_from([-1, -1, 0, 1, 3, 7, 20, 100])
OPTIONS = dict(
    seqlen_q=st.integers(1, 33), seqlen_k=st.integers(1, 33),
    group=st.sampled_from([1, 2, 4, 8]), causal=st.booleans(),
    window=st.tuples(WINDOW_SIDE, WINDOW_SIDE),
    softcap=st.one_of(st.just(0.0), st.floats(0.2, 8.0)), seed=st.integers(0, 2**32 - 1))


def spec_options(window, softcap):
    return dict(window_left=window[0], window_right=window[1], softcap=softcap)
