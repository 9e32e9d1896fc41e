"""Numba's on-disk cache can serve every kernel to a new process: the cache key of a kernel
includes a hash of its pickled closure, which must come out the same in every process, and
the same before and after the device functions and intrinsics it reaches have been compiled
(Numba looks a kernel up before it compiles it and saves it after)."""
import os
import subprocess
import sys

HASH_CLOSURES = """
import hashlib, sys
from numba import cuda
from numba.cuda.serialize import dumps
from numba_flash.backends.numba import marshal
from numba_flash.backends.numba.device import delta
from numba_flash.backends.numba.mma import bwd as mma_bwd, fwd as mma_fwd
from numba_flash.backends.numba.mma.config import MmaBackwardConfig, MmaConfig
from numba_flash.backends.numba.simt import bwd as simt_bwd, fwd as simt_fwd
from numba_flash.backends.numba.simt.config import (SimtBackwardConfig, simt_backward_config,
                                                    simt_forward_config)
from numba_flash.spec import AttentionSpec

f32, f16, bf16 = (AttentionSpec(64, d, causal=True) for d in ("float32", "float16", "bfloat16"))
kernels = [simt_fwd.forward_kernel_function(simt_forward_config(64), f32, True),
           *simt_bwd.backward_kernel_functions(simt_backward_config(64), f32),
           mma_fwd.mma_forward_kernel_function(MmaConfig(64, 4, 1), bf16),
           mma_fwd.mma_forward_kernel_function(MmaConfig(64, 4, 1), AttentionSpec(
               64, "float16", softcap=5.0, alibi=True, varlen=True, group=2)),
           delta.delta_kernel_function(64, "bf16"),
           mma_bwd.mma_dk_dv_kernel_function(MmaBackwardConfig(32, 32, 4), f16),
           mma_bwd.mma_dq_kernel_function(MmaBackwardConfig(32, 32, 4), f16),
           marshal._copy_padded_kernel.py_func]

def closure_hash(fn):
    cells = tuple(c.cell_contents for c in fn.__closure__ or ())
    return hashlib.sha256(dumps(cells)).hexdigest()[:16]

print(" ".join(closure_hash(fn) for fn in kernels))
if sys.argv[1] == "compile":  # small kernels of each family reach every device function kind
    u4, f3 = "uint16[:, :, :, :]", "float32[:, :, :]"
    unused = f"{f', {f3}' * 6}, Tuple(())"  # (alibi_slopes, cu_seqlens_q, cu_seqlens_k,
    #               attn_mask, tile_classes, tile_spans: lse's type; no mask_mod arrays)
    small = AttentionSpec(16, "float16", causal=True)
    cuda.compile_ptx(mma_fwd.mma_forward_kernel_function(MmaConfig(16, 1), small),
                     f"({u4}, {u4}, {u4}, {u4}, {f3}, float32{unused})", cc=(8, 0))
    cuda.compile_ptx(mma_bwd.mma_dq_kernel_function(MmaBackwardConfig(16, 16, 1), small),
                     f"({u4}, {u4}, {u4}, {u4}, {f3}, {f3}, {u4}, float32, float32{unused})",
                     cc=(8, 0))
    a4 = "float32[:, :, :, :]"
    simt = AttentionSpec(16, "float32", causal=True)
    cuda.compile_ptx(simt_bwd.backward_kernel_functions(SimtBackwardConfig(1, 1, 2, 1, 2),
                                                        simt, True)[1],
                     f"({a4}, {a4}, {a4}, {a4}, {f3}, {f3}, {a4}, float32, float32{unused})",
                     cc=(8, 0))
    print(" ".join(closure_hash(fn) for fn in kernels))
"""


def _hashes(*args):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    run = subprocess.run([sys.executable, "-c", HASH_CLOSURES, *args], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return [line.split() for line in run.stdout.splitlines()]


def test_kernel_cache_keys_are_the_same_in_every_process_and_after_compiling():
    (first,), (second, after_compiling) = _hashes("hash"), _hashes("compile")
    assert len(first) == 9
    assert first == second
    assert after_compiling == first
