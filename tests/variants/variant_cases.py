"""The variant cases both kernel families' variant tests share (test_simt_kernels.py,
test_tensor_core_kernels.py): fixed cases for each kind of variant, the strategies of the
sampled combinations, the one-warp tile configs, and the SIMT runner (the tensor-core runners
are tests/mma_cases.py's)."""
import numpy as np
from error_rule import assert_within_rule
from hypothesis import strategies as st
from mask_mods import document_mask, striped_mask
from mma_cases import Layout, make_case_spec

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
    ("mqa-causal", (1, 9, 21, 8, 16), 1, True, {}),  # (eight query heads: one query tile)
    ("gqa2-window-within-a-tile", (1, 30, 37, 2, 16), 1, False,
     dict(window_left=2, window_right=1)),
    ("window-wider-than-the-sequence", (2, 19, 13, 1, 16), 1, False,
     dict(window_left=100, window_right=100)),
    ("rows-that-see-no-key", (1, 29, 9, 2, 16), 1, True, dict(window_left=1)),
    ("gqa4-softcap-causal", (1, 9, 25, 4, 16), 1, True, dict(softcap=1.5)),
    ("softcap-left-window", (1, 33, 33, 1, 16), 1, False,
     dict(softcap=0.5, window_left=5, window_right=-1)),
    ("alibi-causal-gqa2", (1, 13, 19, 2, 16), 1, True, dict(alibi=True)),
    ("alibi-softcap-window", (1, 21, 17, 1, 16), 1, False,
     dict(alibi=True, softcap=2.0, window_left=6, window_right=3)),
    # attn_mask: random masks of the dtype, their dimensions of 1 at random (mma_cases.Layout)
    ("bool-mask-causal-gqa2", (2, 9, 23, 2, 16), 1, True, dict(attn_mask="bool")),
    ("bool-mask-window", (1, 21, 18, 1, 16), 1, False,
     dict(attn_mask="bool", window_left=3, window_right=2)),
    ("float-mask-alibi-softcap", (1, 19, 14, 2, 16), 1, False,
     dict(attn_mask="float32", alibi=True, softcap=1.0)),
    ("float16-mask-causal", (2, 15, 15, 2, 16), 2, True, dict(attn_mask="float16")),
    # varlen: (seqlen_q, seqlen_k) per sequence, with sequences without queries or keys
    ("varlen-causal-gqa2", (4, 17, 21, 2, 16), 1, True,
     dict(lengths=[(5, 9), (0, 4), (17, 21), (9, 0)])),
    ("varlen-alibi-window", (3, 20, 20, 1, 16), 1, False,
     dict(alibi=True, window_left=4, window_right=2, lengths=[(20, 20), (3, 7), (11, 5)])),
]
FIXED_IDS = [case[0] for case in FIXED]

# mask_mod, through the tile tables (tile_classes.py) at the one-warp configs' tiles (several
# tiles each way: spans that cut the ranges, empty tiles inside them), each with the SIMT
# inputs it runs with (dtype, cp.async): the simulator evaluates a mask_mod slowly
MASK_MOD_CASES = [
    ("document-mask-mod-causal-gqa2", (1, 30, 34, 2, 16), 1, True,
     dict(mask_mod=document_mask), ("float32", True)),
    ("striped-mask-mod-softcap", (2, 13, 40, 2, 16), 2, False,
     dict(mask_mod=striped_mask, softcap=2.0), ("float16", False)),
    ("varlen-striped-mask-mod", (3, 13, 40, 2, 16), 1, False,
     dict(mask_mod=striped_mask, lengths=[(13, 40), (0, 5), (6, 21)]), ("float32", False)),
]
MASK_MOD_IDS = [case[0] for case in MASK_MOD_CASES]


