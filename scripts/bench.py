"""Side-by-side attention timings on one GPU: numba_flash backends and their peers.

Peers, measured in the same run on the same inputs: the cupy backend (standard attention), and
when torch is present torch SDPA with each of its backends (flash, cudnn, efficient, math).
Convention (flash-attn's benchmarks): batch x seqlen = --tokens (16k) and nheads x headdim =
2048. FLOPs: forward 4·B·H·Nq·Nk·D, halved for causal; backward 2.5x the forward.
Timing: CUDA events around each call after warm-up, median of repeats, the implementations
(and the dtypes) of a case taking turns call by call, rotating over input sets so that repeats
do not run out of L2 (the GPU idles before each call: host time before the first launch counts,
as for a caller waiting on the result). Peak extra memory: what the call takes beyond its inputs.

    python scripts/bench.py --dtypes float32 float16 --head-dims 64 128 --json $OUT/bench.json
"""
import argparse
import statistics
import sys

import numpy as np

import harness

#: "numba" picks the tensor-core kernels for 16-bit inputs on this GPU; "numba-simt" shows the
#: SIMT kernels beside them.
NUMBA_FLASH_BACKENDS = ("numba", "numba-simt", "cupy")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
SDPA_KINDS = ("flash", "cudnn", "efficient", "math")
TORCH_BACKENDS = {"float16": SDPA_KINDS, "bfloat16": SDPA_KINDS, "float32": ("efficient", "math")}


def flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal, passes):
    forward = 4.0 * batch * nheads * seqlen_q * seqlen_k * headdim / (2.0 if causal else 1.0)
    return forward * (3.5 if passes == "fwdbwd" else 1.0)


class Timer:
    """Median milliseconds of each fn(i), by CUDA events on the current stream. The
    implementations take turns, one timed call each per round, so that a drift of the GPU's
    clocks during a case reaches all of them alike."""

    def __init__(self, cupy, target_ms=600.0, max_repeats=60):
        self.cupy, self.target_ms, self.max_repeats = cupy, target_ms, max_repeats

    def _time(self, fn, i):
        cp = self.cupy
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn(i)
        stop.record()
        stop.synchronize()
        return cp.cuda.get_elapsed_time(start, stop)

    def __call__(self, fns):
        """{name: median ms, or the exception it raised} for {name: fn}; fn(i) runs on input
        set i (rotating); each fn has run once already (the warm-up: compilation, autotuning,
        allocator growth). An fn that raises leaves the rounds; the others go on."""
        self.cupy.cuda.get_current_stream().synchronize()
        times, failed = {name: [] for name in fns}, {}

        def run(name, i):
            try:
                times[name].append(self._time(fns[name], i))
            except Exception as exc:  # e.g. out of memory with every dtype's inputs alive
                failed[name] = exc
                del times[name]

        for name in fns:
            run(name, 1)
        first = sum(t[0] for t in times.values())
        repeats = int(min(self.max_repeats, max(3, self.target_ms / max(first, 1e-3))))
        for i in range(repeats):
            for name in list(times):
                run(name, i)
        return {**{name: statistics.median(t) for name, t in times.items()}, **failed}


def make_runners(numba_flash, cp, torch, inputs, causal, passes, dtype,
                 numba_flash_backends=NUMBA_FLASH_BACKENDS, sdpa_kinds=SDPA_KINDS):
    """{name: fn(i) running one call on input set i}, for every implementation that applies."""
    runners = {}
    for name in numba_flash_backends:
        if name == "numba-simt" and dtype == "float32":
            continue  # "numba" runs the SIMT kernels for float32 already

        def run(i, name=name):
            q, k, v, dout = inputs[i]
            out, lse = numba_flash.forward(q, k, v, causal=causal, backend=name)
            if passes == "fwdbwd":
                numba_flash.backward(dout, q, k, v, out, lse, causal=causal, backend=name)
        runners[name] = run
    if torch is None:
        return runners
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kinds = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    # (B, N, H, D) CuPy arrays -> (B, H, N, D) torch views of the same memory.
    views = [[torch.from_dlpack(x).transpose(1, 2) for x in arrays] for arrays in inputs]
    for kind in TORCH_BACKENDS[dtype]:
        if kind not in sdpa_kinds:
            continue

        def run(i, kind=kind):
            q, k, v, dout = views[i]
            with sdpa_kernel(kinds[kind]):
                if passes == "fwdbwd":
                    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                if passes == "fwdbwd":
                    out.backward(dout)
        runners[f"sdpa-{kind}"] = run
    return runners


