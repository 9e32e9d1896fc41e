"""The decode engine: numba_flash.forward_kvcache on the split-KV kernels.

It appends the call's new tokens to the cache, picks the kernel (tensor_cores.py for float16
and bfloat16 on sm_80 and newer where the cache rows suit cp.async, else kernels.py's SIMT
one) and the split of the key axis (flash-decoding: enough blocks to fill the GPU when batch x
heads alone do not), runs the decode kernel into float32 partial results and combines them
into out and lse.
"""
import functools
import math

import numpy as np

from numba_flash import _arrays

from .. import marshal
from ..device.constants import LOG2E
from ..gpu import (SHARED_MEMORY_BYTES, TENSOR_CORE_CC, compute_capability, shared_memory_limit,
                   simulator_enabled)
from ..launch import launch
from . import tensor_cores
from .append import append_kernel
from .combine import combine_kernel
from .kernels import BLOCK_N, THREADS, WARPS, decode_kernel, decode_shape, shared_bytes

DTYPES = ("float16", "bfloat16", "float32")
MAX_SPLITS = 128
#: keys a split reads at least (fewer makes the combine's traffic matter)
MIN_KEYS_PER_SPLIT = 4 * BLOCK_N
#: blocks in flight per multiprocessor the heuristic aims at for the SIMT kernel (4-warp
#: blocks, memory bound); the tensor-core kernel aims at the blocks that fit at once
BLOCKS_PER_SM = 4
#: blocks that fill this share of the slots take one split (choose_splits)
FULL_ENOUGH = 0.8
#: the fewest splits whose slots' busy share is within this factor of the best count's
WAVE_SHARE = 0.85
SIMULATOR_SMS = 4
APPEND_BLOCKS = 1024


def reason(spec, q, k_cache=None, kernels="auto"):
    """None if the decode kernels (`kernels` as DecodeEngine's) can serve the call, else why
    not; "auto" with k_cache given: the tensor-core kernel where it serves the call and can
    read k_cache, else the SIMT one."""
    if kernels == "tensor-cores":
        return _tensor_core_reason(spec, q, run_in_simulator=True)
    if (kernels == "auto" and k_cache is not None
            and _tensor_core_reason(spec, q, run_in_simulator=False) is None
            and _async_copy(spec, q, marshal.view(k_cache, bits=True))):
        return None
    return _simt_reason(spec, q)


def _simt_reason(spec, q):
    """None if the SIMT decode kernel can serve the call, else why not."""
    if spec.dtype not in DTYPES:
        return f"the decode kernels take float16, bfloat16 or float32, not {spec.dtype}"
    need = shared_bytes(spec, decode_shape(spec, int(q.shape[1]) * spec.group))
    if simulator_enabled():
        return None
    device = _arrays.device_id(q)
    if spec.bf16 and compute_capability(device) < TENSOR_CORE_CC:
        return "bfloat16 needs compute capability 8.0 or newer"
    if need > max(SHARED_MEMORY_BYTES, shared_memory_limit(device)):
        return (f"the decode kernel needs {need} bytes of shared memory at head dim "
                f"{spec.head_dim}; this GPU gives a block {shared_memory_limit(device)}")
    return None


def _tensor_core_reason(spec, q, run_in_simulator):
    """None if the tensor-core decode kernel can serve the call (cache rows aside: those are
    the call's to check, _async_copy), else why not."""
    if spec.dtype not in ("float16", "bfloat16"):
        return f"the tensor-core decode kernel takes float16 or bfloat16, not {spec.dtype}"
    if spec.head_dim % 16 or spec.head_dim > tensor_cores.MAX_HEAD_DIM:
        return (f"the tensor-core decode kernel takes head dims that are multiples of 16 up to "
                f"{tensor_cores.MAX_HEAD_DIM}; got {spec.head_dim}")
    if simulator_enabled():
        return None if run_in_simulator else "under the simulator the SIMT kernel decodes"
    if compute_capability(_arrays.device_id(q)) < TENSOR_CORE_CC:
        return "the tensor-core decode kernel needs compute capability 8.0 or newer"
    if _tensor_core_stages(spec, q) is None:
        return (f"the tensor-core decode kernel's two stages need "
                f"{tensor_cores.shared_bytes(spec.head_dim, 2)} bytes of shared memory at head "
                f"dim {spec.head_dim}; this GPU gives a block "
                f"{shared_memory_limit(_arrays.device_id(q))}")
    return None


