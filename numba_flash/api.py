"""The public functions: forward, backward, attention, and forward_varlen, backward_varlen
for packed sequences.

Shapes (flash-attn's layout):
    q, out, dout, dq : (batch, seqlen_q, nheads, headdim)
    k, v, dk, dv     : (batch, seqlen_k, nheads_kv, headdim), nheads a multiple of nheads_kv
    lse              : (batch, nheads, seqlen_q), float32, natural log
varlen: q (total_q, nheads, headdim), k and v (total_k, nheads_kv, headdim), lse (nheads,
total_q); int32 cu_seqlens_q, cu_seqlens_k (batch + 1,) give each sequence's first token.

Each call builds its AttentionSpec (numba_flash/spec.py) from its options, then either replays
a call of the same signature seen before (numba_flash/call_cache.py) or checks the arrays,
resolves the backend for the spec and runs it.
"""
from numba_flash import _arrays, _checks, call_cache, registry
from numba_flash.extras import NO_EXTRAS, Extras
from numba_flash.spec import NO_WINDOW, make_spec


def forward(q, k, v, *, causal=False, softmax_scale=None, window_size=NO_WINDOW, softcap=0.0,
            alibi_slopes=None, attn_mask=None, mask_mod=None, block_mask=None, backend="auto"):
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
        alibi_slopes: float32 (nheads,) or (batch, nheads): adds -slope · |i + seqlen_k -
            seqlen_q - j| to the (softcapped) scaled score of query i and key j.
        attn_mask: PyTorch SDPA's meaning, broadcastable to (batch, nheads, seqlen_q,
            seqlen_k) (missing leading dimensions, and dimensions of size 1, broadcast):
            boolean (True: query i sees key j) or floating, of q's dtype or float32 (added to
            the scaled score, after softcap and ALiBi; -inf masks). It combines with causal and
            windows, is read tile by tile and never expanded; no gradient flows to it.
        mask_mod: a Python function mask_mod(b, h, q_idx, kv_idx) -> bool (FlexAttention's):
            query q_idx of batch entry b and head h sees key kv_idx only where it returns True
            (besides causal, window and attn_mask). The Numba backend compiles it into its
            kernels and classifies the key tiles first, skipping those no query sees; the
            other backends evaluate it on index arrays (or one index at a time). Arrays it
            captures (closure variables or globals; on the call's device) are read as they
            are at each call, as kernel arguments: a new closure of the same code over new
            arrays compiles nothing (numba_flash/mask_mod.py); new code, or a change in
            another captured value (a number), compiles new kernels (tens of seconds).
        block_mask: numba_flash.block_mask(mask_mod, ...), the tile classification kept for
            reuse across calls (mask_mod may then be left out).
        backend: a registered name (see list_backends()) or "auto".

    Returns:
        (out, lse): out like q (same library, device and dtype); lse float32
        (batch, nheads, seqlen_q) with lse[b, h, i] = log(sum_j exp(score_ij)) over the keys
        query i sees, score_ij = softmax_scale · q_i · k_j (softcapped, with ALiBi, if asked).
    """
    program, captured = _checks.lowered_mask_mod(mask_mod, block_mask)
    spec = make_spec(q, k, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                     softcap=softcap, alibi=alibi_slopes is not None,
                     attn_mask=_checks.mask_dtype(attn_mask), mask_mod=program)
    return _forward(spec, _extras(alibi_slopes, attn_mask, block_mask, captured), backend, q, k,
                    v)


def backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window_size=NO_WINDOW,
             softcap=0.0, alibi_slopes=None, attn_mask=None, mask_mod=None, block_mask=None,
             backend="auto"):
    """Gradients (dq, dk, dv) of forward's output, given dout = dLoss/dout.

    `out` and `lse` are what forward returned for the same q, k, v and options (causal,
    softmax_scale, window_size, softcap, alibi_slopes, attn_mask, mask_mod); the score tiles are
    recomputed from q, k and lse, nothing of size seqlen_q x seqlen_k is stored. dq, dk, dv
    have the shapes and dtype of q, k, v (with grouped-query attention dk and dv sum over each
    group's query heads, without atomics: deterministic). Rows that saw no key get zero
    gradients; the mask gets none.
    """
    program, captured = _checks.lowered_mask_mod(mask_mod, block_mask)
    spec = make_spec(q, k, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                     softcap=softcap, alibi=alibi_slopes is not None,
                     attn_mask=_checks.mask_dtype(attn_mask), mask_mod=program)
    return _backward(spec, _extras(alibi_slopes, attn_mask, block_mask, captured), backend, dout,
                     q, k, v, out, lse)


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=NO_WINDOW, softcap=0.0,
              alibi_slopes=None, attn_mask=None, mask_mod=None, block_mask=None, backend="auto"):
    """forward() without the log-sum-exp: just the attention output."""
    return forward(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, attn_mask=attn_mask,
                   mask_mod=mask_mod, block_mask=block_mask, backend=backend)[0]


def _extras(alibi_slopes, attn_mask, block_mask, mask_mod_arrays):
    """A dense call's arrays besides q, k, v (and its block mask)."""
    if (alibi_slopes is None and attn_mask is None and block_mask is None
            and not mask_mod_arrays):
        return NO_EXTRAS
    return Extras(alibi_slopes=alibi_slopes, attn_mask=attn_mask, block_mask=block_mask,
                  mask_mod_arrays=mask_mod_arrays)


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                   causal=False, softmax_scale=None, window_size=NO_WINDOW, softcap=0.0,
                   alibi_slopes=None, mask_mod=None, backend="auto"):
    """forward() on packed sequences of different lengths (flash-attn's varlen convention).

    q: (total_q, nheads, headdim), the batch's sequences one after another; k, v: (total_k,
    nheads_kv, headdim). cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,), sequence b's queries
    are q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]] (0 first, the total last, non-decreasing), its
    keys likewise. max_seqlen_q, max_seqlen_k: ints at least the longest sequence's length.
    Each sequence attends within itself, with the options' meaning for its own seqlen_q and
    seqlen_k (causal and windows aligned to its bottom-right corner); alibi_slopes (nheads,)
    or (batch, nheads); mask_mod(b, h, q_idx, kv_idx) with b the sequence and q_idx, kv_idx
    within it. No work is done for tokens of other sequences or for padding.

    Returns (out, lse): out like q; lse float32 (nheads, total_q). The cu_seqlens are checked
    on every call: on the GPU their values are read (one small copy, for which the host waits
    on the GPU); given as host arrays (NumPy, a CPU torch tensor) beside GPU arrays, they are
    checked on the host and copied to the GPU without waiting.
    """
    program, captured = _checks.lowered_mask_mod(mask_mod, varlen=True)
    spec = make_spec(q, k, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                     softcap=softcap, alibi=alibi_slopes is not None,
                     max_seqlens=(max_seqlen_q, max_seqlen_k), mask_mod=program)
    cu_seqlens_q, cu_seqlens_k, known = _checks.offsets_to_device(q, cu_seqlens_q, cu_seqlens_k)
    extras = Extras(alibi_slopes, cu_seqlens_q, cu_seqlens_k, mask_mod_arrays=captured)
    _checks.check_qkv(q, k, v, varlen=True)
    _checks.check_extras(spec, q, k, v, extras, known)
    return _forward(spec, extras, backend, q, k, v)


def backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, *, causal=False, softmax_scale=None, window_size=NO_WINDOW,
                    softcap=0.0, alibi_slopes=None, mask_mod=None, backend="auto"):
    """Gradients (dq, dk, dv) of forward_varlen's output, given dout (q's shape); out and
    lse (nheads, total_q) are what forward_varlen returned for the same arguments."""
    program, captured = _checks.lowered_mask_mod(mask_mod, varlen=True)
    spec = make_spec(q, k, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                     softcap=softcap, alibi=alibi_slopes is not None,
                     max_seqlens=(max_seqlen_q, max_seqlen_k), mask_mod=program)
    cu_seqlens_q, cu_seqlens_k, known = _checks.offsets_to_device(q, cu_seqlens_q, cu_seqlens_k)
    extras = Extras(alibi_slopes, cu_seqlens_q, cu_seqlens_k, mask_mod_arrays=captured)
    _checks.check_backward_args(dout, q, k, v, out, lse, varlen=True)
    _checks.check_extras(spec, q, k, v, extras, known)
    return _backward(spec, extras, backend, dout, q, k, v, out, lse)


def _forward(spec, extras, backend, q, k, v):
    """A forward call: its replay if its signature was seen, else the checks, the backend
    and (for a cached signature) a new replay."""
    arrays = (q, k, v, *extras.arrays())
    key = call_cache.signature("forward", backend, spec, arrays)
    replay = call_cache.get(key, extras.block_mask)
    if replay is None:
        if not spec.varlen:  # (varlen's checks run on every call: they read cu_seqlens)
            _checks.check_qkv(q, k, v)
            if extras is not NO_EXTRAS:
                _checks.check_extras(spec, q, k, v, extras)
        impl = registry.resolve(backend, spec, q, k, v)
        if key is None:
            out, lse = impl.forward(spec, q, k, v, extras)
        else:
            (out, lse), replay = impl.forward_and_replay(spec, q, k, v, extras)
            call_cache.put(key, replay, extras.block_mask)
    else:
        out, lse = replay(*arrays)
    return _arrays.convert_like(out, q), _arrays.convert_like(lse, q)


def _backward(spec, extras, backend, dout, q, k, v, out, lse):
    arrays = (dout, q, k, v, out, lse, *extras.arrays())
    key = call_cache.signature("backward", backend, spec, arrays)
    replay = call_cache.get(key, extras.block_mask)
    if replay is None:
        if not spec.varlen:
            _checks.check_backward_args(dout, q, k, v, out, lse)
            if extras is not NO_EXTRAS:
                _checks.check_extras(spec, q, k, v, extras)
        impl = registry.resolve(backend, spec, q, k, v)
        if key is None:
            grads = impl.backward(spec, dout, q, k, v, out, lse, extras)
        else:
            grads, replay = impl.backward_and_replay(spec, dout, q, k, v, out, lse, extras)
            call_cache.put(key, replay, extras.block_mask)
    else:
        grads = replay(*arrays)
    return tuple(_arrays.convert_like(g, q) for g in grads)
