"""forward_kvcache: attention of a few new query tokens per sequence over a key/value cache
(decoding, speculative decoding, chunked prefill), flash-attn's flash_attn_with_kvcache
convention; contiguous or paged caches, new tokens appended in place.

Every check runs, and every value it needs is read (cache_seqlens and block_table: one small
copy from the GPU), before anything is written: a rejected call leaves the cache as it was.
A call whose signature was seen before (numba_flash/call_cache.py: the arrays' shapes,
strides, dtypes, device and alignment, which optional arrays are given, which arrays share
an address, the spec) reads and checks those values again and replays the launches recorded
for it; a call with cache_seqlens as an int always takes the full path (the int is a launch
argument).
"""
from typing import NamedTuple

import numpy as np

from . import _arrays, _checks, call_cache, registry
from .extras import NO_EXTRAS, Extras, host_values
from .spec import NO_WINDOW, make_spec

#: a paged cache's block size is a multiple of this
PAGE_MULTIPLE = 16


class KVCache(NamedTuple):
    """What a backend's forward_kvcache takes besides q (all checked by forward_kvcache).

    k_cache, v_cache: (batch_cache, seqlen_cache, nheads_kv, headdim), or paged (num_blocks,
    block_size, nheads_kv, headdim) with block_table. k_new, v_new: (batch, new_tokens,
    nheads_kv, headdim) to write at positions cache_seqlens[b] onward first, or None.
    cache_seqlens: int32 (batch,) array, or None with fixed_seqlen >= 0 standing for every
    sequence's count (-1 with an array). block_table: int32 (batch, max_blocks) or None.
    max_keys: the most keys a sequence holds, what a backend sizes the split of the key axis
    by: the cache's capacity (seqlen_cache, or max_blocks x block_size when paged), a bound of
    every call with these shapes, so that the splits hold for the call's replays; with
    cache_seqlens an int (a call never replayed), that int + new_tokens, so that short
    sequences in a large cache take few splits. num_splits: the splits of the key axis asked
    for (0: the backend chooses)."""
    k_cache: object
    v_cache: object
    k_new: object
    v_new: object
    cache_seqlens: object
    fixed_seqlen: int
    block_table: object
    max_keys: int
    num_splits: int

    def arrays(self):
        """The optional arrays present (k_new, v_new, cache_seqlens, block_table), in order:
        after q, k_cache and v_cache, what a call's signature and replay take."""
        return tuple(x for x in (self.k_new, self.v_new, self.cache_seqlens, self.block_table)
                     if x is not None)

    def with_arrays(self, k_cache, v_cache, arrays):
        """The same cache on other arrays: the caches and `arrays` as arrays() returned them."""
        values = iter(arrays)
        k_new, v_new, seqlens, table = (None if x is None else next(values)
                                        for x in (self.k_new, self.v_new, self.cache_seqlens,
                                                  self.block_table))
        return self._replace(k_cache=k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new,
                             cache_seqlens=seqlens, block_table=table)

    @property
    def new_tokens(self):
        return 0 if self.k_new is None else int(self.k_new.shape[1])

    def seqlens_k(self, batch):
        """Every sequence's number of keys after the append, on the host (int64 (batch,))."""
        return _cached(batch, self.cache_seqlens, self.fixed_seqlen) + self.new_tokens


