"""forward_kvcache's bad input: a clear error naming the argument, raised before any launch
and before anything is written (the caches are as they were)."""
import numpy as np
import pytest

import numba_flash


def _arrays(rng, paged=False):
    q = rng.standard_normal((2, 1, 4, 8)).astype(np.float32)
    shape = (6, 16, 2, 8) if paged else (2, 32, 2, 8)
    k_cache, v_cache = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    new = [rng.standard_normal((2, 1, 2, 8)).astype(np.float32) for _ in range(2)]
    return q, k_cache, v_cache, new


CASES = {
    "cache_seqlens int64": (dict(cache_seqlens=np.array([3, 4], np.int64)), TypeError,
                            "cache_seqlens must be int32"),
    "cache_seqlens too long": (dict(cache_seqlens=np.array([3, 32], np.int32)), ValueError,
                               "would hold 33 tokens"),
    "cache_seqlens negative": (dict(cache_seqlens=np.array([-1, 2], np.int32)), ValueError,
                               "cache_seqlens must be >= 0"),
    "cache_seqlens shape": (dict(cache_seqlens=np.array([3], np.int32)), ValueError,
                            r"cache_seqlens must have shape \(batch,\)"),
    "k without v": (dict(cache_seqlens=np.array([3, 4], np.int32), v=None), ValueError,
                    "k and v must be given together"),
    "k without cache_seqlens": (dict(cache_seqlens=None), ValueError,
                                "cache_seqlens is needed with k and v"),
    "k of the wrong shape": (dict(cache_seqlens=np.array([3, 4], np.int32),
                                  k=np.zeros((2, 1, 4, 8), np.float32)), ValueError,
                             "k must have shape"),
    "num_splits negative": (dict(cache_seqlens=np.array([3, 4], np.int32), num_splits=-1),
                            ValueError, "num_splits must be an int >= 0"),
    "block_table int64": (dict(cache_seqlens=np.array([3, 4], np.int32),
                               block_table=np.zeros((2, 2), np.int64)), TypeError,
                          "block_table must be int32"),
    "block_table outside": (dict(cache_seqlens=np.array([3, 20], np.int32),
                                 block_table=np.array([[0, 1], [2, 6]], np.int32)),
                            ValueError, r"block_table\[1, 1\] = 6 points outside"),
    "block_table batch": (dict(cache_seqlens=np.array([3, 4], np.int32),
                               block_table=np.zeros((3, 2), np.int32)), ValueError,
                          r"block_table must have shape \(batch, max_blocks\)"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_refused_and_the_cache_untouched(rng, case):
    options, error, message = CASES[case]
    paged = "block_table" in options
    q, k_cache, v_cache, (k, v) = _arrays(rng, paged)
    before = k_cache.copy(), v_cache.copy()
    arguments = dict(k=k, v=v)
    arguments.update(options)
    with pytest.raises(error, match=message):
        numba_flash.forward_kvcache(q, k_cache, v_cache, backend="numba-simt", **arguments)
    np.testing.assert_array_equal(k_cache, before[0])
    np.testing.assert_array_equal(v_cache, before[1])


def test_a_block_size_not_a_multiple_of_16_is_refused(rng):
    q = rng.standard_normal((1, 1, 2, 8)).astype(np.float32)
    k_cache = rng.standard_normal((4, 12, 2, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="block_size .* must be a multiple of 16"):
        numba_flash.forward_kvcache(q, k_cache, k_cache.copy(), cache_seqlens=3,
                                    block_table=np.zeros((1, 2), np.int32))


def test_backends_without_kv_cache_kernels_say_so(rng):
    q, k_cache, v_cache, _ = _arrays(rng)
    with pytest.raises(ValueError, match="numba-hopper.*no KV-cache kernels"):
        numba_flash.forward_kvcache(q, k_cache, v_cache, cache_seqlens=3,
                                    backend="numba-hopper")


def test_the_tensor_core_decode_kernel_says_what_it_takes(rng):
    """numba-mma decodes on tensor cores alone: float32, and head dims that are not multiples
    of 16, are refused with the reason (and nothing written)."""
    q, k_cache, v_cache, (k, v) = _arrays(rng)
    before = k_cache.copy()
    with pytest.raises(ValueError, match="numba-mma.*dtype float32 is not supported"):
        numba_flash.forward_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=3,
                                    backend="numba-mma")
    np.testing.assert_array_equal(k_cache, before)
    q, k_cache, v_cache = (np.concatenate([x, x[..., :4]], -1).astype(np.float16)
                           for x in (q, k_cache, v_cache))
    with pytest.raises(ValueError, match="numba-mma.*multiples of 16 up to 256; got 12"):
        numba_flash.forward_kvcache(q, k_cache, v_cache, cache_seqlens=3, backend="numba-mma")
