"""The accuracy rule, for the tests and scripts/verify.py.

A backend's max error against a float64 reference must be at most twice the error of a plain
implementation in the input precision (standard attention computed in that dtype), plus a small
floor relative to the magnitude of the values.
"""
import numpy as np

from numba_flash.extras import NO_EXTRAS
from numba_flash.reference import (biased_and_masked, expand_kv, per_sequence, reduce_kv,
                                   score_mod)

FLOOR = {"float16": 1e-4, "bfloat16": 1e-3, "float32": 1e-5, "float64": 1e-12}


def max_error(got, ref):
    """Max |got - ref| over the entries where ref is finite. Non-finite entries must match the
    reference's exactly (NaN where it has NaN, -inf lse of a row with no key, ...); any other
    mismatch returns inf."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        raise ValueError(f"shape {got.shape} differs from the reference's {ref.shape}")
    finite = np.isfinite(ref)
    if not np.array_equal(np.isfinite(got), finite) or \
            not np.array_equal(got[~finite], ref[~finite], equal_nan=True):
        return float("inf")
    return float(np.abs(got[finite] - ref[finite]).max()) if finite.any() else 0.0


def error_bound(baseline_error, ref, dtype):
    """2 x the plain implementation's error + FLOOR[dtype] x max(1, max |ref|)."""
    if not np.isfinite(baseline_error):  # an infinite bound would let anything pass
        raise ValueError("the baseline's non-finite entries differ from the reference's")
    ref = np.asarray(ref, np.float64)
    finite = ref[np.isfinite(ref)]
    scale = max(1.0, float(np.abs(finite).max())) if finite.size else 1.0
    return 2.0 * baseline_error + FLOOR[str(dtype)] * scale


# -- "plain" 16-bit standard attention, emulated in float32 ----------------------------------
# What a 16-bit implementation of standard attention computes (float32 products and softmax,
# P and dS rounded to the 16-bit type before they enter a matmul, results rounded). It sets the
# error bound for bfloat16, which neither NumPy nor CuPy computes in. `xp` is numpy or cupy.

def bf16_bits(xp, x):
    """float32 values -> bfloat16 bit patterns (uint16), rounded to nearest even."""
    bits = xp.asarray(x, xp.float32).view(xp.uint32).astype(xp.uint64)
    return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF).astype(xp.uint16)


def bf16_values(xp, bits):
    """bfloat16 bit patterns -> their float32 values."""
    return (xp.asarray(bits).astype(xp.uint32) << 16).view(xp.float32)


def round16(xp, x, dtype):
    """float32 values rounded to float16 or bfloat16, returned as float32."""
    x = xp.asarray(x, xp.float32)
    if dtype == "float16":
        return x.astype(xp.float16).astype(xp.float32)
    return bf16_values(xp, bf16_bits(xp, x))


def _masked_scores(xp, q, k, spec, extras):
    """(float32 scores, -inf where masked; the score mod's derivative or None)."""
    k = expand_kv(xp, k, spec.group)
    s = xp.einsum("bqhd,bkhd->bhqk", q, k).astype(xp.float32) * xp.float32(spec.softmax_scale)
    s, ds_dscaled = score_mod(xp, s, spec)
    return biased_and_masked(xp, s, spec, extras, xp.float32), ds_dscaled


def plain16_forward(xp, q, k, v, spec, dtype, extras=NO_EXTRAS):
    """(out, lse) of standard attention as a 16-bit implementation computes them."""
    if spec.varlen:
        return per_sequence(xp, _plain16_forward_of(dtype), spec, extras, xp.float32,
                            (q, k, v), (0, 1, 1), (0, None))
    s, _ = _masked_scores(xp, q, k, spec, extras)
    m = s.max(-1, keepdims=True)
    p = xp.exp(s - xp.where(xp.isneginf(m), xp.float32(0), m))
    l = p.sum(-1, keepdims=True)
    out = xp.einsum("bhqk,bkhd->bqhd", round16(xp, p, dtype), expand_kv(xp, v, spec.group))
    out = out / xp.where(l == 0, xp.float32(1), l).transpose(0, 2, 1, 3)
    lse = xp.where(l == 0, xp.float32(-xp.inf), m + xp.log(xp.where(l == 0, 1, l)))[..., 0]
    return round16(xp, out, dtype), lse


def plain16_backward(xp, dout, q, k, v, out, lse, spec, dtype, extras=NO_EXTRAS):
    """(dq, dk, dv) of standard attention as a 16-bit implementation computes them."""
    if spec.varlen:
        return per_sequence(xp, _plain16_backward_of(dtype), spec, extras, xp.float32,
                            (dout, q, k, v, out, lse), (0, 0, 1, 1, 0, 0), (0, 1, 1))
    s, ds_dscaled = _masked_scores(xp, q, k, spec, extras)
    k, v = (expand_kv(xp, x, spec.group) for x in (k, v))
    p = xp.exp(s - xp.where(xp.isneginf(lse), xp.float32(xp.inf), lse)[..., None])
    delta = xp.einsum("bqhd,bqhd->bhq", dout, out)[..., None]
    dp = xp.einsum("bqhd,bkhd->bhqk", dout, v)
    ds = p * (dp - delta)
    ds = round16(xp, ds if ds_dscaled is None else ds * ds_dscaled, dtype)
    p = round16(xp, p, dtype)
    dv = reduce_kv(xp, xp.einsum("bhqk,bqhd->bkhd", p, dout), spec.group)
    scale = xp.float32(spec.softmax_scale)
    dq = xp.einsum("bhqk,bkhd->bqhd", ds, k) * scale
    dk = reduce_kv(xp, xp.einsum("bhqk,bqhd->bkhd", ds, q) * scale, spec.group)
    return tuple(round16(xp, x, dtype) for x in (dq, dk, dv))


def _plain16_forward_of(dtype):
    """plain16_forward in per_sequence's calling convention (which computes in float32 and
    rounds to `dtype`)."""
    def forward(xp, q, k, v, spec, _, extras):
        return plain16_forward(xp, q, k, v, spec, dtype, extras)
    return forward


def _plain16_backward_of(dtype):
    def backward(xp, dout, q, k, v, out, lse, spec, _, extras):
        return plain16_backward(xp, dout, q, k, v, out, lse, spec, dtype, extras)
    return backward
