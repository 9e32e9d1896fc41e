"""Numba's on-disk cache can serve every kernel to a new process: the cache key of a kernel
includes a hash of its pickled closure, which must come out the same in two processes."""
import os
import subprocess
import sys

HASH_CLOSURES = """
import hashlib
from numba.cuda.serialize import dumps
from numba_flash.backends import numba_copy, numba_mma_bwd, numba_mma_fwd, numba_simt_bwd, \\
    numba_simt_fwd
from numba_flash.config import simt_backward_config, simt_forward_config

def closure_hash(fn):
    cells = tuple(c.cell_contents for c in fn.__closure__ or ())
    return hashlib.sha256(dumps(cells)).hexdigest()[:16]

kernels = [numba_simt_fwd.forward_kernel_function(simt_forward_config(64), 64, True, False, True),
           *numba_simt_bwd.backward_kernel_functions(simt_backward_config(64), 64, True),
           numba_mma_fwd.mma_forward_kernel_function(64, 4, 64, True, True),
           numba_mma_bwd.mma_delta_kernel_function(64, True),
           numba_mma_bwd.mma_dk_dv_kernel_function(32, 4, 64, True, False),
           numba_mma_bwd.mma_dq_kernel_function(32, 4, 64, True, False),
           numba_copy._copy_padded_kernel.py_func]
print(" ".join(closure_hash(fn) for fn in kernels))
"""


def _hashes():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    run = subprocess.run([sys.executable, "-c", HASH_CLOSURES], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.split()


def test_kernel_cache_keys_are_the_same_in_every_process():
    first, second = _hashes(), _hashes()
    assert len(first) == 9
    assert first == second
