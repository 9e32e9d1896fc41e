"""Hugging Face transformers: `attn_implementation="numba_flash"`.

    import numba_flash.integrations.transformers as nf_transformers
    nf_transformers.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="numba_flash")

transformers treats an implementation whose name holds "flash" as a FlashAttention kernel:
its models hand it a padding mask of shape (batch, seqlen) or None (flash_attention_mask),
and its FlashAttention wrapper (`flash_attention_forward`) un-pads a padded batch into packed
sequences, finds packed sequences from position_ids, passes causal, GQA, the sliding window
(as flash-attn's `window_size`) and Gemma 2's softcap, and calls the implementation's
`flash_attn_func` / `flash_attn_varlen_func`. `register()` makes "numba_flash" such a kernel,
backed by numba_flash.torch: it registers that wrapper (behind `attention_forward`, below)
and that mask under the name, and
answers transformers' import of the kernel's functions (`_lazy_imports` in
transformers.modeling_flash_attention_utils, which would otherwise look for "numba_flash" on
the Hugging Face hub) with this module's `flash_attn_func` and `flash_attn_varlen_func`,
which take flash-attn's arguments. No paged-cache function (`flash_attn_with_kvcache`):
transformers' continuous batching does not take this implementation.

`attention_forward` takes the wrapper's dense path itself (no padding mask, one sequence per
batch row: the usual training and prefill call), computing what the wrapper passes
(causal, the window, softcap, scale) without its generic keyword plumbing, which costs host
time in every layer of a step that the host bounds. At batch 1 the wrapper asks, in every
layer, whether position_ids describe several packed sequences, by reading them on the host
(`_is_packed_sequence`): a synchronisation per layer, after which the host no longer
launches ahead of the GPU; `attention_forward` asks once per position_ids tensor (a model
passes one to all its layers). Everything else (padding, packed or paged sequences, float32
inputs the wrapper casts) goes through the wrapper.

Dropout inside attention (`attention_dropout` > 0 while training) and attention sinks
(`s_aux`) are refused: numba_flash has neither yet. Tested with transformers 5.2x.
"""
import functools
import weakref

import torch
from transformers import AttentionInterface, modeling_flash_attention_utils
from transformers.integrations import flash_attention as _transformers_flash
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

import numba_flash.torch as numba_torch

NAME = "numba_flash"
_settings = {"backend": "auto"}


def register(backend="auto"):
    """Register "numba_flash" with transformers (again: only the backend changes); the
    kernels run through numba_flash.torch with `backend` (a numba_flash backend name)."""
    from numba_flash import registry
    registry._check_name(backend)
    _settings["backend"] = backend
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    imports = modeling_flash_attention_utils._lazy_imports
    if not getattr(imports, "_numba_flash", False):
        modeling_flash_attention_utils._lazy_imports = _answering_for_us(imports)


#: (a weak reference to the last position_ids asked about, its version, the answer): a model
#: passes one position_ids tensor to all its layers
_packed_answer = (lambda: None, None, None)


