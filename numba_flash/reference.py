"""The semantics of every variant, written once against the NumPy API: standard
(materialising) attention.

`xp` is the array module: numpy for the float64 reference on the CPU (the truth every backend
is checked against), cupy for the GPU baseline. The score matrix S = Q Kᵀ·scale of shape
(batch, nheads, seqlen_q, seqlen_k) is built in full, which is exactly what FlashAttention
avoids. `spec` is the call's numba_flash.spec.AttentionSpec. Layout of q, k, v, out, dout:
(batch, seqlen, nheads, headdim), k and v with nheads / spec.group heads; lse: (batch, nheads,
seqlen_q).

Per score, in this order: scale, softcap (s -> softcap · tanh(s / softcap)), ALiBi (plus
-slope · |i + seqlen_k - seqlen_q - j|), a floating attn_mask (plus its value), then the mask
(causal, window and a boolean attn_mask: -inf where the query does not see the key). The
call's arrays besides q, k, v come as a numba_flash.extras.Extras. varlen (packed sequences,
q (total_q, nheads, headdim), lse (nheads, total_q)) is the same attention on each sequence
alone (`per_sequence`).
"""
import dataclasses

from numba_flash.extras import NO_EXTRAS
from numba_flash.mask_mod import MaskModProgram


def visible(xp, spec, seqlen_q, seqlen_k):
    """(seqlen_q, seqlen_k) booleans, True where query i sees key j; None where every query
    sees every key. Windows (and causal, their right side 0) are bottom-right aligned: with
    d = i + seqlen_k - seqlen_q, query i sees key j iff d - window_left <= j <= d +
    window_right, a side of -1 unbounded."""
    if not spec.windowed:
        return None
    i = xp.arange(seqlen_q)[:, None]
    j = xp.arange(seqlen_k)[None, :]
    diagonal = i + (seqlen_k - seqlen_q)
    seen = xp.ones((seqlen_q, seqlen_k), bool)
    if spec.window_right >= 0:
        seen &= j <= diagonal + spec.window_right
    if spec.window_left >= 0:
        seen &= j >= diagonal - spec.window_left
    return seen


def expand_kv(xp, x, group):
    """(B, N, H_kv, D) -> (B, N, H_kv · group, D): each key/value head repeated for the query
    heads of its group (GQA); x itself when group is 1."""
    return x if group == 1 else xp.repeat(xp.asarray(x), group, axis=2)


