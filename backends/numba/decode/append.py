"""The cache write of forward_kvcache: `append_kernel` copies the new tokens' k and v, bit for
bit, into the cache at positions cache_seqlens[b] onward (through the block table when
paged), before the decode kernel reads it."""
import functools

from numba import cuda, int32


@functools.lru_cache(maxsize=None)
def append_kernel(paged):
    """k_new, v_new (batch, new_tokens, nheads_kv, D) into the caches at positions
    cache_seqlens[b] + i (or fixed_seqlen + i), bit for bit; a grid-stride loop."""
    def append(k_new, v_new, k_cache, v_cache, block_table, cache_seqlens, fixed_seqlen):
        batch, new_tokens, nheads_kv, D = k_new.shape
        block_size = k_cache.shape[1]
        for i in range(cuda.grid(1), batch * new_tokens * nheads_kv * D, cuda.gridsize(1)):
            c = i % D
            h = i // D % nheads_kv
            n = i // (D * nheads_kv) % new_tokens
            b = i // (D * nheads_kv * new_tokens)
            key = int32(fixed_seqlen if fixed_seqlen >= 0 else cache_seqlens[b]) + n
            if paged:
                page, slot = block_table[b, key // block_size], key % block_size
            else:
                page, slot = b, key
            k_cache[page, slot, h, c] = k_new[b, n, h, c]
            v_cache[page, slot, h, c] = v_new[b, n, h, c]

    return cuda.jit(append, cache=True)