def peak_extra(cp, torch, fn):
    """Peak device memory fn takes beyond what is already allocated (CuPy pool + torch)."""
    if torch is not None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        torch_before = torch.cuda.memory_allocated()
    _, cupy_extra = harness.peak_extra_bytes(fn)
    torch_extra = 0
    if torch is not None:
        torch.cuda.synchronize()
        torch_extra = torch.cuda.max_memory_allocated() - torch_before
    return cupy_extra + torch_extra


def random_inputs(cp, torch, rng, shape, dtype):
    """q, k, v, dout as CuPy arrays, or for bfloat16 (which CuPy lacks) as torch tensors."""
    if dtype != "bfloat16":
        return harness.random_inputs(cp, rng, *shape, dtype)
    return [torch.from_dlpack(x).to(torch.bfloat16)
            for x in harness.random_inputs(cp, rng, *shape, "float32")]


def warmed_runners(numba_flash, cp, torch, rng, dtype, shape, causal, passes, backends,
                   sdpa_kinds):
    """(row results so far, {name: fn(i)}): each implementation that can run the case, warmed
    up; fn(i) runs on input set i modulo the sets made."""
    batch, _, seqlen, nheads, headdim = shape
    one_set = 4 * batch * seqlen * nheads * headdim * ITEMSIZE[dtype]
    n_inputs = 1 if one_set > 120 * 2**20 else 3  # rotate when a set would stay in the 60 MB L2
    inputs = [random_inputs(cp, torch, rng, shape, dtype) for _ in range(n_inputs)]
    q, k, v, _ = inputs[0]
    results, ready = {}, {}
    for name, fn in make_runners(numba_flash, cp, torch, inputs, causal, passes, dtype,
                                 backends, sdpa_kinds).items():
        if name in backends:
            selection = numba_flash.select_backend(q, k, v, causal=causal, backend=name)
            reason = selection.skipped.get(name)
            if reason:
                results[name] = {"skipped": reason}
                continue
        try:
            fn(0)  # warm-up: compilation, autotuning, allocator growth
            ready[name] = lambda i, fn=fn: fn(i % n_inputs)
        except Exception as exc:  # a peer that cannot run this case (e.g. OOM, unsupported)
            results[name] = {"skipped": f"{type(exc).__name__}: {str(exc)[:120]}"}
            if torch is not None:
                torch.cuda.empty_cache()
            cp.get_default_memory_pool().free_all_blocks()
    return results, ready


