"""The online softmax's scalar rules, in log2 units (scores times softmax_scale·log2(e), so
that every exponential is one exp2).

Forward, per query row: a running max m_i and sum l_i; for each key tile,
    m_new, m_ref, alpha = online_update(m_i, tile_max · scale_log2)
    P = probability(S, scale_log2, m_ref);  l_i = l_i · alpha + rowsum(P);  acc = acc · alpha + P V
and at the end `finalize(l_i, m_i)` gives 1 / l_i and the lse (natural log).
Backward: P = probability(S, scale_log2, lse_log2(lse)) and dS = grad_score(P, dP, D).
"""
import math

from numba import cuda

from .constants import LN2, LOG2E, NEG_INF, ONE, POS_INF, ZERO
from .intrinsics import exp2


@cuda.jit(device=True, inline="always")
def online_update(m_old, tile_max):
    """(m_new, m_ref, alpha): the new running max, the max the exponentials subtract (0 while
    the row has seen no key, so that -inf - -inf never happens) and the rescale factor of the
    old sum and accumulator, exp2(m_old - m_ref)."""
    m_new = max(m_old, tile_max)
    m_ref = m_new if m_new != NEG_INF else ZERO
    return m_new, m_ref, exp2(m_old - m_ref)


@cuda.jit(device=True, inline="always")
def probability(s, scale_log2, ref):
    """exp(scale · s - ref'), as one fused multiply-add and one ex2 (ref in log2 units)."""
    return exp2(s * scale_log2 - ref)


@cuda.jit(device=True, inline="always")
def finalize(l_row, m_row):
    """(1 / l, lse) of a row with sum l_row and max m_row; a row that saw no key gets (0, -inf)
    (a NaN input leaves l NaN, and NaN propagates)."""
    if l_row == ZERO:
        return ZERO, NEG_INF
    return ONE / l_row, (m_row + math.log2(l_row)) * LN2


@cuda.jit(device=True, inline="always")
def lse_log2(value):
    """lse in log2 units; a row that saw no key (lse = -inf) gets +inf so that
    P = exp2(S - lse) = 0 there instead of NaN."""
    return value * LOG2E if value != NEG_INF else POS_INF


@cuda.jit(device=True, inline="always")
def grad_score(p, dp, delta):
    """dS = P ∘ (dP - D), D_i = rowsum(dO_i ∘ O_i)."""
    return p * (dp - delta)
