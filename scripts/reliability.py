"""GPU reliability checks for docs/RELIABILITY.md (run on a CUDA machine with CuPy and torch).

    python scripts/reliability.py sanitize   # every kernel at odd sizes (run it under
                                             #   compute-sanitizer --tool memcheck / racecheck)
    python scripts/reliability.py sanitize-variants  # the same for GQA, window, softcap, ALiBi,
                                                     #   varlen, attention masks, mask_mod
    python scripts/reliability.py sanitize-masks     # its masked calls alone
    python scripts/reliability.py sanitize-kvcache   # forward_kvcache's kernels (decode/)
    python scripts/reliability.py sanitize-hopper    # the Hopper (wgmma) kernels (sm_90)
    python scripts/reliability.py sanitize-hopper-dense     # its dense calls alone
    python scripts/reliability.py sanitize-hopper-variants  # its variant calls alone
    python scripts/reliability.py sanitize-hopper-stages    # their bfloat16 d64 calls alone
    python scripts/reliability.py repeat     # 1,000 forward+backward calls: memory must not grow
    python scripts/reliability.py long       # forward at N = 262,144 (B1 H8 D64, float16)
    python scripts/reliability.py jit        # first-call cost, cold and warm on-disk cache
Several modes may be given; each prints its findings and the script exits 1 on a failure.
"""
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

import harness

# (batch, seqlen_q, seqlen_k, heads, D); D 200 runs padded to 224, its backward split in two
SANITIZE_SHAPES = [(2, 65, 17, 1, 64), (1, 33, 70, 2, 128), (1, 40, 23, 1, 200)]


def _arrays(cp, torch, rng, shape, dtype):
    """q, k, v, dout of `shape` (batch, seqlen_q, seqlen_k, nheads, headdim) in dtype: CuPy
    arrays, or torch tensors for bfloat16."""
    values = harness.random_inputs(cp, rng, *shape, "float32" if dtype == "bfloat16" else dtype)
    if dtype == "bfloat16":
        return [torch.from_dlpack(x).to(torch.bfloat16) for x in values]
    return values


def sanitize(numba_flash, cp, torch):
    """Every kernel per odd shape, causal and not: SIMT (float32 with cp.async loads, float16
    and bfloat16 with plain ones), tensor cores (float16, bfloat16), the copy kernel
    (misaligned strided views, float16 and float32). Each call is made twice, so that the
    second runs as a replay (numba_flash/call_cache.py)."""
    rng = np.random.default_rng(0)
    calls = 0
    for shape in SANITIZE_SHAPES:
        for backend, dtype in (("numba-simt", "float32"), ("numba-simt", "float16"),
                               ("numba-simt", "bfloat16"), ("numba-mma", "float16"),
                               ("numba-mma", "bfloat16")):
            q, k, v, dout = _arrays(cp, torch, rng, shape, dtype)
            if numba_flash.select_backend(q, k, v, backend=backend).name is None:
                continue  # (a backend that cannot run this case on this GPU)
            for causal in (False, True):
                for _ in range(2):
                    out, lse = numba_flash.forward(q, k, v, causal=causal, backend=backend)
                    numba_flash.backward(dout, q, k, v, out, lse, causal=causal,
                                         backend=backend)
                    calls += 2
    for backend, dtype in (("numba-mma", cp.float16), ("numba-simt", cp.float32)):
        packed = cp.asarray(rng.standard_normal((1, 45, 2, 3, 65)), dtype)
        q, k, v = (packed[:, :, :, i, 1:] for i in range(3))  # rows off 16-byte alignment
        for _ in range(2):
            out, lse = numba_flash.forward(q, k, v, causal=True, backend=backend)
            numba_flash.backward(q, q, k, v, out, lse, causal=True, backend=backend)
            calls += 2
    cp.cuda.Device().synchronize()
    print(f"sanitize: {calls} calls done")
    return True


VARIANT_ENGINES = (("numba-simt", "float32"), ("numba-simt", "float16"),
                   ("numba-mma", "float16"), ("numba-mma", "bfloat16"))