def forward_kvcache(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens=None,
                    block_table=None, causal=False, softmax_scale=None, window_size=NO_WINDOW,
                    softcap=0.0, alibi_slopes=None, num_splits=0, backend="auto"):
    """Attention of q over each sequence's cached keys and values (and the new ones).

    Args:
        q: (batch, seqlen_q, nheads, headdim); seqlen_q is small for decoding (1, or a few
            for speculative decoding) but any length works (chunked prefill).
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_kv, headdim), batch_cache >=
            batch (sequence b uses entry b), nheads a multiple of nheads_kv (GQA: the query
            heads of a group share each K/V tile read); or, with block_table, paged:
            (num_blocks, block_size, nheads_kv, headdim), block_size a multiple of 16.
        k, v: (batch, new_tokens, nheads_kv, headdim) or None (both or neither): written into
            the caches in place at positions cache_seqlens[b] ... + new_tokens - 1 (through
            block_table when paged) before attending; the rest of the caches is untouched.
        cache_seqlens: int32 (batch,) array, an int, or None (every cache full:
            seqlen_cache, or max_blocks · block_size when paged; not with k and v): how many
            tokens each sequence has cached. Sequence b attends to its first cache_seqlens[b]
            + new_tokens cache positions.
        block_table: int32 (batch, max_blocks): block i of sequence b's cache is
            k_cache[block_table[b, i]] (the entries its tokens use must be < num_blocks).
            Both are checked on the host before anything is written. On the GPU they are read
            back (the copy waits for the work queued before the call); given on the host
            (NumPy, a CPU torch tensor) with q on the GPU, they are checked there and copied
            to the GPU without waiting, so the host can queue the next work meanwhile.
        causal, softmax_scale, window_size, softcap, alibi_slopes: forward's, aligned to the
            bottom-right corner of each sequence's (seqlen_q, seqlen_k): with causal, query i
            of a chunk of seqlen_q new tokens sees the cache and the new tokens up to itself.
        num_splits: splits of the key axis (flash-decoding), combined by log-sum-exp; 0 lets
            the backend choose from the batch, heads, cache length and the GPU's size.
        backend: a registered name or "auto".

    Returns:
        (out, lse): out like q; lse float32 (batch, nheads, seqlen_q). A query that sees no key
        (an empty cache) gets 0 and -inf.
    """
    spec = make_spec(q, k_cache, causal=causal, softmax_scale=softmax_scale,
                     window_size=window_size, softcap=softcap, alibi=alibi_slopes is not None)
    _check_num_splits(num_splits)
    cache_seqlens, block_table, known = _host_values_to_device(q, cache_seqlens, block_table)
    optional = (k, v, cache_seqlens, block_table, alibi_slopes)  # (KVCache.arrays, Extras')
    arrays = (q, k_cache, v_cache, *(x for x in optional if x is not None))
    key = None
    if not isinstance(cache_seqlens, (int, np.integer)):
        form = ("forward_kvcache", int(num_splits)) + tuple(x is not None for x in optional)
        key = call_cache.signature(form, backend, spec, arrays)
    replay = call_cache.get(key)
    if replay is not None:
        check_kvcache_values(q, k_cache, k, cache_seqlens, block_table, known)
        out, lse = replay(*arrays)
    else:
        cache = check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits,
                              known)
        extras = NO_EXTRAS
        if alibi_slopes is not None:
            _checks.check_alibi_slopes(alibi_slopes, int(q.shape[0]), int(q.shape[2]))
            _checks.check_same_place({"q": q, "alibi_slopes": alibi_slopes})
            extras = Extras(alibi_slopes)
        impl = registry.resolve(backend, spec, q, k_cache, v_cache, kvcache=True)
        if key is None:
            out, lse = impl.forward_kvcache(spec, q, cache, extras)
        else:
            (out, lse), replay = impl.forward_kvcache_and_replay(spec, q, cache, extras)
            call_cache.put(key, replay)
    return _arrays.convert_like(out, q), _arrays.convert_like(lse, q)


def _host_values_to_device(q, cache_seqlens, block_table):
    """(cache_seqlens, block_table, known): _checks.host_arrays_to_device's, those given on
    the host checked for dtype and rank."""
    ranks = {"cache_seqlens": 1, "block_table": 2}
    (cache_seqlens, block_table), known = _checks.host_arrays_to_device(
        q, (("cache_seqlens", cache_seqlens), ("block_table", block_table)),
        lambda name, x: _check_int32(name, x, ranks[name]))
    return cache_seqlens, block_table, known


def check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits,
                  known=(None, None)):
    """The KVCache of a call, every argument but num_splits (forward_kvcache's first check)
    checked (ValueError / TypeError naming it); known: the host values of cache_seqlens and
    block_table where the caller has them (else they are read)."""
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    for name, x in arrays.items():
        _checks.check_array(name, x)
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be 4-D; got shape {_checks._shape_str(x)}")
    batch, seqlen_q, nheads, headdim = (int(s) for s in q.shape)
    if batch < 1 or seqlen_q < 1 or nheads < 1:
        raise ValueError(f"q must have batch, seqlen_q and nheads >= 1; got shape "
                         f"{_checks._shape_str(q)}")
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"k_cache and v_cache must have the same shape; got "
                         f"{_checks._shape_str(k_cache)} and {_checks._shape_str(v_cache)}")
    pages, page_rows, nheads_kv, cache_dim = (int(s) for s in k_cache.shape)
    if cache_dim != headdim:
        raise ValueError(f"headdim mismatch: q has {headdim}, k_cache has {cache_dim}")
    _checks.check_group(nheads, nheads_kv)
    dtype = _arrays.dtype_name(q)
    for name in ("k_cache", "v_cache"):
        if _arrays.dtype_name(arrays[name]) != dtype:
            raise TypeError(f"{name} must have q's dtype {dtype}; got "
                            f"{_arrays.dtype_name(arrays[name])}")
    if dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"q must be floating point ({', '.join(_checks.FLOAT_DTYPES)}); got "
                        f"{dtype}")

    if block_table is None:
        if pages < batch:
            raise ValueError(f"k_cache has {pages} sequences (batch_cache) and q {batch}: "
                             f"batch_cache must be >= batch")
        capacity = page_rows
    else:
        _check_int32("block_table", block_table, 2)
        arrays["block_table"] = block_table
        if int(block_table.shape[0]) != batch:
            raise ValueError(f"block_table must have shape (batch, max_blocks) with batch = "
                             f"{batch}; got {_checks._shape_str(block_table)}")
        if page_rows % PAGE_MULTIPLE or page_rows == 0:
            raise ValueError(f"a paged cache's block_size (k_cache.shape[1]) must be a multiple "
                             f"of {PAGE_MULTIPLE}; got {page_rows}")
        capacity = int(block_table.shape[1]) * page_rows

    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new tokens' keys and values)")
    if k is not None:
        for name, x in (("k", k), ("v", v)):
            _checks.check_array(name, x)
            arrays[name] = x
            shape = tuple(int(s) for s in x.shape)
            if len(shape) != 4 or shape != (batch, int(k.shape[1]), nheads_kv, headdim):
                raise ValueError(f"{name} must have shape (batch, new_tokens, nheads_kv, "
                                 f"headdim) = ({batch}, new_tokens, {nheads_kv}, {headdim}), "
                                 f"the same for k and v; got {_checks._shape_str(x)}")
            if _arrays.dtype_name(x) != dtype:
                raise TypeError(f"{name} must have q's dtype {dtype}; got "
                                f"{_arrays.dtype_name(x)}")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is needed with k and v: it says where the new "
                             "tokens go")
    new_tokens = 0 if k is None else int(k.shape[1])

    fixed = -1
    if cache_seqlens is None:
        fixed = capacity
    elif isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        fixed = int(cache_seqlens)
        cache_seqlens = None
    else:
        _check_int32("cache_seqlens", cache_seqlens, 1)
        if int(cache_seqlens.shape[0]) != batch:
            raise ValueError(f"cache_seqlens must have shape (batch,) = ({batch},); got "
                             f"{_checks._shape_str(cache_seqlens)}")
        arrays["cache_seqlens"] = cache_seqlens
    _checks.check_same_place(arrays)
    _check_values(_cached(batch, cache_seqlens, fixed, known[0]), new_tokens, capacity,
                  block_table, known[1], page_rows, pages)
    max_keys = fixed + new_tokens if fixed >= 0 else capacity  # (None: fixed is the capacity)
    return KVCache(k_cache, v_cache, k, v, cache_seqlens, fixed, block_table, max_keys,
                   int(num_splits))


