"""KV-cache decoding on one GPU: numba_flash.forward_kvcache beside torch SDPA (cuDNN, flash).

One query token per sequence (--seqlen-q), head dim 128, full caches of --caches tokens:
batch 16 with 32 heads, multi-head and GQA (8 key/value heads), and batch 1 with 32 heads;
contiguous caches and paged ones (block sizes --block-sizes, the blocks a random permutation of
the same memory). K/V bytes read per second count each cached key and value once (what the
kernel must read); ours on --backends ("numba": the tensor-core decode kernel for these
dtypes; "numba-simt": the SIMT one), with the splits' heuristic and any --splits forced;
SDPA gets q (B, H, 1, D) and the caches as (B, H_kv, N, D) views (enable_gqa for GQA).
"host lengths" (and "paged N host", the block table too): ours with cache_seqlens given on
the host (checked there, copied to the GPU without waiting), where the plain rows give it on
the GPU (read back to be checked: each call waits for the work queued before it).
Times are CUDA-event medians (scripts/bench.py's Timer); "step" is the wall time of one call
with the host's share (checks, the cache_seqlens read), averaged over --step-calls calls and
one synchronisation.

    python scripts/bench_decode.py [--dtypes float16 bfloat16] [--caches 8192 32768 131072]
        [--backends numba numba-simt] [--splits 16 64]
"""
import argparse
import sys
import time

import bench
import harness


def shapes(caches):
    """(batch, heads, kv_heads, cache tokens) rows."""
    rows = []
    for tokens in caches:
        rows += [(16, 32, 32, tokens), (16, 32, 8, tokens)]
    rows += [(1, 32, 32, max(caches)), (1, 32, 8, max(caches))]
    return rows


def step_ms(cp, fn, calls):
    """Wall milliseconds of one call, host included: `calls` calls, one synchronisation."""
    fn()
    cp.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    cp.cuda.Device().synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def row_runners(numba_flash, torch, args, dtype, batch, heads, kv_heads, tokens, gen):
    """{label: fn()} for one shape: ours contiguous and paged, the SDPA peers."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch_dtype = getattr(torch, dtype)
    q = torch.randn(batch, args.seqlen_q, heads, 128, generator=gen, device="cuda",
                    dtype=torch_dtype)
    k_cache, v_cache = (torch.randn(batch, tokens, kv_heads, 128, generator=gen, device="cuda",
                                    dtype=torch_dtype) for _ in range(2))
    lengths = torch.full((batch,), tokens, dtype=torch.int32, device="cuda")
    host_lengths = lengths.cpu()
    fns = {}
    for backend in args.backends:
        for splits in [0] + args.splits:
            label = backend if not splits else f"{backend} splits {splits}"
            fns[label] = (lambda backend=backend, splits=splits: numba_flash.forward_kvcache(
                q, k_cache, v_cache, cache_seqlens=lengths, num_splits=splits,
                backend=backend))
        fns[f"{backend} host lengths"] = (lambda backend=backend: numba_flash.forward_kvcache(
            q, k_cache, v_cache, cache_seqlens=host_lengths, backend=backend))
    for block_size in args.block_sizes:
        blocks = batch * tokens // block_size
        order = torch.randperm(blocks, generator=gen, device="cuda").to(torch.int32)
        table = order.reshape(batch, tokens // block_size)
        paged = [x.reshape(blocks, block_size, kv_heads, 128) for x in (k_cache, v_cache)]
        host_table = table.cpu()
        for backend in args.backends:
            fns[f"{backend} paged {block_size}"] = (
                lambda paged=paged, table=table, backend=backend: numba_flash.forward_kvcache(
                    q, *paged, cache_seqlens=lengths, block_table=table, backend=backend))
            fns[f"{backend} paged {block_size} host"] = (
                lambda paged=paged, table=host_table, backend=backend:
                numba_flash.forward_kvcache(q, *paged, cache_seqlens=host_lengths,
                                            block_table=table, backend=backend))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k_cache, v_cache))
    for name, kind in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                       ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
        def peer(kind=kind):
            with sdpa_kernel(kind):
                return torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, enable_gqa=kv_heads != heads)
        fns[name] = peer
    return fns


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"],
                        choices=["float16", "bfloat16"])
    parser.add_argument("--caches", nargs="+", type=int, default=[8192, 32768, 131072])
    parser.add_argument("--block-sizes", nargs="*", type=int, default=[16, 256])
    parser.add_argument("--backends", nargs="+", default=["numba", "numba-simt"])
    parser.add_argument("--splits", nargs="*", type=int, default=[],
                        help="also run ours with these num_splits forced")
    parser.add_argument("--seqlen-q", type=int, default=1)
    parser.add_argument("--step-calls", type=int, default=20)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    reason = harness.gpu_ready()
    torch = harness.optional_torch()
    if reason or torch is None:
        print(f"bench_decode.py needs a CUDA GPU, CuPy and torch ({reason or 'no torch'})")
        return 2
    import cupy as cp

    import numba_flash
    gen = torch.Generator(device="cuda").manual_seed(0)
    timer = bench.Timer(cp)
    results = []
    for dtype in args.dtypes:
        for batch, heads, kv_heads, tokens in shapes(args.caches):
            fns = row_runners(numba_flash, torch, args, dtype, batch, heads, kv_heads, tokens,
                              gen)
            ready = {}
            for label, fn in fns.items():
                try:
                    fn()
                    ready[label] = lambda i, fn=fn: fn()
                except Exception as exc:  # a peer that does not take this shape
                    print(f"  {label}: skipped ({type(exc).__name__}: {str(exc)[:100]})")
            times = timer(ready)
            kv_bytes = 2 * batch * tokens * kv_heads * 128 * 2
            row = {"dtype": dtype, "batch": batch, "heads": heads, "kv_heads": kv_heads,
                   "cache": tokens, "seqlen_q": args.seqlen_q}
            for label, ms in times.items():
                if isinstance(ms, float):
                    row[label] = {"ms": ms, "tb_per_s": kv_bytes / ms / 1e9,
                                  "step_ms": step_ms(cp, fns[label], args.step_calls)}
                else:
                    row[label] = {"error": repr(ms)[:120]}
            results.append(row)
            cells = "  ".join(f"{label} {v['tb_per_s']:.2f} TB/s ({v['step_ms']:.3f} ms step)"
                              for label, v in row.items()
                              if isinstance(v, dict) and "tb_per_s" in v)
            print(f"{dtype} B{batch} H{heads}/{kv_heads} N{tokens}: {cells}", flush=True)
            del fns, ready
            torch.cuda.empty_cache()
            harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
