"""What is done with a score before the softmax: softcapping, ALiBi, a floating attn_mask.

Without a score mod the kernels keep raw scores S = Q Kᵀ and fold softmax_scale·log2(e) into
each exponential (device/softmax.py), with one multiply per row max. A score mod needs the
scaled score itself, so a kernel with one replaces each raw score s of query row `row` and key
`col` by `score(s, pre, slope, row, col, offset, seqlen_k, mask_at)`, the modified score
already in log2 units, before the mask (which must leave -inf, and tanh would not), and then
exponentiates with a scale of one (offset = seqlen_k - seqlen_q; mask_at: the block's
(attn_mask, b, h), device/attn_mask.py).

For softcap c the modified score is c·tanh(s·scale / c), in log2 units c·log2(e)·tanh(s·scale
/ c); the backward multiplies dS by its derivative with respect to s·scale, 1 - tanh(s·scale /
c)². ALiBi then adds -slope·|row + seqlen_k - seqlen_q - col| (the distance from the row's
diagonal key), in log2 units with slope·log2(e) (`head_slope`, read once per head),
and a floating attn_mask its value times log2(e); these do not depend on s, so the derivative
is the softcap's, or one.

tanh is 1 - 2 / (2^(2·log2(e)·x) + 1): one ex2 and one approximate reciprocal (rcp.approx, a
MUFU instruction like ex2, where a float32 division is a reciprocal, two fused multiply-adds
and a slow path), exact to a few units in the last place of float32 in absolute terms (for
|x| near 0 as everywhere; 2^(...) overflowing gives 1, flushing to 0 gives -1). libdevice's
tanhf, with its two branches, took the float32 head-dim-128 dK/dV kernel past 255 registers
(a spill).
"""
import collections
import functools

import numpy as np
from numba import cuda, float32

from .attn_mask import make_mask_readers
from .constants import LOG2E, ONE, ZERO
from .intrinsics import exp2, reciprocal

TWO = np.float32(2.0)


ScoreMod = collections.namedtuple("ScoreMod", "active score score_and_grad scales head_slope")


@functools.lru_cache(maxsize=None)
def make_score_mod(spec):
    """ScoreMod(active, score, score_and_grad, scales, head_slope) for the spec
    (for_kernels()).

    active: whether the spec has a score mod. scales(scale_log2) -> (tile_scale, pre): what
    the exponentials multiply scores by (scale_log2 = softmax_scale·log2(e), the kernels'
    argument, for raw scores; one for modified ones) and the score mod's own factor.
    head_slope(alibi_slopes, seq, h) -> ALiBi's slope of sequence seq and query head h in
    log2 units (0 without ALiBi). score(s, pre, slope, row, col, offset, seqlen_k, mask_at)
    -> the modified score in log2 units; score_and_grad(...) -> (that, its derivative with
    respect to the scaled score). Without a score mod, score_and_grad is (s, 1) (the raw
    score, which the exponential scales) and a kernel never calls score."""
    if not spec.score_modded:
        return ScoreMod(False, _raw, _raw_and_one, _raw_scales, _no_slope)
    softcap, alibi, float_mask = spec.softcap, spec.alibi, spec.float_mask
    mask_bias = make_mask_readers(spec)[1]
    cap_log2 = np.float32(softcap * float(LOG2E))
    # softcap: scale_log2 · 2 / c = 2·log2(e)·scale / c; ALiBi alone: the scale itself
    pre_factor = np.float32(2.0 / softcap) if softcap else ONE

    @cuda.jit(device=True, inline="always")
    def scales(scale_log2):
        return ONE, scale_log2 * pre_factor

    @cuda.jit(device=True, inline="always")
    def tanh_of_scaled(s, pre):
        return ONE - TWO * reciprocal(exp2(s * pre) + ONE)

    @cuda.jit(device=True, inline="always")
    def bias(slope, row, col, offset, seqlen_k, mask_at):
        # (no 0 + x where a term is absent: IEEE keeps that addition)
        alibi_term = -slope * float32(abs(row + offset - col))  # (diagonal key: row + offset)
        if float_mask:
            mask_term = mask_bias(mask_at, row, col, seqlen_k - offset, seqlen_k)
            return alibi_term + mask_term if alibi else mask_term
        return alibi_term if alibi else ZERO

    @cuda.jit(device=True, inline="always")
    def score_and_grad(s, pre, slope, row, col, offset, seqlen_k, mask_at):
        added = bias(slope, row, col, offset, seqlen_k, mask_at)
        if softcap:
            t = tanh_of_scaled(s, pre)
            return cap_log2 * t + added, ONE - t * t
        return s * pre + added, ONE

    @cuda.jit(device=True, inline="always")
    def score(s, pre, slope, row, col, offset, seqlen_k, mask_at):
        return score_and_grad(s, pre, slope, row, col, offset, seqlen_k, mask_at)[0]

    @cuda.jit(device=True, inline="always")
    def head_slope(alibi_slopes, seq, h):
        if alibi:
            return alibi_slopes[seq, h] * LOG2E
        return ZERO

    return ScoreMod(True, score, score_and_grad, scales, head_slope)


@cuda.jit(device=True, inline="always")
def _no_slope(alibi_slopes, seq, h):
    return ZERO


@cuda.jit(device=True, inline="always")
def _raw_scales(scale_log2):
    return scale_log2, ONE


@cuda.jit(device=True, inline="always")
def _raw(s, pre, slope, row, col, offset, seqlen_k, mask_at):
    return s


@cuda.jit(device=True, inline="always")
def _raw_and_one(s, pre, slope, row, col, offset, seqlen_k, mask_at):
    return s, ONE
