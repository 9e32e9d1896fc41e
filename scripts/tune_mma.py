"""Time candidate tile configs of the tensor-core kernels side by side on one GPU: the mma.sync
family's, or with --family hopper the Hopper (wgmma) family's.

Each candidate is checked against float64 standard attention (first batch entry) and timed
with CUDA events (median of 7). Candidates that cannot run (e.g. more shared memory than
mma/config.py's MMA_SHARED_MEMORY_BYTES) are reported and skipped. Each candidate listed
compiled without spills for sm_90 when it was added (ptxas; several only since the ldmatrix
addresses of 2026-11-30); check a winner with scripts/ptx_check.py before choosing it for
backends/numba/mma/config.py.

    python scripts/tune_mma.py --head-dims 64 128 --seqlen 4096 --passes fwd bwd
    python scripts/tune_mma.py --head-dims 64 --passes fwd --configs 32,4,2 32,6,2
    python scripts/tune_mma.py --head-dims 128 --seqlen 16384 --causal --window 512
    python scripts/tune_mma.py --family hopper --head-dims 64 128 256 --passes fwd
    python scripts/tune_mma.py --family hopper --head-dims 64 --causal --passes bwd \
        --configs 64,64,3 64,128,3

TFLOP/s count the visible pairs only (a causal or windowed call's masked tiles are skipped).
"""
import argparse
import sys

import numpy as np

import harness
from bench_variants import visible_pairs

FORWARD = {  # head_dim -> [(block_n, warps, slices)]; slices 2: see MmaConfig
    64: [(64, 8, 1), (64, 4, 1), (32, 4, 2), (32, 8, 2), (128, 4, 2), (32, 6, 2)],
    128: [(32, 4, 1), (16, 4, 2), (32, 8, 1), (64, 8, 1), (16, 8, 2), (64, 6, 1), (32, 4, 2)],
}
HOPPER_FORWARD = {  # head_dim -> [(block_n, consumers, stages)]: see HopperConfig
    64: [(128, 3, 2), (128, 3, 3), (128, 2, 2), (128, 2, 3), (176, 2, 2), (192, 2, 2)],
    128: [(128, 2, 2), (128, 2, 3), (160, 2, 2), (176, 2, 2)],
    256: [(64, 2, 2), (80, 2, 2)],
}
#: head_dim -> [(block_m, block_n, stages)]: see HopperBackwardConfig (dK/dV streams query
#: tiles of block_m, dQ key tiles of block_n; each candidate compiled without spills for sm_90a
#: with causal and without when it was added: ptxas, scripts/ptx_check.py's cases)
HOPPER_BACKWARD = {
    64: [(64, 64, 3), (64, 128, 3), (64, 64, 4), (64, 128, 4)],
    128: [(64, 64, 3), (64, 64, 4), (64, 32, 4)],
}
BACKWARD = {  # head_dim -> [(block_m, block_n, warps, stages)]; stages 2: see MmaBackwardConfig
    64: [(16, 64, 4, 2), (32, 64, 4, 2), (16, 64, 8, 2), (16, 32, 8, 2), (32, 32, 8, 2),
         (64, 64, 4, 2)],
    128: [(16, 32, 4, 2), (32, 32, 4, 2), (16, 64, 4, 2), (32, 64, 4, 2), (16, 16, 8, 2)],
}


def candidates(table, head_dim, passes):
    """A table's candidates for head_dim, or none (said) where it has none."""
    if head_dim not in table:
        print(f"{passes} d{head_dim}: no candidate configs (give --configs)", flush=True)
    return table.get(head_dim, [])


