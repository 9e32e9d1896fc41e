"""Cross-check every available backend against float64 standard attention.

On a machine with a CUDA GPU and CuPy: every backend x {float32, float16, bfloat16} x {causal,
full} x a grid of shapes up to N = 4096, forward and backward; the variants (GQA, windows,
softcap, their combinations) at a few shapes each; then the numba forward at N = 65536,
checked on sampled rows, where the cupy backend is skipped for memory. bfloat16
arrays are torch tensors (it is skipped, saying so, without torch). A backend that would run
the same kernels as one already checked for a case is skipped with that reason.
Without a GPU: the kernels run in Numba's CUDA simulator at small sizes (it says so); the
tensor-core kernels only at the first shape, being slow there.

Rule: max |backend - reference| <= 2 x max |plain - reference| + floor, where the
reference is computed in float64 and "plain" is standard attention in the input precision
(the cupy backend on the GPU, NumPy in that dtype on the CPU; for bfloat16, which neither
has, numba_flash.testing's float32 emulation of a 16-bit implementation). Prints a table;
exits 1 on any failure.

    python scripts/verify.py [--simulator] [--quick]
"""
import argparse
import importlib.util
import sys
import time

import numpy as np

import harness
from verify_kvcache import verify_kvcache
from numba_flash.testing import error_bound, max_error

GPU_SHAPES = [  # (batch, seqlen_q, seqlen_k, nheads, headdim)
    (2, 128, 128, 4, 64),
    (1, 1000, 1000, 4, 64),
    (1, 511, 1537, 3, 32),
    (1, 1537, 511, 3, 96),
    (1, 333, 333, 2, 16),
    (1, 2048, 2048, 2, 256),
    (1, 4096, 4096, 2, 64),
    (1, 4096, 4096, 2, 128),
]
SIM_SHAPES = [(1, 17, 17, 1, 16), (1, 37, 20, 2, 64), (1, 20, 37, 1, 32)]
# (shape, nheads of k and v, causal, options): GQA / MQA, sliding windows (narrower than a tile
# and with both sides), softcap, and combinations
GPU_VARIANTS = [
    ((1, 1000, 1000, 8, 64), 2, True, {}),
    ((1, 777, 1537, 8, 128), 1, False, {}),
    ((1, 2048, 2048, 4, 64), 2, True, dict(window_size=(256, 0))),
    ((1, 1500, 1300, 2, 128), 2, False, dict(window_size=(40, 7))),
    ((1, 1024, 1024, 4, 128), 4, True, dict(softcap=30.0)),
    ((1, 1200, 1200, 4, 96), 2, False, dict(softcap=5.0, window_size=(100, 100))),
    ((2, 1000, 1300, 4, 128), 2, True, dict(alibi=True)),
    ((1, 1100, 900, 4, 64), 4, False, dict(alibi=True, softcap=20.0, window_size=(300, 50))),
    ((2, 1000, 1200, 4, 128), 2, False, dict(mask="padding")),
    ((2, 900, 900, 4, 64), 4, True, dict(mask="float", softcap=20.0)),
    ((2, 1100, 1000, 4, 128), 2, True, dict(mask_mod="document")),
]
SIM_VARIANTS = [
    ((1, 30, 37, 4, 32), 2, True, dict(softcap=2.0)),
    ((1, 40, 29, 2, 16), 1, False, dict(window_size=(5, 2))),
    ((2, 21, 26, 2, 16), 1, True, dict(alibi=True)),
    ((2, 19, 23, 2, 16), 1, False, dict(mask="padding")),
    ((1, 22, 22, 2, 16), 2, True, dict(mask="float")),
    ((1, 33, 40, 2, 16), 1, True, dict(mask_mod="document")),
]
LONG = (1, 65536, 65536, 8, 64)  # forward only: the cupy backend would need O(N^2) memory


