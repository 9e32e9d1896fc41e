"""Host time per call: how long the Python side of one call takes, against torch SDPA.

At a tiny shape the GPU work is a few microseconds, so the time per call, with the stream
synchronised after every call, is what a caller waits for beyond the kernels themselves.
bench.py's timer includes it too (it records an event, calls, records an event), so at short
sequences it decides part of the TFLOP/s. With --profile, cProfile's top entries for the
numba forward and backward follow. The rows "model layout" take q, k, v as a transformers
model hands them (bfloat16 views of (batch, heads, seqlen, headdim) tensors, GQA 4:1,
requiring grad); the rows "varlen" the same tokens as packed sequences (two a batch row), one
cu_seqlens array for q and k, on the GPU (the checks read it back: the call waits for the
GPU) or on the host.

    python scripts/overhead.py [--calls 300] [--profile] [--backends numba numba-simt]
                               [--host-only]
"""
import argparse
import cProfile
import pstats
import statistics
import sys
import time

import numpy as np

import harness

BLOCK = 50  # calls a row makes in a turn (time_rows)


def time_rows(runs, calls, host_only=False, block=BLOCK):
    """{row: median microseconds of one call} for runs {row: (fn, sync)}: the rows take turns
    in blocks of `block` calls, so that a drift of the host's speed (large on the GPU
    machines) falls on every row alike. Each call is timed with sync() after it, or, with
    host_only, alone: the host's side of a call, the GPU's work overlapping (the stream is
    drained after each block, outside the timing)."""
    times = {row: [] for row in runs}
    for fn, sync in runs.values():
        fn()
        sync()
    for _ in range(-(-calls // block)):
        for row, (fn, sync) in runs.items():
            for _ in range(block):
                start = time.perf_counter()
                fn()
                if not host_only:
                    sync()
                times[row].append(time.perf_counter() - start)
            sync()
    return {row: 1e6 * statistics.median(seconds) for row, seconds in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--profile", action="store_true", help="also print cProfile's top")
    parser.add_argument("--shape", nargs=4, type=int, default=[1, 128, 4, 64],
                        metavar=("B", "N", "H", "D"))
    parser.add_argument("--backends", nargs="+", default=["numba", "numba-simt"],
                        help="the numba_flash backends timed (CuPy inputs)")
    parser.add_argument("--host-only", action="store_true",
                        help="time the host's side alone (no synchronisation after each call): "
                             "what a replay costs, without the GPU's latency and clocks")
    args = parser.parse_args(argv)
    reason = harness.gpu_ready()
    if reason:
        print(f"overhead.py needs a CUDA GPU and CuPy ({reason})")
        return 2
    import cupy as cp

    import numba_flash
    batch, n, nheads, head_dim = args.shape
    rng = np.random.default_rng(0)
    q, k, v, dout = harness.random_inputs(cp, rng, batch, n, n, nheads, head_dim, "float16")
    sync = cp.cuda.get_current_stream().synchronize
    packed = [x.reshape(batch * n, nheads, head_dim) for x in (q, k, v)]
    lengths = [n // 2, n - n // 2] * batch  # (two sequences a row)
    packed_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    longest = max(lengths)
    runs = {}
    for backend in args.backends:
        def fwd(backend=backend):
            return numba_flash.forward(q, k, v, causal=True, backend=backend)
        out, lse = fwd()

        def bwd(backend=backend):
            numba_flash.backward(dout, q, k, v, out, lse, causal=True, backend=backend)
        runs[f"{backend} forward"] = fwd, sync
        runs[f"{backend} backward"] = bwd, sync
        # Packed sequences as self-attention passes them (one cu_seqlens for q and k): on the
        # GPU, read back by the checks; on the host, checked there and copied.
        for where, offsets in (("GPU", cp.asarray(packed_offsets)), ("host", packed_offsets)):
            def varlen_fwd(backend=backend, offsets=offsets):
                return numba_flash.forward_varlen(*packed, offsets, offsets, longest, longest,
                                                  causal=True, backend=backend)
            runs[f"{backend} varlen forward, cu_seqlens on the {where}"] = varlen_fwd, sync
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        # The same calls on torch tensors (bench.py's bfloat16 inputs are torch tensors).
        for dtype in (torch.float16, torch.bfloat16):
            tensors = [torch.from_dlpack(x).to(dtype) for x in (q, k, v, dout)]

            def torch_fwd(tensors=tensors):
                return numba_flash.forward(*tensors[:3], causal=True, backend="numba")
            name = str(dtype).replace("torch.", "")
            runs[f"numba forward, torch {name}"] = torch_fwd, torch.cuda.synchronize
        # A training model's call (transformers' layout: (B, H, N, D) tensors seen as (B, N, H,
        # D), bfloat16, GQA 4:1, q k v requiring grad, as numba_flash.torch.attention gets them).
        layer = [torch.randn(batch, heads, n, head_dim, device="cuda", dtype=torch.bfloat16,
                             requires_grad=True).transpose(1, 2)
                 for heads in (nheads, max(1, nheads // 4), max(1, nheads // 4), nheads)]

        def layer_fwd():
            return numba_flash.forward(*layer[:3], causal=True, backend="numba")

        def layer_bwd():
            return numba_flash.backward(layer[3], *layer[:3], layer_out, layer_lse, causal=True,
                                        backend="numba")
        try:
            layer_out, layer_lse = layer_fwd()
        except ValueError as error:  # a tree without GQA (overhead_compare.py runs old ones)
            print(f"model layout rows left out: {error}")
        else:
            runs["numba forward, model layout"] = layer_fwd, torch.cuda.synchronize
            runs["numba backward, model layout"] = layer_bwd, torch.cuda.synchronize
        tq, tk, tv, tdout = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v, dout))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def sdpa_fwd():
            return sdpa(tq, tk, tv, is_causal=True)

        def sdpa_fwdbwd():
            a, b, c = (x.detach().requires_grad_() for x in (tq, tk, tv))
            sdpa(a, b, c, is_causal=True).backward(tdout)
        runs["sdpa forward"] = sdpa_fwd, torch.cuda.synchronize
        runs["sdpa forward+backward"] = sdpa_fwdbwd, torch.cuda.synchronize
    how = "host side only" if args.host_only else "stream synchronised after each"
    print(f"shape B{batch} N{n} H{nheads} D{head_dim} float16 (CuPy unless named) causal, "
          f"{-(-args.calls // BLOCK) * BLOCK} calls a row in turns of {BLOCK}, {how}")
    for name, us in time_rows(runs, args.calls, args.host_only).items():
        print(f"{name:32s} {us:8.1f} us per call", flush=True)
    if args.profile:
        for name in (f"{args.backends[0]} forward", f"{args.backends[0]} backward"):
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.calls):
                runs[name][0]()
            sync()
            profile.disable()
            print(f"\n== cProfile, {args.calls} x {name} (cumulative time)")
            pstats.Stats(profile, stream=sys.stdout).sort_stats("cumulative").print_stats(28)
    return 0


if __name__ == "__main__":
    sys.exit(main())