def reduce_kv(xp, dx, group):
    """The gradient of expand_kv: (B, N, H, D) -> (B, N, H / group, D), summed per group."""
    if group == 1:
        return dx
    batch, seqlen, nheads, head_dim = dx.shape
    return dx.reshape(batch, seqlen, nheads // group, group, head_dim).sum(axis=3)


def score_mod(xp, s, spec):
    """(modified scores, their derivative with respect to s) of scaled scores s; the
    derivative is None where it is 1."""
    if not spec.softcap:
        return s, None
    cap = xp.asarray(spec.softcap, dtype=s.dtype)
    t = xp.tanh(s / cap)
    return cap * t, 1 - t * t


def alibi_bias(xp, alibi_slopes, seqlen_q, seqlen_k, dtype):
    """(batch or 1, nheads, seqlen_q, seqlen_k): -slope · |i + seqlen_k - seqlen_q - j|."""
    slopes = xp.asarray(alibi_slopes).astype(dtype)
    slopes = slopes.reshape((-1 if slopes.ndim == 2 else 1, slopes.shape[-1], 1, 1))
    i = xp.arange(seqlen_q)[:, None]
    j = xp.arange(seqlen_k)[None, :]
    return -slopes * xp.abs(i + (seqlen_k - seqlen_q) - j).astype(dtype)


def _to_heads(xp, x, dtype):
    """(B, N, H, D) -> (B, H, N, D) in dtype."""
    return xp.asarray(x).astype(dtype).transpose(0, 2, 1, 3)


def _scores(xp, q, k, spec, dtype, extras):
    """(scores with -inf where masked, the score mod's derivative or None), (B, H, Nq, Nk)."""
    k = expand_kv(xp, k, spec.group)
    s = (_to_heads(xp, q, dtype) @ _to_heads(xp, k, dtype).transpose(0, 1, 3, 2))
    s, ds_dscaled = score_mod(xp, s * xp.asarray(spec.softmax_scale, dtype=dtype), spec)
    return biased_and_masked(xp, s, spec, extras, dtype), ds_dscaled


def biased_and_masked(xp, s, spec, extras, dtype):
    """Softcapped scaled scores s (B, H, Nq, Nk) plus ALiBi and a floating attn_mask, then
    -inf where the query does not see the key (causal, window, a boolean attn_mask)."""
    seqlen_q, seqlen_k = s.shape[-2:]
    if spec.alibi:
        s = s + alibi_bias(xp, extras.alibi_slopes, seqlen_q, seqlen_k, dtype)
    if spec.float_mask:
        s = s + _mask_4d(xp, extras.attn_mask).astype(dtype)
    mask = visible(xp, spec, seqlen_q, seqlen_k)
    if spec.bool_mask:
        given = _mask_4d(xp, extras.attn_mask)
        mask = given if mask is None else mask & given
    if spec.mask_mod is not None:
        given = mask_mod_grid(xp, spec.mask_mod, extras.mask_mod_arrays, *s.shape)
        mask = given if mask is None else mask & given
    if mask is None:
        return s
    return xp.where(mask, s, xp.asarray(-xp.inf, dtype))


def mask_mod_grid(xp, program, captured, batch, nheads, seqlen_q, seqlen_k):
    """A MaskModProgram's mask_mod(b, h, q_idx, kv_idx) at every index, booleans
    broadcastable to (batch, nheads, seqlen_q, seqlen_k): called once on broadcasting index
    arrays (what a mask made of comparisons, & and | and indexing does), else once per index
    with Python ints, reading host copies of the captured arrays (a device array's element
    would cost a synchronisation each)."""
    import numpy as np
    shape = (batch, nheads, seqlen_q, seqlen_k)
    indices = [xp.arange(n).reshape([n if i == axis else 1 for i in range(4)])
               for axis, n in enumerate(shape)]
    try:
        grid = xp.asarray(_bound(xp, program, captured)(*indices))
        if grid.dtype == bool and len(grid.shape) <= 4:
            return xp.broadcast_to(grid, shape)
    except Exception:  # (e.g. `if` or `and` on an array: one index at a time below)
        pass
    mask_mod = _bound(np, program, captured)
    try:
        values = [bool(_boolean(mask_mod(*index))) for index in np.ndindex(*shape)]
    except TypeError:
        raise
    except Exception as error:
        raise ValueError(f"mask_mod failed: {type(error).__name__}: {error}") from error
    return xp.asarray(np.array(values, bool).reshape(shape))


def _boolean(value):
    """mask_mod's value at one index, which must be a boolean."""
    dtype = getattr(value, "dtype", None)
    if not isinstance(value, bool) and (dtype is None or dtype != bool):
        raise TypeError(f"mask_mod must return a bool; it returned {type(value).__name__}"
                        f"{'' if dtype is None else ' of dtype ' + str(dtype)}")
    return value


def _bound(xp, program, captured):
    """mask_mod(b, h, q_idx, kv_idx) of a MaskModProgram (numba_flash/mask_mod.py) reading
    its captured arrays as xp arrays."""
    from numba_flash.extras import host_values
    captured = [host_values(x) if xp.__name__ == "numpy" else xp.asarray(x) for x in captured]

    def mask_mod(b, h, q_idx, kv_idx):
        return program.function(b, h, q_idx, kv_idx, *captured)
    return mask_mod


def at_sequence(program, b):
    """The MaskModProgram of varlen's sequence b, as a dense call on that sequence alone
    sees it."""
    def sequence_mask_mod(_, h, q_idx, kv_idx, *captured):
        return program.function(b, h, q_idx, kv_idx, *captured)
    return MaskModProgram(sequence_mask_mod, program.captured, program.name)


def _mask_4d(xp, attn_mask):
    """attn_mask with its rank made 4 by leading dimensions of 1 (it broadcasts from there)."""
    attn_mask = xp.asarray(attn_mask)
    return attn_mask.reshape((1,) * (4 - attn_mask.ndim) + attn_mask.shape)


def attention_forward(xp, q, k, v, spec, dtype, extras=NO_EXTRAS):
    """Return (out, lse) computed in `dtype`. A row that sees no key gets out 0 and lse -inf."""
    if spec.varlen:
        return per_sequence(xp, attention_forward, spec, extras, dtype, (q, k, v), (0, 1, 1),
                            (0, None))
    s, _ = _scores(xp, q, k, spec, dtype, extras)
    zero = xp.asarray(0, dtype)
    m = s.max(axis=-1, keepdims=True)
    m_safe = xp.where(xp.isneginf(m), zero, m)
    p = xp.exp(s - m_safe)
    l = p.sum(axis=-1, keepdims=True)
    no_key = l == 0  # exactly zero: the row saw no key (NaN inputs keep a NaN l and propagate)
    l_safe = xp.where(no_key, xp.asarray(1, dtype), l)
    v = expand_kv(xp, v, spec.group)
    out = xp.where(no_key, zero, (p @ _to_heads(xp, v, dtype)) / l_safe)
    lse = xp.where(no_key, xp.asarray(-xp.inf, dtype), m_safe + xp.log(l_safe))[..., 0]
    return out.transpose(0, 2, 1, 3), lse


def attention_backward(xp, dout, q, k, v, out, lse, spec, dtype, extras=NO_EXTRAS):
    """Analytic gradients (dq, dk, dv) in `dtype`, with P recomputed from the saved lse."""
    if spec.varlen:
        return per_sequence(xp, attention_backward, spec, extras, dtype,
                            (dout, q, k, v, out, lse), (0, 0, 1, 1, 0, 0), (0, 1, 1))
    s, ds_dscaled = _scores(xp, q, k, spec, dtype, extras)
    lse = xp.asarray(lse).astype(dtype)[..., None]
    lse_safe = xp.where(xp.isneginf(lse), xp.asarray(xp.inf, dtype), lse)  # no key seen: P = 0
    p = xp.exp(s - lse_safe)
    k, v = (expand_kv(xp, x, spec.group) for x in (k, v))
    do, qh, kh, vh, oh = (_to_heads(xp, x, dtype) for x in (dout, q, k, v, out))
    delta = (do * oh).sum(axis=-1, keepdims=True)  # D_i = rowsum(dO_i * O_i)
    dv = p.transpose(0, 1, 3, 2) @ do
    ds = p * (do @ vh.transpose(0, 1, 3, 2) - delta)
    if ds_dscaled is not None:  # through the softcap's tanh
        ds = ds * ds_dscaled
    scale = xp.asarray(spec.softmax_scale, dtype=dtype)
    dq = (ds @ kh) * scale
    dk = (ds.transpose(0, 1, 3, 2) @ qh) * scale
    dq, dk, dv = (x.transpose(0, 2, 1, 3) for x in (dq, dk, dv))
    return dq, reduce_kv(xp, dk, spec.group), reduce_kv(xp, dv, spec.group)


def dense_spec(spec):
    """The spec of one sequence of a varlen call."""
    return dataclasses.replace(spec, varlen=False, max_seqlen_q=None, max_seqlen_k=None)


def per_sequence(xp, function, spec, extras, dtype, arrays, sides, result_sides):
    """`function` (attention_forward or _backward, or a function of their signature) on each
    sequence of a varlen call, its results packed again.

    arrays: the call's packed arrays, (total, nheads, headdim) but lse (nheads, total_q);
    sides: for each, 0 if it runs along the queries, 1 along the keys; result_sides: the same
    for the results, None for an lse. A sequence without keys gets zeros (lse -inf)."""
    from numba_flash.extras import host_values
    bounds = [host_values(extras.cu_seqlens_q), host_values(extras.cu_seqlens_k)]
    one = dense_spec(spec)
    slopes = extras.alibi_slopes
    results = None
    for b in range(len(bounds[0]) - 1):
        ranges = [(int(c[b]), int(c[b + 1])) for c in bounds]
        parts = [x[:, slice(*ranges[0])][None] if x.ndim == 2 else x[slice(*ranges[side])][None]
                 for x, side in zip(arrays, sides)]
        if slopes is not None:
            part_extras = extras._replace(alibi_slopes=slopes[b] if slopes.ndim == 2 else slopes)
        else:
            part_extras = extras
        if spec.mask_mod is not None:
            one = dataclasses.replace(one, mask_mod=at_sequence(spec.mask_mod, b))
        if results is None:
            results = [_packed_like(xp, arrays, sides, side, dtype) for side in result_sides]
        if ranges[0][0] == ranges[0][1]:
            continue
        if ranges[1][0] == ranges[1][1]:  # no key: out and gradients 0, lse -inf
            continue
        for result, side, part in zip(results, result_sides, function(
                xp, *parts, one, dtype, part_extras)):
            if side is None:
                result[:, slice(*ranges[0])] = part[0]
            else:
                result[slice(*ranges[side])] = part[0]
    return tuple(results)


def _packed_like(xp, arrays, sides, side, dtype):
    """A packed result along side 0 or 1 (None: an lse), zeros (lse: -inf)."""
    if side is None:
        q = arrays[list(sides).index(0)]
        return xp.full((q.shape[1], q.shape[0]), -xp.inf, dtype)
    x = arrays[list(sides).index(side)]
    return xp.zeros(x.shape, dtype)


def online_softmax_steps(scores, values, block):
    """The online softmax of one query row, key block by key block, as the kernels run it
    (float64, natural exponentials): for each block the states after it, as dicts of
    `scores` (the block's), `block_max`, `m` (the running max), `rescale` (exp(m_old -
    m_new), the factor the old sum and accumulator take), `l` (the running sum) and `acc`
    (the unnormalised output), with `out` = acc / l. After the last block `out` is
    softmax(scores) · values exactly (up to rounding), which no step needed the whole row for.

    scores: (n,) scaled scores of the row; values: (n, d); block: keys per block."""
    import numpy as np
    scores, values = np.asarray(scores, np.float64), np.asarray(values, np.float64)
    m, l, acc = -np.inf, 0.0, np.zeros(values.shape[1])
    steps = []
    for start in range(0, len(scores), block):
        s, v = scores[start:start + block], values[start:start + block]
        m_new = max(m, float(s.max()))
        rescale = float(np.exp(m - m_new))  # exp(-inf) = 0 before the first block
        p = np.exp(s - m_new)
        l = l * rescale + float(p.sum())
        acc = acc * rescale + p @ v
        m = m_new
        steps.append(dict(scores=s.tolist(), block_max=float(s.max()), m=m, rescale=rescale,
                          l=l, acc=acc.tolist(), out=(acc / l).tolist()))
    return steps
