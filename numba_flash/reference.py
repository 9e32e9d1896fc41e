"""The semantics of every variant, written once against the NumPy API: standard
(materialising) attention.

`xp` is the array module: numpy for the float64 reference on the CPU (the truth every backend
is checked against), cupy for the GPU baseline. The score matrix S = Q Kᵀ·scale of shape
(batch, nheads, seqlen_q, seqlen_k) is built in full, which is exactly what FlashAttention
avoids. `spec` is the call's numba_flash.spec.AttentionSpec. Layout of q, k, v, out, dout:
(batch, seqlen, nheads, headdim); lse: (batch, nheads, seqlen_q).
"""


def visible(xp, spec, seqlen_q, seqlen_k):
    """(seqlen_q, seqlen_k) booleans, True where query i sees key j; None where every query
    sees every key. Causal is bottom-right aligned: j <= i + seqlen_k - seqlen_q."""
    if not spec.causal:
        return None
    i = xp.arange(seqlen_q)[:, None]
    j = xp.arange(seqlen_k)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def _to_heads(xp, x, dtype):
    """(B, N, H, D) -> (B, H, N, D) in dtype."""
    return xp.asarray(x).astype(dtype).transpose(0, 2, 1, 3)


def _scores(xp, q, k, spec, dtype):
    s = (_to_heads(xp, q, dtype) @ _to_heads(xp, k, dtype).transpose(0, 1, 3, 2))
    s = s * xp.asarray(spec.softmax_scale, dtype=dtype)
    mask = visible(xp, spec, q.shape[1], k.shape[1])
    if mask is not None:  # the keys a query does not see score -inf
        s = xp.where(mask, s, xp.asarray(-xp.inf, dtype))
    return s


def attention_forward(xp, q, k, v, spec, dtype):
    """Return (out, lse) computed in `dtype`. A row that sees no key gets out 0 and lse -inf."""
    s = _scores(xp, q, k, spec, dtype)
    zero = xp.asarray(0, dtype)
    m = s.max(axis=-1, keepdims=True)
    m_safe = xp.where(xp.isneginf(m), zero, m)
    p = xp.exp(s - m_safe)
    l = p.sum(axis=-1, keepdims=True)
    no_key = l == 0  # exactly zero: the row saw no key (NaN inputs keep a NaN l and propagate)
    l_safe = xp.where(no_key, xp.asarray(1, dtype), l)
    out = xp.where(no_key, zero, (p @ _to_heads(xp, v, dtype)) / l_safe)
    lse = xp.where(no_key, xp.asarray(-xp.inf, dtype), m_safe + xp.log(l_safe))[..., 0]
    return out.transpose(0, 2, 1, 3), lse


def attention_backward(xp, dout, q, k, v, out, lse, spec, dtype):
    """Analytic gradients (dq, dk, dv) in `dtype`, with P recomputed from the saved lse."""
    s = _scores(xp, q, k, spec, dtype)
    lse = xp.asarray(lse).astype(dtype)[..., None]
    lse_safe = xp.where(xp.isneginf(lse), xp.asarray(xp.inf, dtype), lse)  # no key seen: P = 0
    p = xp.exp(s - lse_safe)
    do, qh, kh, vh, oh = (_to_heads(xp, x, dtype) for x in (dout, q, k, v, out))
    delta = (do * oh).sum(axis=-1, keepdims=True)  # D_i = rowsum(dO_i * O_i)
    dv = p.transpose(0, 1, 3, 2) @ do
    ds = p * (do @ vh.transpose(0, 1, 3, 2) - delta)
    scale = xp.asarray(spec.softmax_scale, dtype=dtype)
    dq = (ds @ kh) * scale
    dk = (ds.transpose(0, 1, 3, 2) @ qh) * scale
    return tuple(x.transpose(0, 2, 1, 3) for x in (dq, dk, dv))