class Table:
    def __init__(self):
        self.rows = []

    def add(self, backend, case, quantity, error, limit, note=""):
        ok = error <= limit
        self.rows.append((backend, case, quantity, error, limit, "PASS" if ok else "FAIL", note))
        print(f"{backend:10s} {case:42s} {quantity:4s} {error:10.3g} {limit:10.3g} "
              f"{'PASS' if ok else 'FAIL'} {note}", flush=True)
        return ok

    def skip(self, backend, case, reason):
        self.rows.append((backend, case, "-", float("nan"), float("nan"), "SKIP", reason))
        print(f"{backend:10s} {case:42s} SKIP: {reason}", flush=True)

    @property
    def failures(self):
        return sum(row[5] == "FAIL" for row in self.rows)


def to_host(x):
    """NumPy copy of a CuPy array or torch tensor (bfloat16 as float32), or x itself."""
    if type(x).__module__.startswith("torch"):
        return x.detach().float().cpu().numpy()
    return x.get() if hasattr(x, "get") else np.asarray(x)


class Inputs:
    """One case's arrays: `values` (xp arrays the references compute from) and what the
    backends get: the same arrays, or for bfloat16 (which NumPy and CuPy lack) torch tensors
    holding the same values, on the GPU or, for the host backends, on the CPU."""

    def __init__(self, xp, values, dtype, on_gpu):
        self.xp, self.values, self.dtype, self.on_gpu = xp, values, dtype, on_gpu

    def for_backend(self, x, host):
        if self.dtype != "bfloat16":
            return to_host(x) if host else x
        import torch
        tensor = torch.from_numpy(to_host(x)) if host or not self.on_gpu else torch.from_dlpack(x)
        return tensor.to(torch.bfloat16)

    def beside_for_backend(self, x, host):
        """An array beside the inputs (ALiBi slopes, a mask) as it is, or torch for bfloat16
        cases; a float mask of a bfloat16 case in bfloat16."""
        if self.dtype != "bfloat16":
            return to_host(x) if host else x
        import torch
        return torch.from_numpy(to_host(x)) if host or not self.on_gpu else torch.from_dlpack(x)


def _variant_name(nheads, kv_heads, options):
    words = [f"Hkv{kv_heads}"] if kv_heads != nheads else []
    if options.get("window_size"):
        words.append("win{}:{}".format(*options["window_size"]))
    if options.get("softcap"):
        words.append(f"cap{options['softcap']:g}")
    if options.get("alibi"):
        words.append("alibi")
    if options.get("mask"):
        words.append(f"mask:{options['mask']}")
    if options.get("mask_mod"):
        words.append(f"mask_mod:{options['mask_mod']}")
    return " ".join(words)