def check_kvcache_values(q, k_cache, k, cache_seqlens, block_table, known=(None, None)):
    """The checks of what a call's arrays hold (cache_seqlens within the cache, block_table
    inside it), for a call whose shapes check_kvcache has passed before (a replay); known as
    check_kvcache's."""
    pages, page_rows = int(k_cache.shape[0]), int(k_cache.shape[1])
    capacity = page_rows if block_table is None else int(block_table.shape[1]) * page_rows
    fixed = capacity if cache_seqlens is None else -1
    _check_values(_cached(int(q.shape[0]), cache_seqlens, fixed, known[0]),
                  0 if k is None else int(k.shape[1]), capacity, block_table, known[1],
                  page_rows, pages)


def _cached(batch, cache_seqlens, fixed, values=None):
    """Every sequence's cached tokens before the append, on the host (int64 (batch,)): the
    known `values`, else cache_seqlens' read (or `fixed` for each)."""
    if cache_seqlens is None:
        return np.full(batch, fixed, np.int64)
    return (host_values(cache_seqlens) if values is None else values).astype(np.int64)


def _check_values(cached, new_tokens, capacity, block_table, table_values, page_rows, pages):
    if (cached < 0).any():
        at = int(np.argmax(cached < 0))
        raise ValueError(f"cache_seqlens must be >= 0; got {int(cached[at])} for sequence {at}")
    total = cached + new_tokens
    if (total > capacity).any():
        at = int(np.argmax(total > capacity))
        raise ValueError(
            f"sequence {at} would hold {int(total[at])} tokens (cache_seqlens "
            f"{int(cached[at])} + {new_tokens} new) but its cache holds {capacity}"
            + (" (max_blocks x block_size)" if block_table is not None else " (seqlen_cache)"))
    if block_table is not None:
        _check_pages(host_values(block_table) if table_values is None else table_values, total,
                     page_rows, pages)


def _check_num_splits(num_splits):
    if not isinstance(num_splits, (int, np.integer)) or isinstance(num_splits, bool) \
            or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: chosen); got {num_splits!r}")


def _check_int32(name, x, rank):
    _checks.check_array(name, x)
    if _arrays.dtype_name(x) != "int32":
        raise TypeError(f"{name} must be int32; got {_arrays.dtype_name(x)}")
    if len(x.shape) != rank:
        raise ValueError(f"{name} must be {rank}-D; got shape {_checks._shape_str(x)}")


def _check_pages(table, seqlens_k, block_size, num_blocks):
    """The block-table entries each sequence uses (its first ceil(seqlen_k / block_size))
    point inside the cache (all sequences at once: this runs on every call)."""
    used = -(-np.asarray(seqlens_k) // block_size)
    bad = (np.arange(table.shape[1]) < used[:, None]) & ((table < 0) | (table >= num_blocks))
    if bad.any():
        b, at = (int(i) for i in np.unravel_index(np.argmax(bad), bad.shape))
        raise ValueError(f"block_table[{b}, {at}] = {int(table[b, at])} points outside the "
                         f"cache's {num_blocks} blocks (sequence {b} uses its first "
                         f"{int(used[b])} entries)")
