"""verify.py's forward_kvcache rows: every backend that serves it against float64 attention
over the appended caches, by the accuracy rule (see verify.py)."""
import numpy as np

import harness

# (batch, seqlen_q, nheads, kv_heads, headdim, capacity, new tokens, block size, causal)
GPU_CASES = [(16, 1, 32, 8, 128, 8192, 1, None, False),
             (4, 4, 32, 8, 128, 4096, 4, 16, True),
             (1, 1, 32, 32, 64, 32768, 0, 256, False)]
SIM_CASES = [(2, 2, 2, 1, 16, 48, 2, 16, True)]


def verify_kvcache(table, numba_flash, xp, rng, on_gpu, dtypes, to_host, inputs_class):
    from numba_flash.extras import NO_EXTRAS
    from numba_flash.kvcache import check_kvcache
    from numba_flash.reference import attention_forward
    from numba_flash.reference_kvcache import append, attention_forward_kvcache
    from numba_flash.spec import make_spec
    from numba_flash.testing import error_bound, max_error, plain16_forward, round16
    for case in GPU_CASES if on_gpu else SIM_CASES:
        batch, seqlen_q, heads, kv_heads, dim, capacity, new, block_size, causal = case
        for dtype in dtypes:
            name = (f"{dtype:8s} kvcache B{batch} q{seqlen_q} H{heads}/{kv_heads} D{dim} "
                    f"N{capacity} +{new} {'page' + str(block_size) if block_size else 'flat'}"
                    f"{' causal' if causal else ''}")

            def draw(*shape):
                x = xp.asarray(rng.standard_normal(shape).astype(np.float32))
                return round16(xp, x, dtype) if dtype == "bfloat16" else x.astype(dtype)
            q = draw(batch, seqlen_q, heads, dim)
            pages = batch * capacity // block_size + 3 if block_size else batch
            rows = block_size or capacity
            k_cache, v_cache = draw(pages, rows, kv_heads, dim), draw(pages, rows, kv_heads, dim)
            table_ = (xp.asarray(rng.permutation(pages)[:batch * capacity // block_size]
                                 .reshape(batch, -1).astype(np.int32)) if block_size else None)
            k_new, v_new = ((draw(batch, new, kv_heads, dim), draw(batch, new, kv_heads, dim))
                            if new else (None, None))
            lengths = xp.asarray(rng.integers(0, capacity - new + 1, batch).astype(np.int32))
            want_k, want_v = k_cache.copy(), v_cache.copy()
            cache = check_kvcache(q, want_k, want_v, k_new, v_new, lengths, table_, 0)
            append(cache)
            spec = make_spec(q, k_cache, causal=causal)
            ref = [to_host(x) for x in attention_forward_kvcache(
                xp, q, want_k, want_v, cache, spec, "float64", NO_EXTRAS)]
            base = [to_host(x) for x in attention_forward_kvcache(
                xp, q, want_k, want_v, cache, spec, dtype, NO_EXTRAS,
                forward=plain16_forward if dtype == "bfloat16" else attention_forward)]
            limits = [error_bound(max_error(b, r), r, dtype) for b, r in zip(base, ref)]
            inputs = inputs_class(xp, [], dtype, on_gpu)
            for backend, reason in numba_flash.available_backends().items():
                host = backend == "numpy"
                if reason:
                    table.skip(backend, name, reason)
                    continue
                args = [None if x is None else inputs.for_backend(x, host)
                        for x in (q, k_cache, v_cache, k_new, v_new)]
                if args[1] is k_cache:  # (the call writes into its caches)
                    args[1:3] = [x.copy() for x in args[1:3]]
                side = [None if x is None else (to_host(x) if host else x)
                        for x in (lengths, table_)]
                impl = numba_flash.get_backend(backend)
                reason = impl.supports_kvcache(make_spec(args[0], args[1], causal=causal),
                                               args[0], args[1])
                if reason:
                    table.skip(backend, name, reason)
                    continue
                if on_gpu and not host:
                    harness.poison_memory_pool(8 * q.nbytes)
                out, lse = numba_flash.forward_kvcache(
                    *args[:3], k=args[3], v=args[4], cache_seqlens=side[0], block_table=side[1],
                    causal=causal, backend=backend)
                table.add(backend, name, "out", max_error(to_host(out), ref[0]), limits[0])
                table.add(backend, name, "lse", max_error(to_host(lse), ref[1]), limits[1])
                same = all(np.array_equal(to_host(got), to_host(want))
                           for got, want in ((args[1], want_k), (args[2], want_v)))
                table.add(backend, name, "kv", 0.0 if same else 1.0, 0.0,
                          "" if same else "the caches differ from the reference's append")
