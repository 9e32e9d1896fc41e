"""numba_flash as torch.library custom ops: `numba_flash::forward` and `numba_flash::backward`,
and `numba_flash::forward_varlen` / `numba_flash::backward_varlen` for packed sequences, with
fake (meta) implementations for tracing and autograd formulas, so that torch.compile
(fullgraph=True included) traces a model that calls numba_flash.torch.attention or
attention_varlen without a graph break and torch.library.opcheck accepts them; and
`numba_flash::forward_kvcache` (no gradient), which declares that it writes the caches.

The ops take the call's options as plain values (the spec's: causal, the resolved softmax
scale, the window's sides, softcap) and the optional alibi_slopes and attn_mask tensors; a
mask_mod, a Python function, has no place in an op's schema, so numba_flash.torch takes its
autograd Functions for those calls. The lse output gets no gradient.
"""
from typing import Optional

import torch

from numba_flash import api, kvcache


def _options(causal, softmax_scale, window_left, window_right, softcap, alibi_slopes, backend):
    return dict(causal=causal, softmax_scale=softmax_scale,
                window_size=(window_left, window_right), softcap=softcap,
                alibi_slopes=alibi_slopes, backend=backend)


@torch.library.custom_op("numba_flash::forward", mutates_args=())
def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            softmax_scale: float, window_left: int, window_right: int, softcap: float,
            alibi_slopes: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor],
            backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """numba_flash.forward: (out like q, lse float32 (batch, nheads, seqlen_q))."""
    return api.forward(q, k, v, attn_mask=attn_mask,
                       **_options(causal, softmax_scale, window_left, window_right, softcap,
                                  alibi_slopes, backend))


@forward.register_fake
def _forward_fake(q, k, v, causal, softmax_scale, window_left, window_right, softcap,
                  alibi_slopes, attn_mask, backend):
    batch, seqlen_q, nheads, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("numba_flash::backward", mutates_args=())
def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, causal: bool, softmax_scale: float,
             window_left: int, window_right: int, softcap: float,
             alibi_slopes: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor],
             backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """numba_flash.backward: (dq, dk, dv) like q, k, v."""
    return api.backward(dout, q, k, v, out, lse, attn_mask=attn_mask,
                        **_options(causal, softmax_scale, window_left, window_right, softcap,
                                   alibi_slopes, backend))


@backward.register_fake
def _backward_fake(dout, q, k, v, out, lse, *options):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("numba_flash::forward_varlen", mutates_args=())
def forward_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                   max_seqlen_k: int, causal: bool, softmax_scale: float, window_left: int,
                   window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
                   backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """numba_flash.forward_varlen: (out like q, lse float32 (nheads, total_q))."""
    return api.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              **_options(causal, softmax_scale, window_left, window_right,
                                         softcap, alibi_slopes, backend))


@forward_varlen.register_fake
def _forward_varlen_fake(q, k, v, *varlen_and_options):
    total_q, nheads, _ = q.shape
    return torch.empty_like(q), q.new_empty((nheads, total_q), dtype=torch.float32)


@torch.library.custom_op("numba_flash::backward_varlen", mutates_args=())
def backward_varlen(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                    causal: bool, softmax_scale: float, window_left: int, window_right: int,
                    softcap: float, alibi_slopes: Optional[torch.Tensor],
                    backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """numba_flash.backward_varlen: (dq, dk, dv) like q, k, v."""
    return api.backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k,
                               **_options(causal, softmax_scale, window_left, window_right,
                                          softcap, alibi_slopes, backend))


@backward_varlen.register_fake
def _backward_varlen_fake(dout, q, k, v, out, lse, *varlen_and_options):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("numba_flash::forward_kvcache", mutates_args=("k_cache", "v_cache"))
def forward_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                    cache_seqlens: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
                    causal: bool, softmax_scale: float, window_left: int, window_right: int,
                    softcap: float, alibi_slopes: Optional[torch.Tensor], num_splits: int,
                    backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """numba_flash.forward_kvcache: (out like q, lse float32 (batch, nheads, seqlen_q)); k and
    v, if given, are written into k_cache and v_cache first."""
    out, lse = kvcache.forward_kvcache(
        q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens, block_table=block_table,
        num_splits=num_splits, **_options(causal, softmax_scale, window_left, window_right,
                                          softcap, alibi_slopes, backend))
    return out, lse


@forward_kvcache.register_fake
def _forward_kvcache_fake(q, *arguments):
    batch, seqlen_q, nheads, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.options = options
    ctx.mark_non_differentiable(lse)


def _autograd_formula(backward_op):
    """The backward of a forward op whose inputs are (q, k, v, *options) and whose backward op
    takes (dout, q, k, v, out, lse, *options): gradients for q, k, v only."""
    def formula(ctx, dout, _):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward_op(dout, q, k, v, out, lse, *ctx.options)
        return (dq, dk, dv) + (None,) * len(ctx.options)
    return formula


forward.register_autograd(_autograd_formula(backward), setup_context=_setup_context)
forward_varlen.register_autograd(_autograd_formula(backward_varlen),
                                 setup_context=_setup_context)