def _tensor_core_stages(spec, q):
    limit = (tensor_cores.shared_bytes(spec.head_dim, tensor_cores.MAX_STAGES)
             if simulator_enabled() else shared_memory_limit(_arrays.device_id(q)))
    return tensor_cores.choose_stages(spec.head_dim, limit)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_id):
    from numba import cuda
    with cuda.gpus[device_id]:
        return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def multiprocessors(q):
    if simulator_enabled():
        return SIMULATOR_SMS
    return _multiprocessors(_arrays.device_id(q))


@functools.lru_cache(maxsize=1024)
def choose_splits(blocks, visible_keys, sm_count, blocks_per_sm=BLOCKS_PER_SM):
    """Splits of the key axis for `blocks` blocks per split reading up to `visible_keys` keys
    each, each split keeping MIN_KEYS_PER_SPLIT keys or more: one when the blocks nearly fill
    the GPU's blocks_per_sm x sm_count slots at once, else the fewest whose last wave of
    blocks is about as full as the best count makes it (within WAVE_SHARE of the best
    share: waves of blocks that leave most slots idle cost a wave's time all the same)."""
    slots = blocks_per_sm * sm_count
    most = max(1, min(MAX_SPLITS, visible_keys // MIN_KEYS_PER_SPLIT))
    if blocks >= FULL_ENOUGH * slots:
        return 1

    def share(splits):  # (the busy share of the slots over the waves these blocks take)
        waves = blocks * splits / slots
        return waves / math.ceil(waves)
    best = max(share(n) for n in range(1, most + 1))
    return next(n for n in range(1, most + 1) if share(n) >= WAVE_SHARE * best)


def visible_keys(spec, seqlen_q, capacity):
    """The most keys one block's rows can see in a cache of `capacity` tokens (a window
    bounds them). The splits follow from it, not from the call's cache_seqlens: the same for
    every call of a signature (its replay's launches), as flash-decoding sizes them."""
    if spec.window_left >= 0 and spec.window_right >= 0:
        return min(capacity, spec.window_left + spec.window_right + seqlen_q)
    return capacity


def forward_kvcache(spec, q, cache, out, lse, alloc, stream, extras, kernels="auto"):
    """Append cache.k_new / v_new (if any), then attention of q over each sequence's cache
    into out and lse (the backend's arrays); `kernels` as DecodeEngine's."""
    batch, seqlen_q, nheads, head_dim = (int(s) for s in q.shape)
    nheads_kv = int(cache.k_cache.shape[2])
    paged = cache.block_table is not None
    bits = spec.dtype != "float32"  # (the kernels take 16-bit elements as bit patterns)
    k_cache, v_cache = (marshal.view(x, bits=bits) for x in (cache.k_cache, cache.v_cache))
    async_copy = _async_copy(spec, q, k_cache, v_cache)
    refusal = (_tensor_core_reason(spec, q, run_in_simulator=kernels == "tensor-cores")
               if kernels != "simt" else "")
    tensor = async_copy and refusal is None
    if kernels == "tensor-cores" and not tensor:  # (before anything is written)
        raise ValueError(refusal or "the tensor-core decode kernel reads k_cache and v_cache "
                         "by cp.async: their rows must be contiguous and 16-byte aligned")
    simt_refusal = None if tensor else _simt_reason(spec, q)
    if simt_refusal:
        raise ValueError(simt_refusal)
    lse_view = marshal.view(lse)
    # (one-element stand-ins of the arrays' types where the call has none: never read)
    block_table = marshal.view(cache.block_table if paged else alloc((1, 1), "int32"))
    seqlens = marshal.view(cache.cache_seqlens if cache.cache_seqlens is not None
                           else alloc((1,), "int32"))
    fixed = np.int32(cache.fixed_seqlen)
    new_tokens = 0
    if cache.k_new is not None:
        new_tokens = int(cache.k_new.shape[1])
        k_new, v_new = (marshal.view(x, bits=bits) for x in (cache.k_new, cache.v_new))
        total = int(np.prod(k_new.shape))
        if total:
            launch(append_kernel(paged), min(-(-total // THREADS), APPEND_BLOCKS), THREADS,
                   stream, 0, k_new, v_new, k_cache, v_cache, block_table, seqlens, fixed)
        if simulator_enabled():  # (the simulator's views of host arrays may be copies)
            _write_back(cache, k_cache, v_cache, bits)

    sm_count = multiprocessors(q)
    if tensor:
        stages = _tensor_core_stages(spec, q)
        kernel = tensor_cores.decode_kernel(spec.for_kernels(), paged, stages)
        rows, threads = tensor_cores.ROWS, tensor_cores.THREADS
        shared = tensor_cores.shared_bytes(head_dim, stages)
        q_view = marshal.tile_ready_input(q, alloc, head_dim, stream, bits=True)
        limit = (shared_memory_limit(_arrays.device_id(q)) if not simulator_enabled()
                 else shared)
        blocks_per_sm = max(1, (limit + 1024) // (shared + 1024))
    else:
        shape = decode_shape(spec, seqlen_q * spec.group)
        kernel = decode_kernel(spec.for_kernels(), paged, async_copy, shape)
        rows, threads, shared = shape.rows, THREADS, shared_bytes(spec, shape)
        q_view = marshal.view(q, bits)
        blocks_per_sm = BLOCKS_PER_SM
    row_tiles = -(-seqlen_q * spec.group // rows)
    blocks = row_tiles * nheads_kv * batch
    splits = cache.num_splits or choose_splits(
        blocks, visible_keys(spec, seqlen_q, cache.max_keys), sm_count, blocks_per_sm)
    out_part = marshal.view(alloc((splits, batch, seqlen_q, nheads, head_dim), "float32"))
    lse_part = marshal.view(alloc((splits, batch, nheads, seqlen_q), "float32"))
    slopes = lse_view
    if spec.alibi:
        slopes = marshal.broadcast(marshal.view(extras.alibi_slopes), (batch, nheads))
    scale_log2 = np.float32(spec.softmax_scale * float(LOG2E))
    launch(kernel, (splits * row_tiles, nheads_kv, batch), threads, stream, shared,
           q_view, k_cache, v_cache, block_table, seqlens, fixed, np.int32(new_tokens), out_part,
           lse_part, scale_log2, slopes)
    launch(combine_kernel(spec.bf16, head_dim), -(-batch * seqlen_q * nheads // WARPS), THREADS,
           stream, 0, out_part, lse_part, marshal.view(out, spec.bf16), lse_view)


def _async_copy(spec, q, *cache_views):
    """Whether cp.async can read the caches' rows: sm_80 or newer (or the simulator), rows of
    whole 16-byte chunks, 16-byte aligned, contiguous along the head dim."""
    item = 4 if spec.dtype == "float32" else 2
    if spec.head_dim * item % 16:
        return False
    if not simulator_enabled() and compute_capability(_arrays.device_id(q)) < TENSOR_CORE_CC:
        return False
    return all(marshal.is_tile_ready(x, spec.head_dim) for x in cache_views)


def _write_back(cache, k_view, v_view, bits):
    """Under the simulator: the appended caches into the caller's host arrays, where
    marshal.view had to copy them (a cache that is not C-contiguous)."""
    for x, written in ((cache.k_cache, k_view), (cache.v_cache, v_view)):
        if _arrays.library(x) == "torch":
            import torch
            target = (x.detach().view(torch.int16) if bits else x.detach()).numpy()
        else:
            target = x
        if not np.shares_memory(target, written):
            target[...] = written.view(target.dtype)


class DecodeEngine:
    """The KV-cache engine of the Numba backends (NumbaBackend.decode): the Engine contract's
    reason and, for numba_flash.forward_kvcache, forward_kvcache. `kernels`: "auto" (the
    tensor-core kernel where it serves the call, else SIMT; SIMT alone under the simulator),
    "simt" or "tensor-cores" (that kernel alone, under the simulator too)."""
    name = "split-KV decode"

    def __init__(self, kernels="auto"):
        if kernels not in ("auto", "simt", "tensor-cores"):
            raise ValueError(f"kernels: 'auto', 'simt' or 'tensor-cores', not {kernels!r}")
        self.kernels = kernels

    def reason(self, spec, q, k_cache=None):
        return reason(spec, q, k_cache, self.kernels)

    def forward_kvcache(self, spec, q, cache, out, lse, alloc, stream, extras):
        forward_kvcache(spec, q, cache, out, lse, alloc, stream, extras, self.kernels)

    def __repr__(self):
        return f"<numba_flash engine {self.name!r} ({self.kernels})>"
