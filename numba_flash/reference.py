"""The semantics of every variant, written once against the NumPy API: standard
(materialising) attention.

`xp` is the array module: numpy for the float64 reference on the CPU (the truth every backend
is checked against), cupy for the GPU baseline. The score matrix S = Q Kᵀ·scale of shape
(batch, nheads, seqlen_q, seqlen_k) is built in full, which is exactly what FlashAttention
avoids. `spec` is the call's numba_flash.spec.AttentionSpec. Layout of q, k, v, out, dout:
(batch, seqlen, nheads, headdim), k and v with nheads / spec.group heads; lse: (batch, nheads,
seqlen_q).

Per score, in this order: scale, softcap (s -> softcap · tanh(s / softcap)), then the mask
(causal and window: -inf where the query does not see the key).
"""


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


def _to_heads(xp, x, dtype):
    """(B, N, H, D) -> (B, H, N, D) in dtype."""
    return xp.asarray(x).astype(dtype).transpose(0, 2, 1, 3)


def _scores(xp, q, k, spec, dtype):
    """(scores with -inf where masked, the score mod's derivative or None), (B, H, Nq, Nk)."""
    k = expand_kv(xp, k, spec.group)
    s = (_to_heads(xp, q, dtype) @ _to_heads(xp, k, dtype).transpose(0, 1, 3, 2))
    s, ds_dscaled = score_mod(xp, s * xp.asarray(spec.softmax_scale, dtype=dtype), spec)
    mask = visible(xp, spec, q.shape[1], k.shape[1])
    if mask is not None:  # the keys a query does not see score -inf
        s = xp.where(mask, s, xp.asarray(-xp.inf, dtype))
    return s, ds_dscaled


def attention_forward(xp, q, k, v, spec, dtype):
    """Return (out, lse) computed in `dtype`. A row that sees no key gets out 0 and lse -inf."""
    s, _ = _scores(xp, q, k, spec, dtype)
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


def attention_backward(xp, dout, q, k, v, out, lse, spec, dtype):
    """Analytic gradients (dq, dk, dv) in `dtype`, with P recomputed from the saved lse."""
    s, ds_dscaled = _scores(xp, q, k, spec, dtype)
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