def bench_case(numba_flash, cp, torch, timer, rng, dtypes, headdim, seqlen, causal, passes,
               tokens, model_dim, backends=NUMBA_FLASH_BACKENDS, sdpa_kinds=SDPA_KINDS):
    """One row per dtype; the implementations of every dtype take turns in one timing loop,
    so that a case's dtypes are compared under the same clocks too."""
    batch = max(1, tokens // seqlen)
    nheads = max(1, model_dim // headdim)
    shape = (batch, seqlen, seqlen, nheads, headdim)
    work = flops(batch, nheads, seqlen, seqlen, headdim, causal, passes)
    rows, ready = [], {}
    for dtype in dtypes:
        results, runners = warmed_runners(numba_flash, cp, torch, rng, dtype, shape, causal,
                                          passes, backends, sdpa_kinds)
        rows.append({"dtype": dtype, "headdim": headdim, "seqlen": seqlen, "batch": batch,
                     "nheads": nheads, "causal": causal, "passes": passes, "results": results})
        ready.update(((dtype, name), fn) for name, fn in runners.items())
    del runners
    for (dtype, name), ms in timer(ready).items():
        results = rows[dtypes.index(dtype)]["results"]
        try:
            if isinstance(ms, Exception):
                raise ms
            extra = peak_extra(cp, torch, lambda: ready[dtype, name](0))
        except Exception as exc:
            results[name] = {"skipped": f"{type(exc).__name__}: {str(exc)[:120]}"}
            continue
        results[name] = {"ms": ms, "tflops": work / ms / 1e9, "peak_extra_mib": extra / 2**20}
    ready.clear()  # (the runners hold the inputs)
    cp.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()
    return rows


def print_table(rows, baseline="numba"):
    for row in rows:
        head = (f"{row['passes']:6s} {row['dtype']:8s} d{row['headdim']:<3d} "
                f"N{row['seqlen']:<6d} B{row['batch']:<3d} H{row['nheads']:<3d} "
                f"{'causal' if row['causal'] else 'full  '}")
        ours = row["results"].get(baseline, {}).get("tflops")
        cells = []
        for name, r in row["results"].items():
            if "tflops" not in r:
                cells.append(f"{name}: skip")
                continue
            ratio = f" ({ours / r['tflops']:.2f}x)" if ours and name != baseline else ""
            cells.append(f"{name}: {r['tflops']:.1f} TF/s, {r['peak_extra_mib']:.0f} MiB{ratio}")
        print(head + " | " + " | ".join(cells), flush=True)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = sorted({(r["dtype"], r["headdim"], r["causal"], r["passes"]) for r in rows})
    names = sorted({n for r in rows for n in r["results"]})
    colors = {name: f"C{i}" for i, name in enumerate(names)}  # one colour per implementation
    fig, axes = plt.subplots(2, len(groups), figsize=(4.5 * len(groups), 8), squeeze=False)
    for col, (dtype, headdim, causal, passes) in enumerate(groups):
        sel = [r for r in rows if (r["dtype"], r["headdim"], r["causal"], r["passes"]) ==
               (dtype, headdim, causal, passes)]
        for name in names:
            pts = [(r["seqlen"], r["results"][name]) for r in sel
                   if "tflops" in r["results"].get(name, {})]
            if not pts:
                continue
            xs = [p[0] for p in pts]
            style = dict(marker="o", label=name, color=colors[name])
            axes[0][col].plot(xs, [p[1]["tflops"] for p in pts], **style)
            axes[1][col].plot(xs, [p[1]["peak_extra_mib"] for p in pts], **style)
        title = f"{passes} {dtype} d{headdim} {'causal' if causal else 'full'}"
        axes[0][col].set(title=title, xscale="log", xlabel="seqlen", ylabel="TFLOP/s")
        axes[1][col].set(xscale="log", yscale="log", xlabel="seqlen",
                         ylabel="peak extra memory (MiB)")
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16"])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--seqlens", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--causal", nargs="+", default=["false"], choices=["false", "true"])
    parser.add_argument("--passes", nargs="+", default=["fwd"], choices=["fwd", "fwdbwd"])
    parser.add_argument("--tokens", type=int, default=16384, help="batch x seqlen")
    parser.add_argument("--model-dim", type=int, default=2048, help="nheads x headdim")
    parser.add_argument("--backends", nargs="+", default=list(NUMBA_FLASH_BACKENDS),
                        help="numba_flash backends to time")
    parser.add_argument("--no-torch", action="store_true", help="leave torch SDPA out")
    parser.add_argument("--sdpa", nargs="+", default=list(SDPA_KINDS), choices=SDPA_KINDS,
                        help="torch SDPA backends to time (those that take the dtype)")
    parser.add_argument("--json", help="write all results here")
    parser.add_argument("--plot", help="write a PNG plot here")
    args = parser.parse_args(argv)
    reason = harness.gpu_ready()
    if reason:
        print(f"bench.py needs a CUDA GPU and CuPy ({reason})")
        return 2
    import cupy as cp

    import numba_flash
    torch = harness.optional_torch(args.no_torch)
    if torch is None and "bfloat16" in args.dtypes:
        print("bfloat16 left out: its inputs are torch tensors (CuPy has no bfloat16)")
        args.dtypes = [d for d in args.dtypes if d != "bfloat16"]
    props = cp.cuda.runtime.getDeviceProperties(0)
    print(f"GPU: {props['name'].decode()}; ratios are numba / peer", flush=True)
    timer = Timer(cp)
    rng = np.random.default_rng(0)
    cases = [(p, h, n, c == "true") for p in args.passes for h in args.head_dims
             for c in args.causal for n in args.seqlens]
    rows = []
    for index, (passes, headdim, seqlen, causal) in enumerate(cases, 1):
        print(f"[{index}/{len(cases)}] {passes} d{headdim} N{seqlen} "
              f"{'causal' if causal else 'full'} ...", file=sys.stderr, flush=True)
        case_rows = bench_case(numba_flash, cp, torch, timer, rng, args.dtypes, headdim, seqlen,
                               causal, passes, args.tokens, args.model_dim, args.backends,
                               args.sdpa)
        rows += case_rows
        print_table(case_rows)  # each case as it is done, and the JSON so far
        harness.write_json(args.json, {"gpu": props["name"].decode(), "rows": rows})
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
