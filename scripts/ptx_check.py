"""Compile every Numba kernel to PTX for given GPU architectures, without needing a GPU.

Uses libNVVM from pip (numba-cuda[cu13]). For each kernel it reports whether the PTX declares
local memory (`__local_depot`: a register array that spilled to memory) and counts the key
instructions. Prints one JSON object per kernel; exits 1 if any kernel uses local memory.

    python scripts/ptx_check.py --cc 80 90
"""
import argparse
import json
import os
import sys

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # compile for real, never in the simulator

from numba import cuda  # noqa: E402

from numba_flash.backends.numba_simt_bwd import backward_kernel_functions  # noqa: E402
from numba_flash.backends.numba_simt_fwd import forward_kernel_function  # noqa: E402
from numba_flash.config import simt_backward_config, simt_forward_config  # noqa: E402

COUNTED = ("fma.rn.f32", "ld.shared", "ld.shared.v4.f32", "st.shared", "ex2.approx", "bar.sync")


def kernel_cases(head_dims, dtypes):
    """(name, python function, signature) for every kernel of every (head_dim, causal, dtype)."""
    for dtype in dtypes:
        a4 = f"{dtype}[:, :, :, :]"
        f3 = "float32[:, :, :]"
        for head_dim in head_dims:
            for causal in (False, True):
                tag = f"d{head_dim}_{'causal' if causal else 'full'}_{dtype}"
                fwd = forward_kernel_function(simt_forward_config(head_dim), head_dim, causal)
                yield f"forward_{tag}", fwd, f"({a4}, {a4}, {a4}, {a4}, {f3}, float32)"
                delta, dk_dv, dq = backward_kernel_functions(
                    simt_backward_config(head_dim), head_dim, causal)
                if not causal:  # the delta kernel does not depend on causal
                    yield f"bwd_delta_{tag}", delta, f"({a4}, {a4}, {f3})"
                yield (f"bwd_dk_dv_{tag}", dk_dv,
                       f"({a4}, {a4}, {a4}, {a4}, {f3}, {f3}, {a4}, {a4}, float32, float32)")
                yield (f"bwd_dq_{tag}", dq,
                       f"({a4}, {a4}, {a4}, {a4}, {f3}, {f3}, {a4}, float32, float32)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", nargs="+", type=int, default=[80, 90],
                        help="compute capabilities as two digits (default: 80 90)")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[32, 64, 128, 256])
    parser.add_argument("--dtypes", nargs="+", default=["float16", "float32"])
    parser.add_argument("--save", metavar="DIR", help="also write each kernel's PTX here")
    args = parser.parse_args(argv)
    spilled = 0
    for cc in args.cc:
        for name, function, signature in kernel_cases(args.head_dims, args.dtypes):
            ptx, _ = cuda.compile_ptx(function, signature, cc=divmod(cc, 10))
            report = {"kernel": name, "cc": cc, "local_memory": "__local_depot" in ptx}
            report.update({op: ptx.count(op) for op in COUNTED})
            spilled += report["local_memory"]
            print(json.dumps(report), flush=True)
            if args.save:
                os.makedirs(args.save, exist_ok=True)
                with open(os.path.join(args.save, f"{name}_sm{cc}.ptx"), "w") as f:
                    f.write(ptx)
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())