def run_simt(rng, shape, kv_heads, causal, dtype, async_copy, options):
    """The SIMT forward and backward (float32 arithmetic; float32 or float16 inputs)."""
    nheads = shape[3]
    options = dict(options)
    lengths = options.pop("lengths", None)
    spec, kv_heads = make_case_spec(shape, causal, dtype, kv_heads, options, lengths)
    case = Layout(rng, spec, shape, lengths, options.get("mask_mod"))
    q, k, v, dout = (case.draw(side, h).astype(dtype) for side, h in
                     ((0, nheads), (1, kv_heads), (1, kv_heads), (0, nheads)))
    if dtype == "float32":
        plain_forward = lambda *a: attention_forward(np, *a, np.float32, case.extras)  # noqa
        plain_backward = lambda *a: attention_backward(np, *a, np.float32, case.extras)  # noqa
    else:
        plain_forward = lambda *a: plain16_forward(np, *a, dtype, case.extras)  # noqa: E731
        plain_backward = lambda *a: plain16_backward(np, *a, dtype, case.extras)  # noqa: E731
    out = np.full(q.shape, np.nan, dtype)  # poisoned
    lse = np.full(case.lse_shape, np.nan, np.float32)
    launch_forward(spec, q, k, v, out, lse, 0, SIMT_FORWARD, async_copy=async_copy,
                   extras=case.kernel_extras(spec, q, k, lse), tiles=case.tiles(spec, q, k, lse))
    refs = [case.ref(x) for x in (q, k, v)]
    ref_out, ref_lse = attention_forward(np, *refs, spec, np.float64, case.extras)
    base_out, base_lse = plain_forward(*refs, spec)
    assert_within_rule("out", case.ref(out), base_out, ref_out, dtype)
    assert_within_rule("lse", case.ref(lse), base_lse, ref_lse, "float32")

    out = np.ascontiguousarray(ref_out, dtype).reshape(q.shape)
    lse = np.ascontiguousarray(ref_lse, np.float32).reshape(case.lse_shape)
    grads = [np.full(x.shape, np.nan, dtype) for x in (q, k, v)]  # poisoned
    delta = np.full(lse.shape, np.nan, np.float32)
    launch_backward(spec, dout, q, k, v, out, lse, delta, *grads, 0, async_copy=async_copy,
                    config=SIMT_BACKWARD, extras=case.kernel_extras(spec, q, k, lse),
                    tiles=case.tiles(spec, q, k, lse))
    ref_arrays = [case.ref(x) for x in (dout, q, k, v, out, lse)]
    refs = attention_backward(np, *ref_arrays, spec, np.float64, case.extras)
    bases = plain_backward(*ref_arrays, spec)
    for name, got, base, ref in zip(("dq", "dk", "dv"), grads, bases, refs):
        assert_within_rule(name, case.ref(got), base, ref, dtype)


WINDOW_SIDE = st.sampled_from([-1, -1, 0, 1, 3, 7, 20, 100])
OPTIONS = dict(
    seqlen_q=st.integers(1, 33), seqlen_k=st.integers(1, 33),
    group=st.sampled_from([1, 2, 4, 8]), causal=st.booleans(),
    window=st.tuples(WINDOW_SIDE, WINDOW_SIDE),
    softcap=st.one_of(st.just(0.0), st.floats(0.2, 8.0)), alibi=st.booleans(),
    varlen=st.booleans(), mask=st.sampled_from([None, None, "bool", "float32"]),
    seed=st.integers(0, 2**32 - 1))


def spec_options(window, softcap, alibi, varlen=False, batch=1, seqlen_q=1, seqlen_k=1,
                 seed=0, mask=None):
    """The runners' options of a sampled case; with varlen, `batch` sequences of random
    lengths up to seqlen_q and seqlen_k (0 included); else an attn_mask of dtype `mask`."""
    options = dict(window_left=window[0], window_right=window[1], softcap=softcap,
                   alibi=alibi, attn_mask=None if varlen else mask)
    if varlen:
        rng = np.random.default_rng(seed + 1)
        lengths = [(int(rng.integers(0, seqlen_q + 1)), int(rng.integers(0, seqlen_k + 1)))
                   for _ in range(batch)]
        lengths[0] = (seqlen_q, seqlen_k)  # (the longest, so that the grid is the case's)
        options["lengths"] = lengths
    return options