def config_tuple(text):
    """'32,4,2' -> (32, 4, 2)"""
    return tuple(int(x) for x in text.split(","))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="mma", choices=["mma", "hopper"],
                        help="hopper: the wgmma kernels (float16; the backward on the copy "
                        "engine, grids as the engine lays them)")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--passes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--window", type=int, default=-1,
                        help="a sliding window of this many keys to the left (default: none)")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--configs", nargs="+", type=config_tuple, metavar="A,B,C[,D]",
                        help="time these configs instead of the tables' (one pass at a time)")
    args = parser.parse_args(argv)
    if args.configs:
        if len(args.passes) > 1:
            parser.error("--configs needs exactly one of --passes fwd / bwd")
        fields = 3 if args.passes == ["fwd"] or args.family == "hopper" else 4
        if any(len(config) != fields for config in args.configs):
            parser.error(f"--configs for {args.passes[0]} takes {fields} numbers each")
    reason = harness.gpu_ready()
    if reason:
        print(f"tune_mma.py needs a CUDA GPU and CuPy ({reason})")
        return 2
    import cupy as cp
    from numba import cuda

    from numba_flash.backends.numba.gpu import multiprocessors
    from numba_flash.backends.numba.hopper.bwd import launch_hopper_backward
    from numba_flash.backends.numba.hopper.config import HopperBackwardConfig, HopperConfig
    from numba_flash.backends.numba.hopper.fwd import launch_hopper_forward
    from numba_flash.backends.numba.hopper.tensor_maps import map_slots
    from numba_flash.backends.numba.mma.bwd import launch_mma_backward
    from numba_flash.backends.numba.mma.config import MmaBackwardConfig, MmaConfig
    from numba_flash.backends.numba.mma.fwd import launch_mma_forward
    from numba_flash.reference import attention_backward, attention_forward
    from numba_flash.spec import make_spec
    rng = np.random.default_rng(0)
    n, causal = args.seqlen, args.causal
    for head_dim in args.head_dims:
        batch, nheads = max(1, args.tokens // n), 2048 // head_dim
        q, k, v, dout = harness.random_inputs(cp, rng, batch, n, n, nheads, head_dim, "float16")
        window = (args.window, 0 if causal else -1)
        spec = make_spec(q, causal=causal, window_size=window)
        first = slice(0, 1)
        ref_out, ref_lse = attention_forward(cp, q[first], k[first], v[first], spec, "float64")
        work = 4.0 * batch * nheads * head_dim * visible_pairs(n, n, causal, window)
        bits = [cuda.as_cuda_array(x.view(cp.uint16), sync=False) for x in (q, k, v, dout)]
        tag = (f"d{head_dim} N{n} {'causal' if causal else 'full'}"
               f"{f' window {args.window}' if args.window >= 0 else ''}")
        if "fwd" in args.passes:
            hopper = args.family == "hopper"
            launch_forward, config_type, fields = (
                (launch_hopper_forward, HopperConfig, "(block_n, consumers, stages)") if hopper
                else (launch_mma_forward, MmaConfig, "(block_n, warps, slices)"))
            for shape in args.configs or candidates(HOPPER_FORWARD if hopper else FORWARD,
                                                    head_dim, "fwd"):
                out = cp.full(q.shape, cp.nan, q.dtype)
                lse = cp.empty((batch, nheads, n), cp.float32)
                views = bits[:3] + [cuda.as_cuda_array(x, sync=False)
                                    for x in (out.view(cp.uint16), lse)]

                maps = {"maps": map_slots(views[-1])} if hopper else {}  # (made once)

                def run():  # (what is timed: the config and maps are made before)
                    launch_forward(spec, *views, 0, config, **maps)
                try:
                    config = config_type(*shape)
                    run()
                except Exception as exc:
                    print(f"fwd {tag} {shape}: does not build ({type(exc).__name__}: "
                          f"{str(exc)[:100]})", flush=True)
                    continue
                error = float(cp.abs(out[first].astype(cp.float64) - ref_out).max())
                ms = harness.median_ms(run)
                print(f"fwd {tag} {args.family} {fields}={shape}: "
                      f"{work / ms / 1e9:6.1f} TFLOP/s  max error {error:.2e}", flush=True)
        if "bwd" in args.passes:
            hopper = args.family == "hopper"
            out = cp.empty(q.shape, q.dtype)
            lse = cp.empty((batch, nheads, n), cp.float32)
            views = bits[:3] + [cuda.as_cuda_array(x, sync=False)
                                for x in (out.view(cp.uint16), lse)]
            if hopper:
                launch_hopper_forward(spec, *views, 0, maps=map_slots(views[-1]))
            else:
                launch_mma_forward(spec, *views, 0)
            ref = attention_backward(cp, dout[first], q[first], k[first], v[first], out[first],
                                     lse[first], spec, "float64")
            launch_backward, config_type, fields = (
                (launch_hopper_backward,
                 lambda block_m, block_n, stages: HopperBackwardConfig(block_m, block_n,
                                                                       stages=stages),
                 "(block_m, block_n, stages)")
                if hopper else
                (launch_mma_backward, MmaBackwardConfig, "(block_m, block_n, warps, stages)"))
            for shape in args.configs or candidates(HOPPER_BACKWARD if hopper else BACKWARD,
                                                    head_dim, "bwd"):
                grads = [cp.full(x.shape, cp.nan, x.dtype) for x in (q, k, v)]
                delta = cp.empty_like(lse)
                gviews = [cuda.as_cuda_array(x, sync=False)
                          for x in [dout.view(cp.uint16), q.view(cp.uint16), k.view(cp.uint16),
                                    v.view(cp.uint16), out.view(cp.uint16), lse, delta]
                          + [g.view(cp.uint16) for g in grads]]
                # (the Hopper kernels' maps made once, the grids laid for this GPU)
                extra = {"maps": [map_slots(gviews[5]) for _ in range(2)],
                         "multiprocessors": multiprocessors(0)} if hopper else {}

                def run():
                    launch_backward(spec, *gviews, 0, config=config, **extra)
                try:
                    config = config_type(*shape)
                    run()
                except Exception as exc:
                    print(f"bwd {tag} {shape}: does not build ({type(exc).__name__}: "
                          f"{str(exc)[:100]})", flush=True)
                    continue
                error = max(float(cp.abs(g[first].astype(cp.float64) - r).max())
                            for g, r in zip(grads, ref))
                ms = harness.median_ms(run)
                print(f"bwd {tag} {args.family} {fields}={shape}: "
                      f"{2.5 * work / ms / 1e9:6.1f} TFLOP/s  max error {error:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