def attention_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' flash_attention_forward, with its dense path (no padding mask, one
    sequence per batch row) taken here directly and its question whether position_ids
    describe packed sequences asked once per position_ids tensor instead of once per layer
    (see the module's docstring): the same path and result, for less host time per layer."""
    if attention_mask is None and _dense_kwargs(query, value, kwargs):
        position_ids = kwargs.get("position_ids")
        if position_ids is None or query.shape[0] != 1 or position_ids.shape[-1] == 1:
            return _dense(module, query, key, value, **kwargs), None
        packed = (_packed_outside_graph if torch.compiler.is_compiling() else _packed)
        if not packed(position_ids):
            return _dense(module, query, key, value, **kwargs), None
    return flash_attention_forward(module, query, key, value, attention_mask, **kwargs)


#: what sends a call through transformers' wrapper rather than its dense path: packed or
#: paged sequences, or the wrapper's own handling (a warning, a cast, a padded value, an
#: empty query's error)
_WRAPPER_KWARGS = frozenset(("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
                             "block_table", "output_attentions"))


def _dense_kwargs(query, value, kwargs):
    if query.dtype == torch.float32 or value.shape[-1] != query.shape[-1] or 0 in query.shape:
        return False
    return all(kwargs[name] is None or kwargs[name] is False
               for name in _WRAPPER_KWARGS.intersection(kwargs))


def _dense(module, query, key, value, dropout=0.0, scaling=None, sliding_window=None,
           softcap=None, is_causal=None, s_aux=None, **_):
    """What flash_attention_forward computes on its dense path, from transformers' (batch,
    heads, seqlen, headdim) arguments: causal from the call or the module (not for one
    query where the wrapper aligns the mask top-left), a sliding window of `sliding_window`
    tokens where the keys outnumber it."""
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    causal = module.is_causal if is_causal is None else is_causal
    causal = causal and not (_transformers_flash._use_top_left_mask and seqlen_q == 1)
    window = ((sliding_window - 1, sliding_window - 1)
              if sliding_window is not None and seqlen_k > sliding_window else (-1, -1))
    return flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                           dropout, scaling, causal, window, softcap, s_aux=s_aux)


def _packed(position_ids):
    """transformers' own test (_is_packed_sequence, one host read), cached per tensor and
    version (a tensor written in place is asked again)."""
    global _packed_answer
    if position_ids.is_inference():  # (no version counter: asked each time)
        return bool(modeling_flash_attention_utils._is_packed_sequence(position_ids, 1))
    last, version, packed = _packed_answer
    if last() is position_ids and version == position_ids._version:
        return packed
    version = position_ids._version
    packed = bool(modeling_flash_attention_utils._is_packed_sequence(position_ids, 1))
    _packed_answer = weakref.ref(position_ids), version, packed
    return packed


#: _packed for a compiled model: the read of position_ids breaks the graph here, in this
#: function's call, rather than in transformers' wrapper, whose frame torch.compile would
#: specialise on each layer's layer_idx (recompiled per layer, then run eagerly past 8)
_packed_outside_graph = torch.compiler.disable(_packed)


def _answering_for_us(original):
    @functools.wraps(original)
    def lazy_imports(implementation, *args, **kwargs):
        if implementation != NAME:
            return original(implementation, *args, **kwargs)
        utils = modeling_flash_attention_utils
        return flash_attn_func, flash_attn_varlen_func, None, utils._pad_input, utils._unpad_input
    lazy_imports._numba_flash = True
    return lazy_imports


def _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, s_aux):
    if s_aux is not None:  # (declared so that transformers passes sinks here, not drops them)
        raise ValueError("s_aux (attention sinks) is not supported by numba_flash yet: use "
                         "another attn_implementation for this model")
    if dropout_p:
        raise ValueError(f"dropout_p must be 0.0: numba_flash has no attention dropout yet (set "
                         f"the model config's attention_dropout to 0); got {dropout_p!r}")
    return dict(causal=bool(causal), softmax_scale=softmax_scale,
                window_size=tuple(int(x) for x in window_size), softcap=float(softcap or 0.0),
                alibi_slopes=alibi_slopes, backend=_settings["backend"])


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    s_aux=None):
    """flash-attn's flash_attn_func (q (batch, seqlen, nheads, headdim), k and v with
    nheads_kv heads) through numba_flash.torch.attention; always deterministic."""
    return numba_torch.attention(q, k, v, **_options(dropout_p, softmax_scale, causal,
                                                     window_size, softcap, alibi_slopes, s_aux))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, s_aux=None):
    """flash-attn's flash_attn_varlen_func (packed (total, nheads, headdim) arrays, int32
    cu_seqlens) through numba_flash.torch.attention_varlen."""
    return numba_torch.attention_varlen(
        q, k, v, cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32), int(max_seqlen_q),
        int(max_seqlen_k), **_options(dropout_p, softmax_scale, causal, window_size, softcap,
                                      alibi_slopes, s_aux))
