"""Time candidate tile configs of the SIMT forward kernel side by side on one GPU.

Each candidate is first checked against float64 standard attention on the same inputs, then
timed with CUDA events (median). Used to choose the entries of numba_flash/config.py.

    python scripts/tune_simt.py --head-dims 64 128 --seqlen 4096
"""
import argparse
import sys

import numpy as np

import harness

CANDIDATES = {  # head_dim -> [(block_m, block_n, threads_x, threads_y)]
    32: [(64, 64, 8, 16), (64, 32, 8, 16), (32, 32, 8, 8)],
    64: [(64, 32, 8, 16), (32, 32, 8, 8), (48, 48, 8, 16), (64, 32, 4, 16), (32, 32, 4, 16)],
    128: [(32, 32, 16, 8), (32, 32, 8, 16), (32, 32, 8, 8), (16, 32, 8, 8), (32, 16, 8, 8)],
    256: [(16, 16, 16, 8), (16, 16, 8, 8), (16, 16, 8, 4)],
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16"])
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args(argv)
    reason = harness.gpu_ready()
    if reason:
        print(f"tune_simt.py needs a CUDA GPU and CuPy ({reason})")
        return 2
    import cupy as cp
    from numba import cuda

    from numba_flash.backends.numba_simt_fwd import launch_forward
    from numba_flash.config import SHARED_MEMORY_BYTES, SimtConfig, forward_shared_bytes
    from numba_flash.standard_attention import attention_forward
    rng = np.random.default_rng(0)
    for dtype in args.dtypes:
        for head_dim in args.head_dims:
            batch, nheads = max(1, args.tokens // args.seqlen), 2048 // head_dim
            q, k, v, _ = harness.random_inputs(cp, rng, batch, args.seqlen, args.seqlen, nheads,
                                               head_dim, dtype)
            sub = slice(0, 1)
            ref, _ = attention_forward(cp, q[sub], k[sub], v[sub], False, head_dim ** -0.5,
                                       "float64")
            work = 4.0 * batch * nheads * args.seqlen ** 2 * head_dim
            for shape in CANDIDATES[head_dim]:
                config = SimtConfig(*shape)
                if forward_shared_bytes(config, head_dim) > SHARED_MEMORY_BYTES:
                    print(f"{dtype} d{head_dim} {shape}: needs too much shared memory")
                    continue
                out = cp.full(q.shape, cp.nan, q.dtype)
                lse = cp.empty((batch, nheads, args.seqlen), cp.float32)
                views = [cuda.as_cuda_array(x, sync=False) for x in (q, k, v, out, lse)]

                def run():
                    launch_forward(*views, False, head_dim ** -0.5, 0, config)
                run()
                error = float(cp.abs(out[sub].astype(cp.float64) - ref).max())
                ms = harness.median_ms(run)
                print(f"{dtype} d{head_dim} N{args.seqlen} {shape}: {work / ms / 1e9:6.1f} "
                      f"TFLOP/s  max error {error:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
