"""numba_flash as torch.library custom ops: `numba_flash::forward` and `numba_flash::backward`,
with fake (meta) implementations for tracing and an autograd formula, so that torch.compile
(fullgraph=True included) traces a model that calls numba_flash.torch.attention without a
graph break and torch.library.opcheck accepts them.

The ops take the call's options as plain values (the spec's: causal, the resolved softmax
scale, the window's sides, softcap) and the optional alibi_slopes and attn_mask tensors; a
mask_mod, a Python function, has no place in an op's schema, so numba_flash.torch.attention
takes its autograd Function for those calls. The lse output gets no gradient.
"""
from typing import Optional

import torch

from numba_flash import api


def _options(causal, softmax_scale, window_left, window_right, softcap, alibi_slopes,
             attn_mask, backend):
    return dict(causal=causal, softmax_scale=softmax_scale,
                window_size=(window_left, window_right), softcap=softcap,
                alibi_slopes=alibi_slopes, attn_mask=attn_mask, backend=backend)


@torch.library.custom_op("numba_flash::forward", mutates_args=())
def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            softmax_scale: float, window_left: int, window_right: int, softcap: float,
            alibi_slopes: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor],
            backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """numba_flash.forward: (out like q, lse float32 (batch, nheads, seqlen_q))."""
    options = _options(causal, softmax_scale, window_left, window_right, softcap,
                       alibi_slopes, attn_mask, backend)
    return api.forward(q, k, v, **options)


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
    return api.backward(dout, q, k, v, out, lse,
                        **_options(causal, softmax_scale, window_left, window_right, softcap,
                                   alibi_slopes, attn_mask, backend))


@backward.register_fake
def _backward_fake(dout, q, k, v, out, lse, *options):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.options = options
    ctx.mark_non_differentiable(lse)


def _backward_formula(ctx, dout, _):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = backward(dout, q, k, v, out, lse, *ctx.options)
    return (dq, dk, dv) + (None,) * len(ctx.options)


forward.register_autograd(_backward_formula, setup_context=_setup_context)