def _mask_mod(xp, rng, kind, length):
    """A case's mask_mod: "document", queries see their own document's keys (documents of
    random lengths, their ids an array of the case's library that the function captures)."""
    if kind is None:
        return None
    lengths = rng.integers(max(1, length // 12), max(2, length // 4), length)
    ids = xp.asarray(np.repeat(np.arange(length), lengths)[:length].astype(np.int32))

    def document(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]
    return document


def verify_case(table, numba_flash, xp, rng, shape, dtype, causal, on_gpu, kv_heads=None,
                options=None):
    """One case: shape (batch, seqlen_q, seqlen_k, nheads, headdim); kv_heads (GQA) and
    options (window_size, softcap, alibi: random (batch, nheads) slopes; mask: "padding", a
    boolean (batch, 1, 1, seqlen_k) key padding mask, or "float", a (nheads, seqlen_q,
    seqlen_k) mask of the dtype with some -inf; mask_mod: "document", _mask_mod's) for the
    variants."""
    from numba_flash.extras import NO_EXTRAS, Extras
    from numba_flash.mask_mod import lower
    from numba_flash.reference import attention_backward, attention_forward
    from numba_flash.spec import make_spec
    from numba_flash.testing import plain16_backward, plain16_forward, round16
    batch, seqlen_q, seqlen_k, nheads, headdim = shape
    kv_heads, options = kv_heads or nheads, dict(options or {}, causal=causal)
    case = (f"{dtype:8s} {'causal' if causal else 'full  '} B{batch} H{nheads} "
            f"Nq{seqlen_q} Nk{seqlen_k} D{headdim} {_variant_name(nheads, kv_heads, options)}")
    alibi, mask_kind = options.pop("alibi", False), options.pop("mask", None)
    slopes = xp.asarray(rng.uniform(0.02, 0.5, (batch, nheads)).astype(np.float32))
    bf16 = dtype == "bfloat16"
    mask = _mask(xp, rng, mask_kind, shape, dtype)
    if "mask_mod" in options:
        options["mask_mod"] = _mask_mod(xp, rng, options["mask_mod"], max(seqlen_q, seqlen_k))
    captured = lower(options.get("mask_mod"))[1]  # (its arrays: numba_flash/mask_mod.py)
    extras = (Extras(slopes if alibi else None, attn_mask=mask, mask_mod_arrays=captured)
              if alibi or mask is not None or captured else NO_EXTRAS)
    mask_dtype = None if mask is None else "bool" if mask_kind == "padding" else dtype
    values = list(harness.random_inputs(xp, rng, *shape, "float32" if bf16 else dtype))
    values[1:3] = [xp.ascontiguousarray(x[:, :, :kv_heads]) for x in values[1:3]]
    if bf16:
        values = [round16(xp, x, dtype) for x in values]
    inputs = Inputs(xp, values, dtype, on_gpu)
    q, k, v, dout = values
    spec = make_spec(q, k, alibi=alibi, attn_mask=mask_dtype and str(mask.dtype), **options)
    ref_out, ref_lse = attention_forward(xp, q, k, v, spec, "float64", extras)
    # out and lse handed to backward: the reference's, rounded as forward would return them.
    out_in = (round16(xp, ref_out, dtype) if bf16 else
              xp.ascontiguousarray(ref_out.astype(dtype)))
    lse_in = xp.ascontiguousarray(ref_lse.astype("float32"))
    ref_grads = [to_host(g) for g in attention_backward(xp, dout, q, k, v, out_in, lse_in, spec,
                                                        "float64", extras)]
    ref_out, ref_lse = to_host(ref_out), to_host(ref_lse)
    # The plain same-precision implementation that sets the error bound.
    if bf16:
        base_out, base_lse = plain16_forward(xp, q, k, v, spec, dtype, extras)
        base_grads = plain16_backward(xp, dout, q, k, v, out_in, lse_in, spec, dtype, extras)
    else:
        base_out, base_lse = attention_forward(xp, q, k, v, spec, dtype, extras)
        base_grads = attention_backward(xp, dout, q, k, v, out_in, lse_in, spec, dtype, extras)
    limits = {"out": error_bound(max_error(to_host(base_out), ref_out), ref_out, dtype),
              "lse": error_bound(max_error(to_host(base_lse), ref_lse), ref_lse, dtype)}
    for name, base, ref in zip(("dq", "dk", "dv"), base_grads, ref_grads):
        limits[name] = error_bound(max_error(to_host(base), ref), ref, dtype)

    engines_run = {}  # kernel family -> the backend that ran it for this case
    for name, reason in numba_flash.available_backends().items():
        if reason:
            table.skip(name, case, reason)
            continue
        host = name == "numpy"
        if on_gpu and host and seqlen_q * seqlen_k > 1024 * 1024:
            table.skip(name, case, "float64 on the CPU: checked at the smaller shapes")
            continue
        args = [inputs.for_backend(x, host) for x in (q, k, v)]
        backend = numba_flash.get_backend(name)
        backend_spec = make_spec(args[0], args[1], alibi=alibi, attn_mask=mask_dtype, **options)
        reason = backend.supports(backend_spec, *args)
        if reason:
            table.skip(name, case, reason)
            continue
        engine = (backend.engine(backend_spec, *args)[0].name if hasattr(backend, "engine")
                  else name)
        if not on_gpu and engine == "tensor cores" and shape != SIM_SHAPES[0]:
            table.skip(name, case, "simulated tensor cores are slow: checked at the first "
                                   "shape only")
            continue
        if engine in engines_run:
            table.skip(name, case, f"runs the same kernels ({engine}) as "
                                   f"{engines_run[engine]!r} here")
            continue
        engines_run[engine] = name
        if on_gpu and not host:
            harness.poison_memory_pool(8 * q.nbytes + 4 * k.nbytes)
        if alibi:  # (float32, the library and place of the backend's q)
            options["alibi_slopes"] = inputs.beside_for_backend(slopes, host)
        if mask is not None:
            options["attn_mask"] = (inputs.for_backend(mask, host) if mask_dtype == "bfloat16"
                                    else inputs.beside_for_backend(mask, host))
        out, lse = numba_flash.forward(*args, backend=name, **options)
        table.add(name, case, "out", max_error(to_host(out), ref_out), limits["out"])
        table.add(name, case, "lse", max_error(to_host(lse), ref_lse), limits["lse"])
        bargs = [inputs.for_backend(x, host) for x in (dout, q, k, v, out_in)]
        bargs.append(to_host(lse_in) if host else lse_in)
        if bf16 and on_gpu and not host:
            import torch
            bargs[-1] = torch.from_dlpack(lse_in)
        if on_gpu and not host:
            harness.poison_memory_pool(8 * q.nbytes + 4 * k.nbytes)
        grads = numba_flash.backward(*bargs, backend=name, **options)
        options.pop("alibi_slopes", None)
        options.pop("attn_mask", None)
        for gname, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
            table.add(name, case, gname, max_error(to_host(got), ref), limits[gname])


def _mask(xp, rng, kind, shape, dtype):
    """A case's attn_mask (see verify_case; a bfloat16 case's float mask as float32 values
    that bfloat16 holds), or None."""
    from numba_flash.testing import round16
    batch, seqlen_q, seqlen_k, nheads, _ = shape
    if kind == "padding":
        lengths = xp.asarray(rng.integers(seqlen_k // 2, seqlen_k + 1, batch))
        return xp.arange(seqlen_k)[None, None, None, :] < lengths[:, None, None, None]
    if kind != "float":
        return None
    values = rng.standard_normal((nheads, seqlen_q, seqlen_k)) * 2
    values[rng.random(values.shape) < 0.1] = -np.inf
    if dtype == "bfloat16":
        return round16(xp, xp.asarray(values, np.float32), dtype)
    return xp.asarray(values.astype(dtype))


def verify_long(table, numba_flash, xp, rng, causal, shape=LONG):
    """numba forward at a long length (N = 65536 by default); the reference is computed for
    sampled row blocks."""
    from numba_flash.reference import attention_forward
    from numba_flash.spec import make_spec
    batch, seqlen_q, seqlen_k, nheads, headdim = shape
    dtype = "float16"
    case = f"{dtype} {'causal' if causal else 'full  '} B{batch} H{nheads} N{seqlen_q} D{headdim}"
    q, k, v, _ = harness.random_inputs(xp, rng, *shape, dtype)
    spec = make_spec(q, causal=causal)
    for name in ("cupy",):
        reason = numba_flash.get_backend(name).supports(spec, q, k, v)
        table.skip(name, case, reason or "unexpectedly supported")
    start = time.perf_counter()
    (out, lse), extra = harness.peak_extra_bytes(
        lambda: numba_flash.forward(q, k, v, causal=causal, backend="numba"))
    seconds = time.perf_counter() - start
    offset = seqlen_k - seqlen_q
    errors, limits = [], []
    for r0 in (0, seqlen_q // 2, seqlen_q - 128):
        r1 = r0 + 128
        keys = r1 + offset if causal else seqlen_k  # rows r0..r1 see no key past this
        ref_out, ref_lse = attention_forward(xp, q[:, r0:r1], k[:, :keys], v[:, :keys], spec,
                                             "float64")
        base_out, base_lse = attention_forward(xp, q[:, r0:r1], k[:, :keys], v[:, :keys], spec,
                                               dtype)
        for got, base, ref in ((out[:, r0:r1], base_out, ref_out),
                               (lse[:, :, r0:r1], base_lse, ref_lse)):
            ref = to_host(ref)
            errors.append(max_error(to_host(got), ref))
            limits.append(error_bound(max_error(to_host(base), ref), ref, dtype))
    worst = int(np.argmax(np.array(errors) / np.array(limits)))
    table.add("numba", case, "fwd", errors[worst], limits[worst],
              f"(sampled rows) {seconds * 1e3:.0f} ms incl. compile, "
              f"peak extra device memory {extra / 2**20:.0f} MiB (out + lse)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulator", action="store_true",
                        help="run the kernels in Numba's CUDA simulator even if a GPU is here")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--shapes", nargs="+", type=int, metavar="I",
                        help="only these shapes of the grid (indices from 0, in the order the "
                             "grid lists them); the long forward runs unless --quick")
    parser.add_argument("--variant-rows", nargs="+", type=int, metavar="I",
                        help="only these rows of the variants' list (indices from 0), and no "
                             "dense shape unless --shapes names some, no long forward")
    args = parser.parse_args(argv)
    reason = "asked for (--simulator)" if args.simulator else harness.gpu_ready()
    on_gpu = reason is None
    if not on_gpu:
        harness.use_simulator()
        print(f"No GPU run ({reason}): running the Numba kernels in Numba's CUDA simulator "
              f"at small sizes (slow: over 15 minutes on two CPU cores; --quick: fewer).\n")
    import numba_flash
    xp = np
    if on_gpu:
        import cupy as xp
        print(f"GPU: {xp.cuda.runtime.getDeviceProperties(0)['name'].decode()}\n")
    shapes = GPU_SHAPES if on_gpu else SIM_SHAPES
    have_torch = importlib.util.find_spec("torch") is not None
    if args.quick:
        shapes = shapes[:2]
    if args.variant_rows and not args.shapes:
        shapes = []
    if args.shapes:
        if not all(0 <= i < len(shapes) for i in args.shapes):
            parser.error(f"--shapes: indices must be in 0..{len(shapes) - 1}")
        shapes = [shapes[i] for i in args.shapes]
    rng = np.random.default_rng()
    table = Table()
    print(f"{'backend':10s} {'case':42s} {'qty':4s} {'max error':>10s} {'bound':>10s}")
    for shape in shapes:
        for dtype in ("float32", "float16", "bfloat16"):
            for causal in (False, True):
                if dtype == "bfloat16" and not have_torch:
                    table.skip("all", f"{dtype} {shape}",
                               "bfloat16 arrays come as torch tensors, and torch is not installed")
                    continue
                verify_case(table, numba_flash, xp, rng, shape, dtype, causal, on_gpu)
    variants = (GPU_VARIANTS if on_gpu else SIM_VARIANTS)[:1 if args.quick else None]
    if args.variant_rows:
        if not all(0 <= i < len(variants) for i in args.variant_rows):
            parser.error(f"--variant-rows: indices must be in 0..{len(variants) - 1}")
        variants = [variants[i] for i in args.variant_rows]
    for shape, kv_heads, causal, options in variants:
        for dtype in ("float32", "float16", "bfloat16")[:3 if have_torch else 2]:
            verify_case(table, numba_flash, xp, rng, shape, dtype, causal, on_gpu, kv_heads,
                        options)
    if not args.variant_rows and not args.shapes:
        verify_kvcache(table, numba_flash, xp, rng, on_gpu,
                       ("float32", "float16", "bfloat16")[:3 if have_torch else 2], to_host,
                       Inputs)
    if on_gpu and not args.quick and not args.variant_rows:
        for causal in (False, True):
            verify_long(table, numba_flash, xp, rng, causal)
    checked = sum(row[5] != "SKIP" for row in table.rows)
    print(f"\n{checked - table.failures} passed, {table.failures} failed, "
          f"{len(table.rows) - checked} skipped")
    return 1 if table.failures else 0


if __name__ == "__main__":
    sys.exit(main())