def sanitize_variants(numba_flash, cp, torch, masks_only=False, engines=VARIANT_ENGINES,
                      head_dims=(64, 128)):
    """The variants' kernels at odd sizes, through each (backend, dtype) of `engines`: GQA
    with a window, softcap and ALiBi at once, varlen (sequences without queries or keys among
    them), and attention masks (a boolean key padding mask, a float mask per head broadcast
    over the batch; at d64 for float32 and bfloat16, a document mask_mod over a CuPy array,
    alone and through a block mask), each call twice (the second a replay); with masks_only,
    the masked calls alone."""
    rng = np.random.default_rng(1)
    lengths = [(37, 20), (0, 9), (70, 81), (5, 0)]
    cu_q, cu_k = (cp.asarray(np.concatenate([[0], np.cumsum(side)]), cp.int32)
                  for side in zip(*lengths))
    varlen = (cu_q, cu_k, *(max(side) for side in zip(*lengths)))
    calls = 0
    total_q, total_k = (int(cu[-1]) for cu in (cu_q, cu_k))
    for backend, dtype in engines:
        for head_dim in head_dims:
            q, k, v, dout = _arrays(cp, torch, rng, (2, 45, 61, 4, head_dim), dtype)
            packed = [x[0] for x in _arrays(cp, torch, rng, (1, total_q, total_k, 2, head_dim),
                                            dtype)]
            k, v = (x[:, :, :2].contiguous() if dtype == "bfloat16"  # (torch tensors)
                    else cp.ascontiguousarray(x[:, :, :2]) for x in (k, v))
            slopes = cp.asarray(rng.uniform(0.05, 0.5, (2, 4)), cp.float32)
            if dtype == "bfloat16":
                slopes = torch.from_dlpack(slopes)
            options = dict(causal=True, window_size=(19, -1), softcap=5.0, alibi_slopes=slopes)
            kept = cp.asarray([50, 61])  # keys per batch entry (the rest padding)
            padding = cp.arange(61)[None, None, None, :] < kept[:, None, None, None]
            bias = cp.asarray(rng.standard_normal((4, 45, 61)), cp.float32)
            if dtype == "bfloat16":
                padding, bias = torch.from_dlpack(padding), torch.from_dlpack(bias)
            elif dtype == "float16":
                bias = bias.astype(cp.float16)
            documents = cp.asarray(np.arange(61) // 17, cp.int32)  # (keys 0-16, 17-33, ...)

            def same_document(b, h, q_idx, kv_idx):
                return documents[q_idx + 16] == documents[kv_idx] and kv_idx <= q_idx + 16 + b

            masks = [dict(attn_mask=padding, causal=True), dict(attn_mask=bias, softcap=5.0)]
            if head_dim == 64 and dtype in ("float32", "bfloat16"):  # (one spec per family:
                # a mask_mod's kernels are compiled per process, never cached on disk)
                masks += [dict(mask_mod=same_document, softcap=5.0),
                          dict(block_mask=numba_flash.block_mask(same_document, 2, None, 45, 61),
                               causal=True)]
            for _ in range(2):
                for mask in masks:
                    out, lse = numba_flash.forward(q, k, v, backend=backend, **mask)
                    numba_flash.backward(dout, q, k, v, out, lse, backend=backend, **mask)
                    calls += 2
                if masks_only:
                    continue
                out, lse = numba_flash.forward(q, k, v, backend=backend, **options)
                numba_flash.backward(dout, q, k, v, out, lse, backend=backend, **options)
                out, lse = numba_flash.forward_varlen(*packed[:3], *varlen, causal=True,
                                                      backend=backend)
                numba_flash.backward_varlen(packed[3], *packed[:3], out, lse, *varlen,
                                            causal=True, backend=backend)
                calls += 4
    cp.cuda.Device().synchronize()
    print(f"sanitize-variants: {calls} calls done")
    return True


def sanitize_masks(numba_flash, cp, torch):
    """sanitize-variants' masked calls alone."""
    return sanitize_variants(numba_flash, cp, torch, masks_only=True)


def _on_hopper(mode):
    """Whether the GPU is sm_90 (the Hopper kernels'); says so when it is not."""
    from numba import cuda
    if tuple(cuda.get_current_device().compute_capability) == (9, 0):
        return True
    print(f"{mode}: not an sm_90 GPU, nothing run")
    return False


def sanitize_hopper(numba_flash, cp, torch):
    """sanitize-hopper-dense, then sanitize-variants' calls through the Hopper kernels (GQA
    with a window, softcap and ALiBi, varlen, attention masks, mask_mods). Skipped on GPUs
    other than sm_90."""
    return (sanitize_hopper_dense(numba_flash, cp, torch)
            and sanitize_hopper_variants(numba_flash, cp, torch))


def sanitize_hopper_dense(numba_flash, cp, torch):
    """The Hopper kernels (numba-hopper: the wgmma forward, and backward up to D 128) at
    SANITIZE_SHAPES (D 200 runs padded to 256, its backward on the tensor cores), float16
    and bfloat16, causal and not, each call twice (the second a replay)."""
    if not _on_hopper("sanitize-hopper-dense"):
        return True
    rng = np.random.default_rng(4)
    calls = 0
    for dtype in ("float16", "bfloat16"):
        for shape in SANITIZE_SHAPES:
            q, k, v, dout = _arrays(cp, torch, rng, shape, dtype)
            for causal in (False, True):
                for _ in range(2):
                    out, lse = numba_flash.forward(q, k, v, causal=causal, backend="numba-hopper")
                    numba_flash.backward(dout, q, k, v, out, lse, causal=causal,
                                         backend="numba-hopper")
                    calls += 2
    cp.cuda.Device().synchronize()
    print(f"sanitize-hopper-dense: {calls} calls done")
    return True


HOPPER_ENGINES = (("numba-hopper", "float16"), ("numba-hopper", "bfloat16"))


def sanitize_hopper_variants(numba_flash, cp, torch):
    """sanitize-variants' calls through the Hopper kernels alone (the second half of
    sanitize-hopper)."""
    if not _on_hopper("sanitize-hopper-variants"):
        return True
    return sanitize_variants(numba_flash, cp, torch, engines=HOPPER_ENGINES)


def sanitize_hopper_stages(numba_flash, cp, torch):
    """sanitize-hopper-variants' bfloat16 calls at d64 alone, where the dK/dV kernel reuses
    its pipeline stages (GQA: several query tiles per key tile): racecheck's short run for
    how the consumers free a stage (docs/RELIABILITY.md)."""
    if not _on_hopper("sanitize-hopper-stages"):
        return True
    return sanitize_variants(numba_flash, cp, torch, engines=(("numba-hopper", "bfloat16"),),
                             head_dims=(64,))


def sanitize_kvcache(numba_flash, cp, torch):
    """forward_kvcache at odd sizes: head dim 72 (the SIMT kernel) and, for 16-bit dtypes,
    80 through numba-mma (the tensor-core kernel), contiguous and paged (block size 16, the
    last block of a sequence partly used), empty and nearly full caches, three new tokens
    appended with causal, GQA 4, splits 1 and 3, every dtype."""
    rng = np.random.default_rng(3)

    def draw(*shape):
        x = cp.asarray(rng.standard_normal(shape).astype(np.float32))
        return torch.from_dlpack(x).to(torch.bfloat16) if dtype == "bfloat16" else \
            x.astype(dtype)
    calls = 0
    runs = [(dtype, "numba", 72) for dtype in ("float32", "float16", "bfloat16")]
    runs += [(dtype, "numba-mma", 80) for dtype in ("float16", "bfloat16")]
    for dtype, backend, dim in runs:
        for paged in (False, True):
            pages, rows = (12, 16) if paged else (3, 64)
            q, k_new, v_new = draw(3, 3, 8, dim), draw(3, 3, 2, dim), draw(3, 3, 2, dim)
            k_cache, v_cache = draw(pages, rows, 2, dim), draw(pages, rows, 2, dim)
            table = (cp.asarray(rng.permutation(12).reshape(3, 4).astype(np.int32))
                     if paged else None)
            lengths = cp.asarray(np.array([0, 30, 61], np.int32))
            for splits in (1, 3):
                numba_flash.forward_kvcache(q, k_cache, v_cache, k=k_new, v=v_new,
                                            cache_seqlens=lengths, block_table=table,
                                            causal=True, num_splits=splits, backend=backend)
                calls += 1
    cp.cuda.Device().synchronize()
    print(f"sanitize-kvcache: {calls} calls done")
    return True


def device_memory_used(cp):
    cp.cuda.Device().synchronize()
    free, total = cp.cuda.runtime.memGetInfo()
    return total - free


def repeat(numba_flash, cp, torch, calls=1000):
    """1,000 forward+backward calls per engine; device memory in use after call 10 and after
    the last must be the same (CuPy's pool caches blocks, so a leak would show as growth)."""
    rng = np.random.default_rng(1)
    ok = True
    for backend, dtype in (("numba", "float16"), ("numba", "float32"), ("numba", "bfloat16")):
        q, k, v, dout = _arrays(cp, torch, rng, (2, 500, 500, 4, 64), dtype)
        pool = cp.get_default_memory_pool()
        for i in range(calls):
            out, lse = numba_flash.forward(q, k, v, causal=True, backend=backend)
            grads = numba_flash.backward(dout, q, k, v, out, lse, causal=True, backend=backend)
            if i == 9:
                used_10, pool_10 = device_memory_used(cp), pool.used_bytes()
        del out, lse, grads
        used, pool_used = device_memory_used(cp), pool.used_bytes()
        grew = used - used_10
        ok &= grew <= 0
        print(f"repeat {dtype}: device memory in use after call 10 {used_10 / 2**20:.1f} MiB, "
              f"after call {calls} {used / 2**20:.1f} MiB (growth {grew / 2**20:+.1f} MiB); "
              f"CuPy pool in use {pool_10 / 2**20:.1f} -> {pool_used / 2**20:.1f} MiB")
    return ok


def long(numba_flash, cp, torch):
    """Forward at N = 262,144 through verify.py's long-sequence check (sampled rows against
    float64), with its peak extra memory against the O(N^2) bytes of standard attention."""
    import verify
    table = verify.Table()
    rng = np.random.default_rng(2)
    shape = (1, 262144, 262144, 8, 64)
    for causal in (False, True):
        verify.verify_long(table, numba_flash, cp, rng, causal, shape)
    batch, seqlen_q, seqlen_k, nheads, _ = shape
    scores = batch * nheads * seqlen_q * seqlen_k
    print(f"long: standard attention would hold B*H*Nq*Nk = {scores:.3g} scores: "
          f"{scores * 4 / 2**40:.1f} TiB in float32")
    return table.failures == 0


FIRST_CALL = """
import time, sys
start = time.perf_counter()
import cupy as cp, numba_flash
q, k, v = (cp.asarray(cp.random.standard_normal((1, 256, 4, 64)), dtype=DTYPE) for _ in range(3))
imported = time.perf_counter()
out, lse = numba_flash.forward(q, k, v, causal=True)
numba_flash.backward(q, q, k, v, out, lse, causal=True)
cp.cuda.Device().synchronize()
print(f"{imported - start:.2f} {time.perf_counter() - imported:.2f}")
"""


def jit(numba_flash, cp, torch):
    """First forward+backward call in a fresh process: with an empty on-disk cache, then with
    the cache the first process wrote (NUMBA_CACHE_DIR)."""
    with tempfile.TemporaryDirectory() as cache_dir:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
        for dtype in ("cp.float16", "cp.float32"):
            times = []
            for label in ("cold cache", "warm cache"):
                result = subprocess.run([sys.executable, "-c", FIRST_CALL.replace("DTYPE", dtype)],
                                        env=env, capture_output=True, text=True, check=False)
                if result.returncode:
                    print(result.stderr[-2000:])
                    return False
                import_s, call_s = (float(x) for x in result.stdout.split()[-2:])
                times.append(call_s)
                print(f"jit {dtype[3:]}: {label}: import {import_s:.2f} s, first forward+backward "
                      f"{call_s:.2f} s")
            files = sum(len(f) for _, _, f in os.walk(cache_dir))
            print(f"jit {dtype[3:]}: the warm cache saved {times[0] - times[1]:.2f} s "
                  f"({files} files in the cache)")
    return True


MODES = {"sanitize": sanitize, "sanitize-variants": sanitize_variants,
         "sanitize-masks": sanitize_masks, "sanitize-kvcache": sanitize_kvcache,
         "sanitize-hopper": sanitize_hopper, "sanitize-hopper-dense": sanitize_hopper_dense,
         "sanitize-hopper-variants": sanitize_hopper_variants,
         "sanitize-hopper-stages": sanitize_hopper_stages,
         "repeat": repeat, "long": long, "jit": jit}


def main(argv=None):
    modes = (argv if argv is not None else sys.argv[1:]) or list(MODES)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        print(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
        return 2
    reason = harness.gpu_ready()
    if reason:
        print(f"reliability.py needs a CUDA GPU and CuPy ({reason})")
        return 2
    import cupy as cp
    import torch

    import numba_flash
    ok = True
    for mode in modes:
        start = time.perf_counter()
        ok &= bool(MODES[mode](numba_flash, cp, torch))
        print(f"{mode}: {time.perf_counter() - start:.1f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
