"""Start-up time a user feels: the first forward and backward of a fresh process.

Each measurement runs in a new Python process (so nothing is imported or compiled yet), with
Numba's on-disk kernel cache in --cache-dir: the first run fills it ("cold"), later runs
find it ("warm"). Printed per run, in seconds, in the order a user meets them: importing
torch, torch's first CUDA call, importing numba_flash, importing Numba's CUDA target, choosing
the backend (Numba's view of the GPU), the first forward (fp16 d128 causal, torch tensors:
kernel look-up in the cache, module load, launch) and the first backward; with --profile,
where the last warm run's first forward goes (cProfile, cumulative, the top entries).

    python scripts/startup.py [--runs 3] [--profile] [--cache-dir DIR]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import harness

CHILD = r"""
import json, sys, time
stamps = {}
def mark(name, start):
    stamps[name] = round(time.perf_counter() - start, 3)
t = time.perf_counter()
import torch
mark("import torch", t)
t = time.perf_counter()
q, k, v = (torch.randn(2, 2048, 16, 128, device="cuda", dtype=torch.float16) for _ in range(3))
torch.cuda.synchronize()
mark("torch first CUDA call", t)
t = time.perf_counter()
import numba_flash
mark("import numba_flash", t)
t = time.perf_counter()
import numba.cuda
mark("import numba.cuda", t)
t = time.perf_counter()
numba_flash.select_backend(q, k, v, causal=True)
mark("backend choice", t)
profile = sys.argv[1] == "1"
if profile:
    import cProfile, io, pstats
    profiler = cProfile.Profile()
    profiler.enable()
t = time.perf_counter()
out, lse = numba_flash.forward(q, k, v, causal=True)
torch.cuda.synchronize()
mark("first forward", t)
if profile:
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
    stamps["profile"] = text.getvalue()
t = time.perf_counter()
grads = numba_flash.backward(torch.ones_like(out), q, k, v, out, lse, causal=True)
torch.cuda.synchronize()
mark("first backward", t)
t = time.perf_counter()
numba_flash.forward(q, k, v, causal=True)
torch.cuda.synchronize()
mark("second forward", t)
print("STAMPS" + json.dumps(stamps))
"""


def run_child(cache_dir, profile):
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    run = subprocess.run([sys.executable, "-c", CHILD, "1" if profile else "0"], env=env,
                         capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        raise RuntimeError(run.stderr[-3000:])
    line = next(x for x in run.stdout.splitlines() if x.startswith("STAMPS"))
    return json.loads(line[len("STAMPS"):])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="warm runs after the cold one")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="numba_flash_cache_")
    results = []
    for run in range(1 + args.runs):
        label = "cold" if run == 0 else "warm"
        stamps = run_child(cache_dir, args.profile and run == args.runs)
        profile = stamps.pop("profile", None)
        results.append({"cache": label, **stamps})
        print(label, "  ".join(f"{name}: {value:.3f} s" for name, value in stamps.items()),
              flush=True)
        if profile:
            print(profile)
    harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
