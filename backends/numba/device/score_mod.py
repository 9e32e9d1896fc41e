"""What is done with a score before the softmax: softcapping, ALiBi.

Without a score mod the kernels keep raw scores S = Q Kᵀ and fold softmax_scale·log2(e) into
each exponential (device/softmax.py), with one multiply per row max. A score mod needs the
scaled score itself, so a kernel with one replaces each raw score s by `score(s, pre, slope,
query_pos, key_pos)`, the modified score already in log2 units, before the mask (which must
leave -inf, and tanh would not), and then exponentiates with a scale of one.

For softcap c the modified score is c·tanh(s·scale / c), in log2 units c·log2(e)·tanh(s·scale
/ c); the backward multiplies dS by its derivative with respect to s·scale, 1 - tanh(s·scale /
c)². ALiBi then adds -slope·|query_pos - key_pos| (query_pos: the row's diagonal key, row +
seqlen_k - seqlen_q), in log2 units with slope·log2(e) (`head_slope`, read once per head);
it does not depend on s, so the derivative is the softcap's, or one.

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
    log2 units (0 without ALiBi). score(s, pre, slope, query_pos, key_pos) -> the modified
    score in log2 units; score_and_grad(...) -> (that, its derivative with respect to the
    scaled score). Without a score mod, score_and_grad is (s, 1) (the raw score, which the
    exponential scales) and a kernel never calls score."""
    if not spec.score_modded:
        return ScoreMod(False, _raw, _raw_and_one, _raw_scales, _no_slope)
    softcap, alibi = spec.softcap, spec.alibi
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
    def bias(slope, query_pos, key_pos):
        if alibi:
            return -slope * float32(abs(query_pos - key_pos))
        return ZERO

    @cuda.jit(device=True, inline="always")
    def score_and_grad(s, pre, slope, query_pos, key_pos):
        if softcap:
            t = tanh_of_scaled(s, pre)
            return cap_log2 * t + bias(slope, query_pos, key_pos), ONE - t * t
        return s * pre + bias(slope, query_pos, key_pos), ONE

    @cuda.jit(device=True, inline="always")
    def score(s, pre, slope, query_pos, key_pos):
        return score_and_grad(s, pre, slope, query_pos, key_pos)[0]

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
def _raw(s, pre, slope, query_pos, key_pos):
    return s


@cuda.jit(device=True, inline="always")
def _raw_and_one(s, pre, slope, query_pos, key_pos):
    return s, ONE
