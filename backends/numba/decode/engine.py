"""The decode engine: numba_flash.forward_kvcache on the split-KV kernels (kernels.py).

It appends the call's new tokens to the cache, picks the split of the key axis (flash-decoding:
enough blocks to fill the GPU when batch x heads alone do not), runs the decode kernel into
float32 partial results and combines them into out and lse.
"""
import numpy as np

from numba_flash import _arrays

from .. import marshal
from ..device.constants import LOG2E
from ..gpu import (SHARED_MEMORY_BYTES, TENSOR_CORE_CC, compute_capability, shared_memory_limit,
                   simulator_enabled)
from ..launch import launch
from .append import append_kernel
from .combine import combine_kernel
from .kernels import BLOCK_N, THREADS, WARPS, decode_kernel, decode_shape, shared_bytes

DTYPES = ("float16", "bfloat16", "float32")
MAX_SPLITS = 128
#: keys a split reads at least (fewer makes the combine's traffic matter)
MIN_KEYS_PER_SPLIT = 4 * BLOCK_N
#: blocks in flight per multiprocessor the heuristic aims at (4-warp blocks, memory bound)
BLOCKS_PER_SM = 4
SIMULATOR_SMS = 4
APPEND_BLOCKS = 1024


def reason(spec, q):
    """None if the decode kernels can serve the call, else why not."""
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


def multiprocessors(q):
    if simulator_enabled():
        return SIMULATOR_SMS
    from numba import cuda
    with cuda.gpus[_arrays.device_id(q)]:
        return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def choose_splits(blocks, visible_keys, sm_count):
    """Splits of the key axis for `blocks` blocks per split reading up to `visible_keys` keys
    each: one when the blocks fill the GPU, else as many as bring them to BLOCKS_PER_SM per
    multiprocessor, each split keeping MIN_KEYS_PER_SPLIT keys or more."""
    wanted = -(-BLOCKS_PER_SM * sm_count // max(blocks, 1))
    most = max(1, min(MAX_SPLITS, visible_keys // MIN_KEYS_PER_SPLIT))
    return max(1, min(wanted, most))


def visible_keys(spec, seqlen_q, max_seqlen_k):
    """The most keys one block's rows can see (a window bounds them)."""
    if spec.window_left >= 0 and spec.window_right >= 0:
        return min(max_seqlen_k, spec.window_left + spec.window_right + seqlen_q)
    return max_seqlen_k


def forward_kvcache(spec, q, cache, out, lse, alloc, stream, extras):
    """Append cache.k_new / v_new (if any), then attention of q over each sequence's cache
    into out and lse (the backend's arrays)."""
    batch, seqlen_q, nheads, head_dim = (int(s) for s in q.shape)
    nheads_kv = int(cache.k_cache.shape[2])
    paged = cache.block_table is not None
    bits = spec.dtype != "float32"  # (the kernels take 16-bit elements as bit patterns)
    k_cache, v_cache = (marshal.view(x, bits=bits) for x in (cache.k_cache, cache.v_cache))
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
    q_view = marshal.view(q, bits)

    shape = decode_shape(spec, seqlen_q * spec.group)
    row_tiles = -(-seqlen_q * spec.group // shape.rows)
    blocks = row_tiles * nheads_kv * batch
    splits = cache.num_splits or choose_splits(
        blocks, visible_keys(spec, seqlen_q, cache.max_seqlen_k), multiprocessors(q))
    out_part = marshal.view(alloc((splits, batch, seqlen_q, nheads, head_dim), "float32"))
    lse_part = marshal.view(alloc((splits, batch, nheads, seqlen_q), "float32"))
    slopes = lse_view
    if spec.alibi:
        slopes = marshal.broadcast(marshal.view(extras.alibi_slopes), (batch, nheads))
    scale_log2 = np.float32(spec.softmax_scale * float(LOG2E))
    async_copy = _async_copy(spec, q, k_cache, v_cache)
    launch(decode_kernel(spec.for_kernels(), paged, async_copy, shape),
           (splits * row_tiles, nheads_kv, batch), THREADS, stream, shared_bytes(spec, shape),
           q_view, k_cache, v_cache, block_table,
           seqlens, fixed, np.int32(new_tokens), out_part, lse_part, scale_log2, slopes)
    launch(combine_kernel(spec.bf16), -(-batch * seqlen_q * nheads // WARPS), THREADS, stream,
           0, out_part, lse_part, marshal.view(out, spec.bf16), lse_view)


def _async_copy(spec, q, k_view, v_view):
    """Whether cp.async can read the caches' rows: sm_80 or newer (or the simulator), rows of
    whole 16-byte chunks, 16-byte aligned, contiguous along the head dim."""
    item = 4 if spec.dtype == "float32" else 2
    if spec.head_dim * item % 16:
        return False
    if not simulator_enabled() and compute_capability(_arrays.device_id(q)) < TENSOR_CORE_CC:
        return False
    return all(marshal.is_tile_ready(x, spec.head_dim) for x in (k_view, v_view))


def _write_back(cache, k_view, v_view, bits):
    """Under the simulator: the appended caches into the caller's host arrays, where
    marshal.view had to copy them (a cache that is not C-contiguous)."""
    for x, written in ((cache.k_cache, k_view), (cache.v_cache, v_view)):
        if type(x).__module__.startswith("torch"):
            import torch
            target = (x.detach().view(torch.int16) if bits else x.detach()).numpy()
        else:
            target = x
        if not np.shares_memory(target, written):
            target[...] = written.view(target.dtype)


class DecodeEngine:
    """The KV-cache engine of the numba and numba-simt backends (NumbaBackend.decode): the
    Engine contract's reason and, for numba_flash.forward_kvcache, forward_kvcache."""
    name = "split-KV decode"
    reason = staticmethod(reason)
    forward_kvcache = staticmethod(forward_kvcache)

    def __repr__(self):
        return f"<numba_flash engine {self.name!r}>"
