"""forward_kvcache's meaning, for the reference backends (numpy, cupy) and the tests: the new
tokens written into the cache, then each sequence's attention over its first seqlen_k cache
positions (through the block table when paged), numba_flash.reference's dense attention of
that one sequence.
"""
import numpy as np

from .extras import NO_EXTRAS, host_values
from .reference import attention_forward


def append(cache):
    """Write cache.k_new / v_new into the caller's cache arrays (NumPy, CuPy or torch) at
    positions cache_seqlens[b] onward, in place."""
    if cache.k_new is None:
        return
    batch, new_tokens = (int(n) for n in cache.k_new.shape[:2])
    starts = cache.seqlens_k(batch) - new_tokens
    table = None if cache.block_table is None else host_values(cache.block_table)
    block_size = int(cache.k_cache.shape[1])
    for b in range(batch):
        for n in range(new_tokens):
            position = int(starts[b]) + n
            page, slot = ((b, position) if table is None
                          else (int(table[b, position // block_size]), position % block_size))
            cache.k_cache[page, slot] = cache.k_new[b, n]
            cache.v_cache[page, slot] = cache.v_new[b, n]


def sequence_keys(xp, k_cache, v_cache, table, b, seqlen_k):
    """Sequence b's first seqlen_k keys and values, (1, seqlen_k, nheads_kv, headdim), from
    the caches as xp arrays (table: the block table's values on the host, or None)."""
    positions = np.arange(seqlen_k)
    if table is None:
        return k_cache[b:b + 1, :seqlen_k], v_cache[b:b + 1, :seqlen_k]
    block_size = int(k_cache.shape[1])
    pages = xp.asarray(table[b, positions // block_size].astype(np.int64))
    slots = xp.asarray((positions % block_size).astype(np.int64))
    return k_cache[pages, slots][None], v_cache[pages, slots][None]


def attention_forward_kvcache(xp, q, k_cache, v_cache, cache, spec, dtype, extras=NO_EXTRAS,
                              forward=attention_forward):
    """(out, lse) in `dtype` of q (batch, seqlen_q, nheads, headdim) over the caches (xp
    arrays, the append already made): each sequence alone, with its own seqlen_k, by
    `forward` (reference.attention_forward; the tests' plain 16-bit one has its signature)."""
    batch = int(q.shape[0])
    table = None if cache.block_table is None else host_values(cache.block_table)
    outs, lses = [], []
    for b, seqlen_k in enumerate(cache.seqlens_k(batch)):
        if seqlen_k == 0:  # an empty cache: no key seen
            shape = tuple(int(n) for n in q.shape)
            outs.append(xp.zeros((1,) + shape[1:], dtype))
            lses.append(xp.full((1, shape[2], shape[1]), -np.inf, dtype))
            continue
        k, v = sequence_keys(xp, k_cache, v_cache, table, b, int(seqlen_k))
        slopes = extras.alibi_slopes
        if slopes is not None and len(slopes.shape) == 2:
            slopes = slopes[b:b + 1]
        out, lse = forward(xp, q[b:b + 1], k, v, spec, dtype,
                           extras._replace(alibi_slopes=slopes))
        outs.append(out)
        lses.append(lse)
    return xp.concatenate(outs), xp.concatenate(lses)
