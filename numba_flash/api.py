"""The public functions: forward, backward and attention.

Shapes (flash-attn's layout):
    q, out, dout, dq : (batch, seqlen_q, nheads, headdim)
    k, v, dk, dv     : (batch, seqlen_k, nheads_kv, headdim), nheads a multiple of nheads_kv
    lse              : (batch, nheads, seqlen_q), float32, natural log

Each call builds its AttentionSpec (numba_flash/spec.py) from its options, then either replays
a call of the same signature seen before (numba_flash/call_cache.py) or checks the arrays,
resolves the backend for the spec and runs it.
"""
from numba_flash import _arrays, _checks, call_cache, registry
from numba_flash.spec import NO_WINDOW, make_spec


def forward(q, k, v, *, causal=False, softmax_scale=None, window_size=NO_WINDOW, softcap=0.0,
            backend="auto"):
    """Exact attention softmax(q kᵀ · softmax_scale) v, and the row log-sum-exp.

    Args:
        q: (batch, seqlen_q, nheads, headdim) queries; float16, bfloat16 or float32 (float64
            on the cupy and numpy backends). k, v: (batch, seqlen_k, nheads_kv, headdim), same
            dtype; nheads a multiple of nheads_kv (grouped-query attention: query head h reads
            key/value head h // (nheads // nheads_kv); no copy of k and v is made).
        causal: mask keys in each query's future, aligned to the bottom-right corner: query i
            sees key j iff j <= i + seqlen_k - seqlen_q (the same as window_size (left, 0)).
            A query that sees no key gets output 0 and lse -inf.
        softmax_scale: multiplies the scores; default headdim ** -0.5.
        window_size: (left, right), sliding-window attention aligned like causal: query i
            sees key j iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q +
            right; -1 leaves a side unbounded. Key tiles out of every query's window are
            skipped.
        softcap: > 0 caps the scaled scores s smoothly: softcap · tanh(s / softcap).
        backend: a registered name (see list_backends()) or "auto".

    Returns:
        (out, lse): out like q (same library, device and dtype); lse float32
        (batch, nheads, seqlen_q) with lse[b, h, i] = log(sum_j exp(score_ij)) over the keys
        query i sees, score_ij = softmax_scale · q_i · k_j (softcapped if asked).
    """
    spec = make_spec(q, k, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                     softcap=softcap)
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


def backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window_size=NO_WINDOW,
             softcap=0.0, backend="auto"):
    """Gradients (dq, dk, dv) of forward's output, given dout = dLoss/dout.

    `out` and `lse` are what forward returned for the same q, k, v and options (causal,
    softmax_scale, window_size, softcap); the score tiles are recomputed from q, k and lse,
    nothing of size seqlen_q x seqlen_k is stored. dq, dk, dv have the shapes and dtype of q,
    k, v (with grouped-query attention dk and dv sum over each group's query heads, without
    atomics: deterministic). Rows that saw no key get zero gradients.
    """
    arrays = (dout, q, k, v, out, lse)
    spec = make_spec(q, k, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                     softcap=softcap)
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


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=NO_WINDOW, softcap=0.0,
              backend="auto"):
    """forward() without the log-sum-exp: just the attention output."""
    return forward(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                   softcap=softcap, backend=backend)[0]
