"""The tensor-core kernels' test cases, shared by tests/kernels/mma and tests/variants: 16-bit
inputs as bit patterns, one launch into poisoned outputs, every result checked against float64.
`options` are AttentionSpec fields (window_left, window_right, softcap); kv_heads (GQA) gives
k and v fewer heads than q."""
import numpy as np
from error_rule import assert_within_rule

from numba_flash.backends.numba.mma.bwd import launch_mma_backward
from numba_flash.backends.numba.mma.fwd import launch_mma_forward
from numba_flash.reference import attention_backward, attention_forward
from numba_flash.spec import AttentionSpec
from numba_flash.testing import bf16_bits, bf16_values, plain16_backward, plain16_forward

#: a quiet NaN both as float16 and as bfloat16 bits: what outputs are poisoned with
NAN16 = 0x7FC0


def encode(x, dtype):
    """(16-bit patterns, the float32 values they hold)."""
    if dtype == "float16":
        half = x.astype(np.float16)
        return half.view(np.uint16), half.astype(np.float32)
    bits = bf16_bits(np, x)
    return bits, bf16_values(np, bits)


def decode(bits, dtype):
    return bits.view(np.float16).astype(np.float32) if dtype == "float16" else bf16_values(np, bits)


def make_case_spec(shape, causal, dtype, kv_heads, options):
    """(spec, nheads of k and v) of a case."""
    nheads, head_dim = shape[3], shape[4]
    kv_heads = kv_heads or nheads
    spec = AttentionSpec(head_dim, dtype, causal=causal, softmax_scale=head_dim ** -0.5,
                         group=nheads // kv_heads, **options)
    return spec, kv_heads


def run_forward(rng, shape, causal, dtype, config, kv_heads=None, **options):
    """launch_mma_forward on random 16-bit inputs into poisoned outputs; out checked by the
    rule against float64, lse against float64 (the same rows -inf, the others within 1e-4)."""
    batch, seqlen_q, seqlen_k, nheads, head_dim = shape
    spec, kv_heads = make_case_spec(shape, causal, dtype, kv_heads, options)
    draw = lambda n, h: rng.standard_normal((batch, n, h, head_dim))  # noqa: E731
    (qb, q), (kb, k), (vb, v) = (encode(draw(n, h), dtype) for n, h in
                                 ((seqlen_q, nheads), (seqlen_k, kv_heads), (seqlen_k, kv_heads)))
    out = np.full(qb.shape, NAN16, np.uint16)  # poisoned
    lse = np.full((batch, nheads, seqlen_q), np.nan, np.float32)
    launch_mma_forward(spec, qb, kb, vb, out, lse, config=config)
    ref_out, ref_lse = attention_forward(np, q, k, v, spec, np.float64)
    base_out, _ = plain16_forward(np, q, k, v, spec, dtype)
    assert_within_rule("out", decode(out, dtype), base_out, ref_out, "float16")
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    assert np.array_equal(lse[~finite], ref_lse[~finite])  # -inf where a row sees no key
    scale = max(1, np.abs(ref_lse[finite]).max())
    assert np.abs(lse[finite] - ref_lse[finite]).max() < 1e-4 * scale


def run_backward(rng, shape, causal, dtype, config, kv_heads=None, **options):
    """launch_mma_backward on random 16-bit inputs (out, lse from float64 attention), each
    gradient checked by the rule against float64."""
    batch, seqlen_q, seqlen_k, nheads, head_dim = shape
    spec, kv_heads = make_case_spec(shape, causal, dtype, kv_heads, options)
    draw = lambda n, h: rng.standard_normal((batch, n, h, head_dim))  # noqa: E731
    sizes = ((seqlen_q, nheads), (seqlen_k, kv_heads), (seqlen_k, kv_heads), (seqlen_q, nheads))
    (qb, q), (kb, k), (vb, v), (dob, do) = (encode(draw(n, h), dtype) for n, h in sizes)
    ref_out, ref_lse = attention_forward(np, q, k, v, spec, np.float64)
    outb, out = encode(np.ascontiguousarray(ref_out), dtype)
    lse = np.ascontiguousarray(ref_lse, np.float32)
    grads = [np.full(x.shape, NAN16, np.uint16) for x in (qb, kb, vb)]  # poisoned
    delta = np.full(lse.shape, np.nan, np.float32)
    launch_mma_backward(spec, dob, qb, kb, vb, outb, lse, delta, *grads, config=config)
    refs = attention_backward(np, do, q, k, v, out, lse, spec, np.float64)
    bases = plain16_backward(np, do, q, k, v, out, lse, spec, dtype)
    for name, got, base, ref in zip(("dq", "dk", "dv"), grads, bases, refs):
        assert_within_rule(name, decode(got, dtype), base, ref, "float16")
