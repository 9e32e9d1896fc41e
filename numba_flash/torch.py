"""torch integration: FlashAttention as a differentiable torch operation.

    import numba_flash.torch
    out = numba_flash.torch.attention(q, k, v, causal=True)   # q, k, v: (B, N, H, D)
    out.sum().backward()                                       # fills q.grad, k.grad, v.grad
    out = numba_flash.torch.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                             max_seqlen_q, max_seqlen_k, causal=True)
    out, lse = numba_flash.torch.forward_kvcache(q, k_cache, v_cache, k=k, v=v,
                                                 cache_seqlens=lengths)  # decoding
    out = numba_flash.torch.ring_attention(q_shard, k_shard, v_shard, causal=True)  # a
        # sequence sharded across a torch.distributed group (torch_ring.py)

`scaled_dot_product_attention` is a drop-in for torch.nn.functional's, with its layout
(batch, nheads, seqlen, headdim) and its meaning (is_causal top-left aligned).

Imported only when asked for (`import numba_flash` does not import torch). The forward saves
q, k, v, the output and the row log-sum-exp; the backward recomputes the attention tiles with
numba_flash.backward. CUDA tensors run on torch's current stream.
"""
import torch

from numba_flash import api, kvcache, spec, torch_ops
from numba_flash.spec import NO_WINDOW
from numba_flash.torch_ring import ring_attention, shard_sequence, unshard_sequence

__all__ = ["attention", "attention_varlen", "forward_kvcache", "scaled_dot_product_attention",
           "ring_attention", "shard_sequence", "unshard_sequence"]


def _op_options(causal, softmax_scale, window_size, softcap, head_dim):
    """(causal, scale, window_left, window_right, softcap) as the torch.library ops take them:
    checked here, uncached (dynamo traces these checks), causal folded into the window."""
    left, right = spec.check_window_size(window_size)
    causal = spec.check_causal(causal) or right == 0
    return (causal, spec.resolve_softmax_scale(softmax_scale, head_dim), left,
            0 if causal else right, spec.check_softcap(softcap))


class FlashAttentionFunction(torch.autograd.Function):
    """autograd wrapper of numba_flash.forward / numba_flash.backward: eager calls, and calls
    with a mask_mod (which the torch.library ops of numba_flash/torch_ops.py cannot take)."""

    @staticmethod
    def forward(ctx, q, k, v, options):
        out, lse = api.forward(q, k, v, **options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = api.backward(dout, q, k, v, out, lse, **ctx.options)
        return dq, dk, dv, None


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=NO_WINDOW, softcap=0.0,
              alibi_slopes=None, attn_mask=None, mask_mod=None, block_mask=None, backend="auto"):
    """Differentiable exact attention of torch tensors; see numba_flash.forward for the
    arguments (k and v may have fewer heads than q: GQA; alibi_slopes, a float32 tensor, and
    attn_mask, boolean or floating, broadcastable to (batch, nheads, seqlen_q, seqlen_k),
    get no gradient; mask_mod and block_mask as forward's). Returns the output only (the
    log-sum-exp is kept for the backward). Under torch.compile, without a mask_mod, it calls
    the torch.library op numba_flash::forward (torch_ops.py), traced without a graph break."""
    if mask_mod is None and block_mask is None and torch.compiler.is_compiling():
        # (the torch.library op under torch.compile; in eager mode the autograd Function below,
        # whose dispatch costs ~14 µs a call where the op's costs ~110 µs)
        return torch_ops.forward(q, k, v, *_op_options(causal, softmax_scale, window_size,
                                                       softcap, q.shape[-1]),
                                 alibi_slopes, attn_mask, backend)[0]
    options = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, attn_mask=attn_mask,
                   mask_mod=mask_mod, block_mask=block_mask, backend=backend)
    return FlashAttentionFunction.apply(q, k, v, options)


