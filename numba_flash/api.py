"""The public functions: forward, backward and attention.

Shapes (flash-attn's layout):
    q, out, dout, dq : (batch, seqlen_q, nheads, headdim)
    k, v, dk, dv     : (batch, seqlen_k, nheads, headdim)
    lse              : (batch, nheads, seqlen_q), float32, natural log

Each call builds its AttentionSpec (numba_flash/spec.py) from its options, then either replays
a call of the same signature seen before (numba_flash/call_cache.py) or checks the arrays,
resolves the backend for the spec and runs it.
"""
from numba_flash import _arrays, _checks, call_cache, registry
from numba_flash.spec import make_spec


def forward(q, k, v, *, causal=False, softmax_scale=None, backend="auto"):
    """Exact attention softmax(q kᵀ · softmax_scale) v, and the row log-sum-exp.

    Args:
        q: (batch, seqlen_q, nheads, headdim) queries; float16, bfloat16 or float32 (float64
            on the cupy and numpy backends). k, v: (batch, seqlen_k, nheads, headdim), same
            dtype.
        causal: mask keys in each query's future, aligned to the bottom-right corner: query i
            sees key j iff j <= i + seqlen_k - seqlen_q. A query that sees no key gets output 0
            and lse -inf.
        softmax_scale: multiplies the scores; default headdim ** -0.5.
        backend: a registered name (see list_backends()) or "auto".

    Returns:
        (out, lse): out like q (same library, device and dtype); lse float32
        (batch, nheads, seqlen_q) with lse[b, h, i] = log(sum_j exp(scale · q_i · k_j)).
    """
    spec = make_spec(q, causal=causal, softmax_scale=softmax_scale)
    key = call_cache.signature("forward", backend, spec, (q, k, v))
    replay = call_cache.get(key)
    if replay is None:
        _checks.check_qkv(q, k, v)
        impl = registry.resolve(backend, spec, q, k, v)
        if key is None:
            out, lse = impl.forward(spec, q, k, v)
        else:
            (out, lse), replay = impl.forward_and_replay(spec, q, k, v)
            call_cache.put(key, replay)
    else:
        out, lse = replay(q, k, v)
    return _arrays.convert_like(out, q), _arrays.convert_like(lse, q)


def backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, backend="auto"):
    """Gradients (dq, dk, dv) of forward's output, given dout = dLoss/dout.

    `out` and `lse` are what forward returned for the same q, k, v, causal and softmax_scale;
    the score tiles are recomputed from q, k and lse, nothing of size seqlen_q x seqlen_k is
    stored. dq, dk, dv have the shapes and dtype of q, k, v. Rows that saw no key get zero
    gradients.
    """
    arrays = (dout, q, k, v, out, lse)
    spec = make_spec(q, causal=causal, softmax_scale=softmax_scale)
    key = call_cache.signature("backward", backend, spec, arrays)
    replay = call_cache.get(key)
    if replay is None:
        _checks.check_backward_args(*arrays)
        impl = registry.resolve(backend, spec, q, k, v)
        if key is None:
            grads = impl.backward(spec, *arrays)
        else:
            grads, replay = impl.backward_and_replay(spec, *arrays)
            call_cache.put(key, replay)
    else:
        grads = replay(*arrays)
    return tuple(_arrays.convert_like(g, q) for g in grads)


def attention(q, k, v, *, causal=False, softmax_scale=None, backend="auto"):
    """forward() without the log-sum-exp: just the attention output."""
    return forward(q, k, v, causal=causal, softmax_scale=softmax_scale, backend=backend)[0]
