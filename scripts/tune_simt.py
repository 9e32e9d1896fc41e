"""Time candidate tile configs of the SIMT forward kernel side by side on one GPU.

Each candidate (warps, rows per thread, keys per thread; numba_flash.config.SimtForwardConfig)
runs with cp.async loads and, with --plain-loads, also with plain ones. It is first checked
against float64 standard attention on the same inputs, then timed with CUDA events (median).
Used to order the candidates in numba_flash/config.py.

    python scripts/tune_simt.py --head-dims 64 128 --seqlen 4096
"""
import argparse
import sys

import numpy as np

import harness

CANDIDATES = {  # head_dim -> [(warps, rows_per_thread, keys_per_thread)]
    32: [(4, 8, 8), (2, 8, 8), (4, 4, 8), (2, 4, 8)],
    64: [(2, 8, 8), (4, 8, 8), (4, 4, 8), (2, 8, 4), (4, 8, 4), (4, 4, 4), (8, 4, 8),
         (2, 4, 4)],
    128: [(4, 4, 4), (2, 4, 8), (4, 4, 8), (8, 4, 4), (4, 2, 8), (4, 2, 4), (2, 2, 4)],
    256: [(2, 2, 4), (4, 2, 4), (2, 2, 8), (1, 2, 2)],
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--causal", action="store_true", help="time causal attention too")
    parser.add_argument("--plain-loads", action="store_true",
                        help="time float32 with plain loads too (as on GPUs before sm_80)")
    args = parser.parse_args(argv)
    reason = harness.gpu_ready()
    if reason:
        print(f"tune_simt.py needs a CUDA GPU and CuPy ({reason})")
        return 2
    import cupy as cp
    from numba import cuda

    from numba_flash.backends.numba_simt_fwd import launch_forward
    from numba_flash.config import SimtForwardConfig, simt_forward_shared_bytes
    from numba_flash.standard_attention import attention_forward
    limit = cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    rng = np.random.default_rng(0)
    for dtype in args.dtypes:
        for head_dim in args.head_dims:
            batch, nheads = max(1, args.tokens // args.seqlen), 2048 // head_dim
            q, k, v, _ = harness.random_inputs(cp, rng, batch, args.seqlen, args.seqlen, nheads,
                                               head_dim, dtype)
            sub = slice(0, 1)
            for causal in (False, True) if args.causal else (False,):
                ref, _ = attention_forward(cp, q[sub], k[sub], v[sub], causal,
                                           head_dim ** -0.5, "float64")
                work = 4.0 * batch * nheads * args.seqlen ** 2 * head_dim / (2 if causal else 1)
                loads = [True]
                if dtype != "float32":
                    loads = [False]
                elif args.plain_loads:
                    loads = [True, False]
                for shape in CANDIDATES[head_dim]:
                    config = SimtForwardConfig(*shape)
                    shared = simt_forward_shared_bytes(config, head_dim)
                    if shared > limit:
                        print(f"{dtype} d{head_dim} {shape}: needs {shared} bytes of shared "
                              f"memory, over this GPU's {limit}")
                        continue
                    for async_copy in loads:
                        out = cp.full(q.shape, cp.nan, q.dtype)
                        lse = cp.empty((batch, nheads, args.seqlen), cp.float32)

                        def run():
                            launch_forward(q, k, v, out, lse, causal, head_dim ** -0.5, 0,
                                           config, async_copy=async_copy)
                        run()
                        error = float(cp.abs(out[sub].astype(cp.float64) - ref).max())
                        ms = harness.median_ms(run)
                        print(f"{dtype} d{head_dim} N{args.seqlen} {'causal' if causal else 'full'}"
                              f" {shape} {'cp.async' if async_copy else 'plain'} "
                              f"{shared // 1024} KiB: {work / ms / 1e9:6.1f} TFLOP/s  "
                              f"max error {error:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