class FlashAttentionVarlenFunction(torch.autograd.Function):
    """autograd wrapper of numba_flash.forward_varlen / numba_flash.backward_varlen."""

    @staticmethod
    def forward(ctx, q, k, v, varlen, options):
        varlen = _offsets_read_once(q, varlen)
        out, lse = api.forward_varlen(q, k, v, *varlen, **options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.varlen, ctx.options = varlen, options
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = api.backward_varlen(dout, q, k, v, out, lse, *ctx.varlen, **ctx.options)
        return dq, dk, dv, None, None


def _offsets_read_once(q, varlen):
    """varlen's (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) with the cu_seqlens
    that sit on q's GPU read to the host, one read for a tensor given twice: the forward's
    checks would read them anyway, and the backward then checks the host values and copies
    them without waiting for the GPU (a read there would stop the host from queuing work
    ahead, in every layer of a training step)."""
    cu_q, cu_k, max_q, max_k = varlen
    if not q.is_cuda:
        return varlen

    def on_host(x):
        on_q_gpu = getattr(x, "is_cuda", False) and x.device == q.device
        return x.cpu() if on_q_gpu else x
    host_q = on_host(cu_q)
    return host_q, host_q if cu_k is cu_q else on_host(cu_k), max_q, max_k


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     causal=False, softmax_scale=None, window_size=NO_WINDOW, softcap=0.0,
                     alibi_slopes=None, mask_mod=None, backend="auto"):
    """Differentiable attention of packed sequences (torch tensors; see
    numba_flash.forward_varlen): q (total_q, H, D), k, v (total_k, H_kv, D), int32
    cu_seqlens (B + 1,) (on the GPU they are read once, in the forward: the backward checks
    those host values). Returns the output only. Under torch.compile, without a mask_mod,
    it calls the torch.library op numba_flash::forward_varlen (max_seqlen_q and max_seqlen_k
    are ints of the graph)."""
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if mask_mod is None and torch.compiler.is_compiling():
        return torch_ops.forward_varlen(q, k, v, *varlen,
                                        *_op_options(causal, softmax_scale, window_size,
                                                     softcap, q.shape[-1]),
                                        alibi_slopes, backend)[0]
    options = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, mask_mod=mask_mod, backend=backend)
    return FlashAttentionVarlenFunction.apply(q, k, v, varlen, options)


def forward_kvcache(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens=None,
                    block_table=None, causal=False, softmax_scale=None, window_size=NO_WINDOW,
                    softcap=0.0, alibi_slopes=None, num_splits=0, backend="auto"):
    """numba_flash.forward_kvcache on torch tensors: (out, lse), no gradient. Under
    torch.compile it calls the torch.library op numba_flash::forward_kvcache, which declares
    that it writes k_cache and v_cache (an int cache_seqlens becomes a tensor there)."""
    if torch.compiler.is_compiling():
        if isinstance(cache_seqlens, int):
            cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32,
                                       device=q.device)
        return torch_ops.forward_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens, block_table,
            *_op_options(causal, softmax_scale, window_size, softcap, q.shape[-1]),
            alibi_slopes, num_splits, backend)
    return kvcache.forward_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                                   block_table=block_table, causal=causal,
                                   softmax_scale=softmax_scale, window_size=window_size,
                                   softcap=softcap, alibi_slopes=alibi_slopes,
                                   num_splits=num_splits, backend=backend)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 backend="auto"):
    """torch.nn.functional.scaled_dot_product_attention's signature and meaning, computed by
    numba_flash (differentiable): query (batch, nheads, seqlen_q, headdim), key and value
    (batch, nheads_kv, seqlen_k, headdim), out like query.

    is_causal is SDPA's, aligned to the top-left corner: query i sees key j iff j <= i (where
    numba_flash's causal aligns to the bottom-right); it runs as our causal on the first
    seqlen_q keys when seqlen_q <= seqlen_k (the others are seen by no query and get zero
    gradients), and as the window (-1, seqlen_q - seqlen_k) otherwise. attn_mask: boolean
    (True: take part) or floating (added), broadcastable to (batch, nheads, seqlen_q,
    seqlen_k); not with is_causal (as SDPA). enable_gqa: nheads a multiple of nheads_kv. A
    query that sees no key gets 0 where SDPA gives NaN. dropout_p > 0 is refused (no dropout
    yet)."""
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p must be 0.0: numba_flash has no attention dropout yet; "
                         f"got {dropout_p!r}")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"query, key and value must be 4-D (batch, nheads, seqlen, headdim); "
                         f"got {query.dim()}-D, {key.dim()}-D and {value.dim()}-D")
    if not enable_gqa and key.shape[1] != query.shape[1]:
        raise ValueError(f"key and value have {key.shape[1]} heads and query {query.shape[1]}: "
                         f"pass enable_gqa=True for grouped-query attention")
    if is_causal and attn_mask is not None:
        raise ValueError("attn_mask and is_causal=True together are not allowed (as in SDPA): "
                         "fold the causal mask into attn_mask")
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    options = {}
    if is_causal:
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        if seqlen_q <= seqlen_k:
            k, v = k[:, :seqlen_q], v[:, :seqlen_q]
            options["causal"] = True
        else:
            options["window_size"] = (-1, seqlen_q - seqlen_k)
    out = attention(q, k, v, softmax_scale=scale, attn_mask=attn_mask, backend=backend,
                    **options)
    return out.transpose(1, 2)
