"""Time candidate tile configs of the SIMT kernels side by side on one GPU.

Forward candidates (warps, rows per thread, keys per thread: SimtForwardConfig of
backends/numba/simt/config.py) and backward ones (SimtBackwardConfig) run with cp.async loads
and, with --plain-loads, also with plain ones. Each is first checked against float64 standard
attention on the same inputs, then timed with CUDA events (median). Used to order the
candidates in backends/numba/simt/config.py.

    python scripts/tune_simt.py --head-dims 64 128 --seqlen 4096 --passes fwd bwd
"""
import argparse
import sys

import numpy as np

import harness

CANDIDATES = {  # head_dim -> [(warps, rows_per_thread, keys_per_thread)]
    32: [(4, 8, 8), (2, 8, 8), (4, 4, 8), (2, 4, 8)],
    64: [(2, 8, 8), (4, 8, 8), (4, 4, 8), (2, 8, 4), (4, 8, 4), (4, 4, 4), (8, 4, 8),
         (2, 4, 4)],
    128: [(4, 4, 4), (2, 8, 4), (4, 8, 2), (2, 4, 8), (4, 4, 8), (8, 4, 4), (4, 2, 8),
          (4, 2, 4), (2, 2, 4)],
    256: [(2, 2, 4), (4, 2, 4), (2, 2, 8), (1, 2, 2)],
}
BACKWARD_CANDIDATES = {  # head_dim -> [(warps, key_rows, query_cols, query_rows, key_cols,
    #                                      stages)]
    64: [(4, 4, 4, 8, 4, 2), (4, 4, 4, 4, 4, 2), (4, 2, 4, 4, 4, 2), (2, 4, 4, 8, 4, 2),
         (2, 2, 4, 4, 4, 1)],
    128: [(4, 2, 4, 4, 4, 2), (4, 2, 4, 2, 4, 2), (2, 4, 4, 4, 4, 1), (1, 2, 2, 2, 2, 1)],
}


def _loads(dtype, plain_loads):
    if dtype != "float32":
        return [False]
    return [True, False] if plain_loads else [True]


def _report(what, shape, async_copy, shared, work, ms, error):
    print(f"{what} {shape} {'cp.async' if async_copy else 'plain'} {shared // 1024} KiB: "
          f"{work / ms / 1e9:6.1f} TFLOP/s  max error {error:.2e}", flush=True)


def tune_forward(cp, harness_inputs, head_dim, dtype, causal, args, limit):
    from numba_flash.backends.numba.simt.config import SimtForwardConfig, simt_forward_shared_bytes
    from numba_flash.backends.numba.simt.fwd import launch_forward
    from numba_flash.reference import attention_forward
    from numba_flash.spec import make_spec
    q, k, v, _ = harness_inputs
    batch, nheads, sub = q.shape[0], q.shape[2], slice(0, 1)
    spec = make_spec(q, causal=causal)
    ref, _ = attention_forward(cp, q[sub], k[sub], v[sub], spec, "float64")
    work = 4.0 * batch * nheads * args.seqlen ** 2 * head_dim / (2 if causal else 1)
    what = f"fwd {dtype} d{head_dim} N{args.seqlen} {'causal' if causal else 'full'}"
    for shape in CANDIDATES[head_dim]:
        config = SimtForwardConfig(*shape)
        shared = simt_forward_shared_bytes(config, head_dim)
        if shared > limit:
            print(f"{what} {shape}: needs {shared} bytes of shared memory, over {limit}")
            continue
        for async_copy in _loads(dtype, args.plain_loads):
            out = cp.full(q.shape, cp.nan, q.dtype)
            lse = cp.empty((batch, nheads, args.seqlen), cp.float32)

            def run():
                launch_forward(spec, q, k, v, out, lse, 0, config, async_copy=async_copy)
            run()
            error = float(cp.abs(out[sub].astype(cp.float64) - ref).max())
            _report(what, shape, async_copy, shared, work, harness.median_ms(run), error)


def tune_backward(cp, harness_inputs, head_dim, dtype, causal, args, limit):
    from numba_flash.backends.numba.simt.bwd import launch_backward
    from numba_flash.backends.numba.simt.config import (SimtBackwardConfig,
                                                        simt_backward_shared_bytes)
    from numba_flash.reference import attention_backward, attention_forward
    from numba_flash.spec import make_spec
    q, k, v, dout = harness_inputs
    batch, nheads, sub = q.shape[0], q.shape[2], slice(0, 1)
    spec = make_spec(q, causal=causal)
    out, lse = attention_forward(cp, q, k, v, spec, dtype)
    out, lse = cp.ascontiguousarray(out), cp.ascontiguousarray(lse.astype(cp.float32))
    ref_dq = attention_backward(cp, dout[sub], q[sub], k[sub], v[sub], out[sub], lse[sub],
                                spec, "float64")[0]
    work = 2.5 * 4.0 * batch * nheads * args.seqlen ** 2 * head_dim / (2 if causal else 1)
    what = f"bwd {dtype} d{head_dim} N{args.seqlen} {'causal' if causal else 'full'}"
    if head_dim not in BACKWARD_CANDIDATES:
        print(f"{what}: no backward candidates listed (BACKWARD_CANDIDATES)")
    for shape in BACKWARD_CANDIDATES.get(head_dim, ()):
        config = SimtBackwardConfig(*shape)
        shared = max(simt_backward_shared_bytes(config, head_dim))
        if shared > limit:
            print(f"{what} {shape}: needs {shared} bytes of shared memory, over {limit}")
            continue
        for async_copy in _loads(dtype, args.plain_loads):
            grads = [cp.full(x.shape, cp.nan, x.dtype) for x in (q, k, v)]
            delta = cp.empty(lse.shape, cp.float32)

            def run():
                launch_backward(spec, dout, q, k, v, out, lse, delta, *grads, 0,
                                async_copy=async_copy, config=config)
            run()
            error = float(cp.abs(grads[0][sub].astype(cp.float64) - ref_dq).max())
            _report(what, shape, async_copy, shared, work, harness.median_ms(run), error)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--passes", nargs="+", default=["fwd"], choices=["fwd", "bwd"])
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
    limit = cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    rng = np.random.default_rng(0)
    for dtype in args.dtypes:
        for head_dim in args.head_dims:
            batch, nheads = max(1, args.tokens // args.seqlen), 2048 // head_dim
            inputs = harness.random_inputs(cp, rng, batch, args.seqlen, args.seqlen, nheads,
                                           head_dim, dtype)
            for causal in (False, True) if args.causal else (False,):
                for passes in args.passes:
                    tune = tune_forward if passes == "fwd" else tune_backward
                    tune(cp, inputs, head_dim, dtype, causal, args, limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
