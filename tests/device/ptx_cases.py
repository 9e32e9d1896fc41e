"""Compile a kernel module's PTX_CASES for given targets, in a process without the simulator
(the tests themselves run under it): the PTX tests of the intrinsics use it."""
import json
import os
import subprocess
import sys

_CODE = (
    "import json, os, sys\n"
    "sys.path.insert(0, os.environ['KERNELS_DIR'])\n"
    "from numba import cuda\n"
    "import importlib\n"
    "k = importlib.import_module(os.environ['KERNELS_MODULE'])\n"
    "out = []\n"
    "for cc in json.loads(os.environ['TARGETS']):\n"
    "    for fn, sig, wanted in k.PTX_CASES:\n"
    "        ptx, _ = cuda.compile_ptx(fn, sig, cc=tuple(cc))\n"
    "        target = [line for line in ptx.splitlines() if line.startswith('.target')]\n"
    "        out.append([fn.__name__, cc, [w for w in wanted if w not in ptx],\n"
    "                    '__local_depot' in ptx, target[0] if target else ''])\n"
    "print(json.dumps(out))\n")


def compile_cases(module, targets):
    """[(kernel name, target, the wanted instructions its PTX lacks, whether it uses local
    memory, its .target line)] for each of module.PTX_CASES and each target (a cc tuple,
    e.g. (9, 0, "a"))."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", KERNELS_MODULE=module.__name__,
               KERNELS_DIR=os.path.dirname(os.path.abspath(module.__file__)),
               TARGETS=json.dumps([list(t) for t in targets]))
    run = subprocess.run([sys.executable, "-c", _CODE], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(results) == len(targets) * len(module.PTX_CASES)
    return results
