"""Compile every Numba kernel to PTX (and, with ptxas, to machine code) without a GPU.

Uses libNVVM from pip (numba-cuda[cu13]). For each kernel it reports whether the PTX declares
local memory (`__local_depot`: a register array placed in memory), counts the key instructions,
and, when a ptxas of the same CUDA release is installed (the `test` extra brings it), the
registers, spill bytes and static shared memory from `ptxas -v`, beside the dynamic shared
memory the configs ask for. Prints one JSON object per kernel; exits 1 if ptxas refuses a kernel
or any kernel uses local memory, spills, or needs over 48 KiB of static shared memory or more
dynamic shared memory than allowed (tensor cores: MMA_SHARED_MEMORY_BYTES; SIMT: what a block
may have on the target, OPT_IN_SHARED_BYTES).

    python scripts/ptx_check.py --cc 80 90 [--variants]
    python scripts/ptx_check.py --hopper [--variants]
    python scripts/ptx_check.py --cc 80 --head-dims 64 --variants --only mma_bwd_dq
    python scripts/ptx_check.py --hopper --list  (the names only; --names NAME... builds those)

--hopper builds, instead, the Hopper (wgmma) family's kernels for sm_90a, with the launch
bounds the family compiles with (setmaxnreg needs them); any ptxas warning counts as a
failure there (C7508: register reallocation ignored; C7515: wgmma serialised).
--variants builds, instead, per head dim and dtype the kernels of a spec with every variant at
once (GQA, a causal sliding window, softcap, ALiBi, varlen: the most registers a variant
takes), named "variants"; with a floating attn_mask instead of varlen, named "masked"
(MASKED); and of a document mask_mod with causal, softcap and GQA, named "mask_mod"
(MASK_MODDED; for the Hopper family also without GQA, "mask_mod_mha", and with varlen,
"mask_mod_varlen").
"""
import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # compile for real, never in the simulator

from numba import cuda  # noqa: E402

from numba_flash.backends.numba.decode.append import append_kernel  # noqa: E402
from numba_flash.backends.numba.decode.combine import combine_kernel  # noqa: E402
from numba_flash.backends.numba.decode.kernels import (  # noqa: E402
    decode_kernel, decode_shape)
from numba_flash.backends.numba.decode.kernels import \
    shared_bytes as decode_shared_bytes  # noqa: E402
from numba_flash.backends.numba.decode.tensor_cores import (  # noqa: E402
    choose_stages, decode_kernel as tensor_core_decode_kernel,
    shared_bytes as tensor_core_decode_bytes)
from numba_flash.backends.numba.device.delta import delta_kernel_function  # noqa: E402
from numba_flash.backends.numba.device.group_sums import \
    group_sums_kernel_function  # noqa: E402
from numba_flash.backends.numba.gpu import SHARED_MEMORY_BYTES  # noqa: E402
from numba_flash.backends.numba.hopper.bwd_dk_dv import (  # noqa: E402
    hopper_dk_dv_kernel_function)
from numba_flash.backends.numba.hopper.bwd_dq import hopper_dq_kernel_function  # noqa: E402
from numba_flash.backends.numba.hopper.config import (  # noqa: E402
    HOPPER_SHARED_MEMORY_BYTES, hopper_backward_config, hopper_backward_shared_bytes,
    hopper_forward_config, hopper_forward_shared_bytes)
from numba_flash.backends.numba.hopper.fwd import hopper_forward_kernel_function  # noqa: E402
from numba_flash.backends.numba.mma.bwd import (  # noqa: E402
    mma_dk_dv_kernel_function, mma_dq_kernel_function)
from numba_flash.backends.numba.mma.config import (  # noqa: E402
    MMA_SHARED_MEMORY_BYTES, mma_backward_config, mma_backward_shared_bytes, mma_forward_config,
    mma_forward_shared_bytes)
from numba_flash.backends.numba.mma.fwd import mma_forward_kernel_function  # noqa: E402
from numba_flash.backends.numba.simt.bwd import backward_kernel_functions  # noqa: E402
from numba_flash.backends.numba.simt.config import (  # noqa: E402
    simt_backward_candidates, simt_backward_config, simt_backward_shared_bytes,
    simt_forward_candidates, simt_forward_config, simt_forward_shared_bytes)
from numba_flash.backends.numba.simt.fwd import forward_kernel_function  # noqa: E402
from numba_flash.spec import AttentionSpec  # noqa: E402

#: shared memory a block may opt in to, per compute capability (48 KiB for those not listed):
#: the SIMT kernels' configs go up to it; the tensor-core ones stay within
#: MMA_SHARED_MEMORY_BYTES
OPT_IN_SHARED_BYTES = {70: 96 * 1024, 75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024,
                       87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}

COUNTED = ("fma.rn.f32", "ld.shared", "ld.shared.v4", "ld.shared.v4.f32", "st.shared",
           "ex2.approx", "bar.sync", "mma.sync", "ldmatrix", "cp.async.cg", "wgmma.mma_async",
           "setmaxnreg", "mbarrier.try_wait", "cp.async.bulk.tensor",
           "tensormap.replace.tile.global_dim")


def find_ptxas():
    """ptxas from the pip CUDA packages (matching libNVVM), else one on PATH, else None."""
    import nvidia
    for root in nvidia.__path__:
        for path in sorted(glob.glob(os.path.join(root, "cu*", "bin", "ptxas"))):
            return path
    return shutil.which("ptxas")


def ptxas_report(ptxas, ptx, cc):
    """{'registers', 'spill_bytes', 'shared_bytes', 'ptxas_warnings'} from `ptxas -v` (cc: two
    digits, or "90a"), or {'ptxas_error'}."""
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        run = subprocess.run([ptxas, f"-arch=sm_{cc}", "-v", source, "-o",
                              os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True)
    if run.returncode:
        lines = run.stderr.strip().splitlines()
        errors = [line for line in lines if "error" in line.lower()] or lines[-1:]
        # The mangled kernel name fills the line; what went wrong is at its end.
        return {"ptxas_error": re.sub(r"'[^']*'", "'<kernel>'", errors[0])[:200]}
    text = run.stderr
    number = lambda pattern: sum(int(x) for x in re.findall(pattern, text))  # noqa: E731
    # (ptxas prints its performance warnings, e.g. C7508 and C7515, as "info" lines)
    warnings = [re.sub(r"'[^']*'", "'<kernel>'", line)[:200] for line in text.splitlines()
                if "warning" in line.lower() or re.search(r"\(C\d{4}\)", line)]
    return {"registers": number(r"Used (\d+) registers"),
            "spill_bytes": number(r"(\d+) bytes spill stores") + number(r"(\d+) bytes spill loads"),
            "shared_bytes": number(r"(\d+) bytes smem"), "ptxas_warnings": warnings}


_DOCUMENTS = np.repeat(np.arange(8, dtype=np.int32), 512)  # (a kernel argument: mask_mod.py)


def document_mask(b, h, q_idx, kv_idx):
    """A mask_mod as a user writes one: queries see the keys of their own document."""
    return _DOCUMENTS[q_idx] == _DOCUMENTS[kv_idx]


VARIANTS = dict(causal=True, window_left=256, softcap=30.0, group=4, alibi=True, varlen=True)
#: the variants with a floating attn_mask of q's dtype instead of varlen (which takes no
#: attn_mask)
MASKED = dict(VARIANTS, varlen=False)
#: a boolean mask with the variants that leave the Hopper forward its plain tiles (all but
#: varlen, and ALiBi beside softcap: hopper/config.py)
BOOL_MASKED = dict(MASKED, alibi=False)
#: a document mask_mod with causal, softcap and GQA (Gemma 2's variants; with every variant
#: at once the dK/dV kernels spill: docs/KERNEL_NOTES.md, "mask_mod")
MASK_MODDED = dict(causal=True, softcap=30.0, group=4, mask_mod=document_mask)
#: the same without GQA: the Hopper backward takes wider dK/dV tiles there (hopper/config.py)
MASK_MODDED_MHA = dict(MASK_MODDED, group=1)
#: the kernels' last three arguments with a mask_mod: its tile tables (classes, spans) and
#: the arrays it captures (_DOCUMENTS)
MASK_MOD_ARGUMENTS = "int8[:, :, :, :], int32[:, :, :, :], UniTuple(int32[::1], 1)"


def mask_type(dtype):
    """The kernels' element type of a floating attn_mask of q's dtype (bfloat16: its bits)."""
    return "uint16" if dtype == "bfloat16" else dtype


def _specs(head_dim, dtype, variants):
    """(tag word, spec, the signature of the kernels' last seven arguments): full and
    causal, or with variants all of them at once ("variants"), all but varlen with a
    floating mask of q's dtype ("masked") and a mask_mod's spec ("mask_mod")."""
    f3 = "float32[:, :, :]"
    if variants:
        yield ("variants", AttentionSpec(head_dim=head_dim, dtype=dtype, **VARIANTS),
               f", float32[:, :], int32[::1], int32[::1], {f3}, {f3}, {f3}, Tuple(())")
        mask = mask_type(dtype)
        yield ("masked", AttentionSpec(head_dim=head_dim, dtype=dtype, attn_mask=dtype,
                                       **MASKED),
               f", float32[:, :], {f3}, {f3}, {mask}[:, :, :, :], {f3}, {f3}, Tuple(())")
        yield ("mask_mod", AttentionSpec(head_dim=head_dim, dtype=dtype, **MASK_MODDED),
               f"{f', {f3}' * 4}, {MASK_MOD_ARGUMENTS}")
        return
    unused = f"{f', {f3}' * 6}, Tuple(())"  # (the lse array and no captured arrays:
    #                                          launch.kernel_extras_unused, tile_arguments)
    yield "full", AttentionSpec(head_dim=head_dim, dtype=dtype), unused
    yield "causal", AttentionSpec(head_dim=head_dim, dtype=dtype, causal=True), unused


def kernel_cases(head_dims, dtypes, cc, all_configs=False, variants=False):
    """(name, python function, signature, dynamic shared bytes) for every SIMT kernel of every
    (head_dim, causal, dtype). The forward and the backward are built as the backend runs them
    on a GPU of this compute capability: its config (or, with all_configs, each candidate, the
    shape in the name) and its loads (cp.async, names ending in _async, for float32 with head
    dims that are a multiple of 4 on sm_80 and newer; plain loads otherwise)."""
    shared_limit = OPT_IN_SHARED_BYTES.get(cc, SHARED_MEMORY_BYTES)
    for dtype in dtypes:
        bf16 = dtype == "bfloat16"  # bfloat16 arrays reach the kernels as uint16 bit patterns
        a4 = f"{'uint16' if bf16 else dtype}[:, :, :, :]"
        f3 = "float32[:, :, :]"
        for head_dim in head_dims:
            for kind, spec, extras in _specs(head_dim, dtype, variants):
                tag = f"d{head_dim}_{kind}_{dtype}"
                configs = (simt_forward_candidates(head_dim) if all_configs
                           else [simt_forward_config(head_dim, shared_limit)])
                # the loads the backend takes on this target: cp.async for float32 rows of
                # whole 16-byte copies on sm_80 and newer, plain loads otherwise
                loads = [dtype == "float32" and head_dim % 4 == 0 and cc >= 80]
                for config in configs:
                    shape = "x".join(map(str, (config.warps, config.rows_per_thread,
                                               config.keys_per_thread)))
                    for async_copy in loads:
                        fwd = forward_kernel_function(config, spec, async_copy)
                        name = (f"forward_{tag}{'_async' if async_copy else ''}"
                                f"{'_' + shape if all_configs else ''}")
                        yield (name, fwd, f"({a4}, {a4}, {a4}, {a4}, {f3}, float32{extras})",
                               simt_forward_shared_bytes(config, head_dim))
                configs = (simt_backward_candidates(head_dim) if all_configs
                           else [simt_backward_config(head_dim, shared_limit)])
                for config in configs:
                    shape = "x".join(map(str, (config.warps, config.key_rows, config.query_cols,
                                               config.query_rows, config.key_cols,
                                               config.stages)))
                    dk_dv_bytes, dq_bytes = simt_backward_shared_bytes(config, head_dim)
                    for async_copy in loads:
                        dk_dv, dq = backward_kernel_functions(config, spec, async_copy)
                        end = (f"{'_async' if async_copy else ''}"
                               f"{'_' + shape if all_configs else ''}")
                        if kind == "full" and config == configs[0]:  # (one delta kernel)
                            delta = delta_kernel_function(head_dim, "bf16" if bf16 else "float")
                            yield f"bwd_delta_{tag}", delta, f"({a4}, {a4}, {f3})", 0
                        yield (f"bwd_dk_dv_{tag}{end}", dk_dv,
                               f"({a4}, {a4}, {a4}, {a4}, {f3}, {f3}, {a4}, {a4}, float32, "
                               f"float32{extras})", dk_dv_bytes)
                        yield (f"bwd_dq_{tag}{end}", dq,
                               f"({a4}, {a4}, {a4}, {a4}, {f3}, {f3}, {a4}, float32, "
                               f"float32{extras})", dq_bytes)


MMA_DTYPES = ("float16", "bfloat16")


def mma_kernel_cases(head_dims, dtypes=MMA_DTYPES, variants=False):
    """The tensor-core kernels for every head dim that has an mma config (their tiles are in
    dynamic shared memory, so ptxas does not see them: the config says how much)."""
    u4 = "uint16[:, :, :, :]"
    for head_dim in head_dims:
        if mma_forward_config(head_dim) is None:
            continue
        for dtype in dtypes:
            for kind, spec, extras in _specs(head_dim, dtype, variants):
                bwd = mma_backward_config(head_dim, spec)
                dk_dv_bytes, dq_bytes = mma_backward_shared_bytes(bwd, head_dim)
                tag = f"d{head_dim}_{kind}_{'bf16' if spec.bf16 else 'f16'}"
                config = mma_forward_config(head_dim, spec)
                fn = mma_forward_kernel_function(config, spec)
                yield (f"mma_forward_{tag}", fn,
                       f"({u4}, {u4}, {u4}, {u4}, float32[:, :, :], float32{extras})",
                       mma_forward_shared_bytes(config, head_dim))
                f3 = "float32[:, :, :]"
                yield (f"mma_bwd_dk_dv_{tag}",
                       mma_dk_dv_kernel_function(bwd, spec),
                       f"({u4}, {u4}, {u4}, {u4}, {f3}, {f3}, {u4}, {u4}, float32, float32"
                       f"{extras})", dk_dv_bytes)
                yield (f"mma_bwd_dq_{tag}",
                       mma_dq_kernel_function(bwd, spec),
                       f"({u4}, {u4}, {u4}, {u4}, {f3}, {f3}, {u4}, float32, float32{extras})",
                       dq_bytes)
                if head_dim == 64 and kind in ("full", "causal"):  # contiguous arrays, as the
                    # backend usually passes them: the d64 dK/dV kernel's occupancy hangs on
                    # its registers (168 or fewer for three blocks of 128 threads per
                    # multiprocessor)
                    c4, c3 = "uint16[:, :, :, ::1]", "float32[:, :, ::1]"
                    yield (f"mma_contiguous_bwd_dk_dv_{tag}", mma_dk_dv_kernel_function(bwd, spec),
                           f"({c4}, {c4}, {c4}, {c4}, {c3}, {c3}, {c4}, {c4}, float32, float32"
                           f"{', float32[:, :, ::1]' * 6}, Tuple(()))", dk_dv_bytes)


#: the Hopper kernels' tensor-map arguments: the slots and the templates (the forward's
#: three, each backward kernel's four)
MAPS, BACKWARD_MAPS = ("int64[:, ::1], UniTuple(UniTuple(uint64, 16), 3)",
                       "int64[:, ::1], UniTuple(UniTuple(uint64, 16), 4)")


def _hopper_specs(head_dim, dtype, variants):
    """_specs, and after the mask_mod's the same without GQA ("mask_mod_mha") and with varlen
    ("mask_mod_varlen": its backward on cp.async and the masked table)."""
    for kind, spec, extras in _specs(head_dim, dtype, variants):
        yield kind, spec, extras
        if kind == "mask_mod":
            yield ("mask_mod_mha", AttentionSpec(head_dim=head_dim, dtype=dtype,
                                                 **MASK_MODDED_MHA), extras)
            f3, cu = "float32[:, :, :]", "int32[::1]"  # (no ALiBi; cu_seqlens; no attn_mask)
            yield ("mask_mod_varlen", AttentionSpec(head_dim=head_dim, dtype=dtype, varlen=True,
                                                    **MASK_MODDED),
                   f", {f3}, {cu}, {cu}, {f3}, {MASK_MOD_ARGUMENTS}")


def hopper_kernel_cases(head_dims, dtypes, variants=False):
    """The Hopper family's forward and backward (dK/dV, dQ) for every head dim they have a
    config for, as _hopper_specs gives them, with (dynamic shared bytes, launch bounds)."""
    u4 = "uint16[:, :, :, :]"
    for head_dim in head_dims:
        for dtype in dtypes:
            for kind, spec, extras in _hopper_specs(head_dim, dtype, variants):
                config = hopper_forward_config(head_dim, spec)
                if config is None:
                    continue
                tag = f"d{head_dim}_{kind}_{'bf16' if spec.bf16 else 'f16'}"
                yield (f"hopper_forward_{tag}", hopper_forward_kernel_function(config, spec),
                       f"({u4}, {u4}, {u4}, {u4}, float32[:, :, :], float32, {MAPS}{extras})",
                       hopper_forward_shared_bytes(config, head_dim), (config.threads, 1))
                if spec.causal:  # (few waves: the query tiles along grid.y; hopper/grids.py)
                    yield (f"hopper_forward_{tag}_queries_slowest",
                           hopper_forward_kernel_function(config, spec, True),
                           f"({u4}, {u4}, {u4}, {u4}, float32[:, :, :], float32, {MAPS}"
                           f"{extras})", hopper_forward_shared_bytes(config, head_dim),
                           (config.threads, 1))
                if kind == "masked":  # (a boolean mask takes the plain tiles: config.py)
                    bool_spec = AttentionSpec(head_dim=head_dim, dtype=dtype,
                                              attn_mask="bool", **BOOL_MASKED)
                    bool_config = hopper_forward_config(head_dim, bool_spec)
                    yield (f"hopper_forward_{tag.replace('masked', 'bool_masked')}",
                           hopper_forward_kernel_function(bool_config, bool_spec),
                           f"({u4}, {u4}, {u4}, {u4}, float32[:, :, :], float32, {MAPS}"
                           f"{extras.replace(mask_type(dtype), 'boolean')})",
                           hopper_forward_shared_bytes(bool_config, head_dim),
                           (bool_config.threads, 1))
                backward = hopper_backward_config(head_dim, spec)
                if backward is None:
                    continue
                f3 = "float32[:, :, :]"
                dk_dv_bytes, dq_bytes = hopper_backward_shared_bytes(backward, head_dim)
                yield (f"hopper_bwd_dk_dv_{tag}", hopper_dk_dv_kernel_function(backward, spec),
                       f"({u4}, {u4}, {u4}, {u4}, {f3}, {f3}, {u4}, {u4}, float32, float32, "
                       f"{BACKWARD_MAPS}{extras})", dk_dv_bytes, (backward.threads, 1))
                yield (f"hopper_bwd_dq_{tag}", hopper_dq_kernel_function(backward, spec),
                       f"({u4}, {u4}, {u4}, {u4}, {f3}, {f3}, {u4}, float32, float32, "
                       f"{BACKWARD_MAPS}{extras})",
                       dq_bytes, (backward.threads, 1))
                # the dK/dV grid's layouts where blocks are few (hopper/grids.py): a split
                # group's float32 parts, key tiles along grid.y
                split = 2 if spec.group % 2 == 0 else 1
                if split > 1 or spec.causal:
                    parts = "float32[:, :, :, :]" if split > 1 else u4
                    yield (f"hopper_bwd_dk_dv_{tag}_split{split}_keys_slowest",
                           hopper_dk_dv_kernel_function(backward, spec, split, True),
                           f"({u4}, {u4}, {u4}, {u4}, {f3}, {f3}, {parts}, {parts}, float32, "
                           f"float32, {BACKWARD_MAPS}{extras})", dk_dv_bytes,
                           (backward.threads, 1))
                if spec.causal:
                    yield (f"hopper_bwd_dq_{tag}_queries_slowest",
                           hopper_dq_kernel_function(backward, spec, True),
                           f"({u4}, {u4}, {u4}, {u4}, {f3}, {f3}, {u4}, float32, float32, "
                           f"{BACKWARD_MAPS}{extras})", dq_bytes, (backward.threads, 1))
            cu = "int32[::1]"
            for varlen, cu_type in ((False, "float32[:, :, :]"), (True, cu)):
                sums_spec = AttentionSpec(head_dim=head_dim, dtype=dtype, varlen=varlen)
                yield (f"bwd_group_sums_d{head_dim}_{dtype}{'_varlen' if varlen else ''}",
                       group_sums_kernel_function(sums_spec, 2, head_dim),
                       f"(float32[:, :, :, :], float32[:, :, :, :], {u4}, {u4}, {cu_type}, "
                       f"{cu_type})", 0)


def decode_kernel_cases(head_dims, dtypes, cc):
    """The split-KV decode family (backends/numba/decode): the decode kernel of a plain and a
    variant spec (GQA 4, causal window, softcap, ALiBi), contiguous and paged, with cp.async
    loads (and, for the plain contiguous spec, plain ones), in the shape of one decoded token
    (the warps splitting the keys: "_keys"), and of many rows for the plain contiguous and
    the variants' paged kernels ("_rows"); the tensor-core decode kernel of each spec and
    layout (16-bit dtypes, head dims that are multiples of 16; "decode_mma_", its stages as
    the target's shared memory allows); and the combine and append kernels."""
    f4, f5 = "float32[:, :, :, :]", "float32[:, :, :, :, :]"
    for dtype in dtypes:
        bf16 = dtype == "bfloat16"
        a4 = "float32[:, :, :, :]" if dtype == "float32" else "uint16[:, :, :, :]"  # (bits)
        for head_dim in head_dims:
            yield (f"decode_combine_d{head_dim}_{dtype}", combine_kernel(bf16, head_dim).py_func,
                   f"({f5}, {f4}, {a4}, float32[:, :, :])", 0)
            specs = [("plain", AttentionSpec(head_dim=head_dim, dtype=dtype)),
                     ("variants", AttentionSpec(head_dim=head_dim, dtype=dtype, group=4,
                                                causal=True, window_left=256, softcap=30.0,
                                                alibi=True))]
            for kind, spec in specs:
                for paged in (False, True):
                    shapes = [("keys", decode_shape(spec, spec.group))]
                    if paged == (kind == "variants"):
                        shapes.append(("rows", decode_shape(spec, 64)))
                    for async_copy in (True, False) if kind == "plain" and not paged else (True,):
                        for tag, shape in shapes:
                            slopes = "float32[:, :]" if spec.alibi else "float32[:, :, :]"
                            yield (f"decode_d{head_dim}_{kind}_"
                                   f"{'paged' if paged else 'contiguous'}_{dtype}"
                                   f"{'_async' if async_copy else ''}_{tag}",
                                   decode_kernel(spec, paged, async_copy, shape).py_func,
                                   f"({a4}, {a4}, {a4}, int32[:, :], int32[:], int32, int32, "
                                   f"{f5}, {f4}, float32, {slopes})",
                                   decode_shared_bytes(spec, shape))
                    if dtype != "float32" and head_dim % 16 == 0:
                        stages = choose_stages(head_dim, OPT_IN_SHARED_BYTES[cc])
                        yield (f"decode_mma_d{head_dim}_{kind}_"
                               f"{'paged' if paged else 'contiguous'}_{dtype}",
                               tensor_core_decode_kernel(spec, paged, stages).py_func,
                               f"({a4}, {a4}, {a4}, int32[:, :], int32[:], int32, int32, "
                               f"{f5}, {f4}, float32, {slopes})",
                               tensor_core_decode_bytes(head_dim, stages))
        for paged in (False, True):
            yield (f"decode_append_{'paged' if paged else 'contiguous'}_{dtype}",
                   append_kernel(paged).py_func,
                   f"({a4}, {a4}, {a4}, {a4}, int32[:, :], int32[:], int32)", 0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", nargs="+", type=int, default=[80, 90],
                        help="compute capabilities as two digits (default: 80 90)")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[32, 64, 128, 256])
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16", "float32"])
    parser.add_argument("--mma-dtypes", nargs="*", default=list(MMA_DTYPES), choices=MMA_DTYPES,
                        help="the tensor-core kernels' dtypes (none: SIMT kernels only)")
    parser.add_argument("--all-configs", action="store_true",
                        help="build the SIMT forward for every candidate config")
    parser.add_argument("--variants", action="store_true",
                        help="instead, the kernels of a spec with every variant (VARIANTS)")
    parser.add_argument("--decode", action="store_true",
                        help="instead, the split-KV decode family's kernels")
    parser.add_argument("--hopper", action="store_true",
                        help="instead, the Hopper family's kernels, for sm_90a (ignores --cc)")
    parser.add_argument("--causal-only", action="store_true",
                        help="leave out the kernels of the full (not causal) spec")
    parser.add_argument("--only", nargs="+", metavar="TEXT",
                        help="build only the kernels whose names contain one of these")
    parser.add_argument("--names", nargs="+", metavar="NAME",
                        help="build only the kernels of these exact names")
    parser.add_argument("--list", action="store_true",
                        help="print the kernels' names and targets, building none")
    parser.add_argument("--save", metavar="DIR", help="also write each kernel's PTX here")
    args = parser.parse_args(argv)
    ptxas = find_ptxas()
    failed = 0
    for cc in ["90a"] if args.hopper else args.cc:
        if args.hopper:
            cases = list(hopper_kernel_cases(args.head_dims, args.mma_dtypes, args.variants))
        elif args.decode:
            cases = list(decode_kernel_cases(args.head_dims, args.dtypes, cc))
        else:
            cases = list(kernel_cases(args.head_dims, args.dtypes, cc, args.all_configs,
                                      args.variants)) + list(
                mma_kernel_cases(args.head_dims, args.mma_dtypes, args.variants))
        if args.causal_only:
            cases = [case for case in cases if "_full_" not in case[0]]
        if args.only:
            cases = [case for case in cases if any(text in case[0] for text in args.only)]
        if args.names:
            cases = [case for case in cases if case[0] in args.names]
        if args.list:
            for case in cases:
                print(json.dumps({"kernel": case[0], "cc": cc}))
            continue
        for name, function, signature, dynamic_bytes, *launch_bounds in cases:
            target = (9, 0, "a") if cc == "90a" else divmod(cc, 10)
            ptx, _ = cuda.compile_ptx(function, signature, cc=target,
                                      launch_bounds=launch_bounds[0] if launch_bounds else None)
            report = {"kernel": name, "cc": cc, "local_memory": "__local_depot" in ptx,
                      "dynamic_shared_bytes": dynamic_bytes}
            report.update({op: ptx.count(op) for op in COUNTED})
            if ptxas:
                report.update(ptxas_report(ptxas, ptx, cc))
            dynamic_limit = (MMA_SHARED_MEMORY_BYTES if name.startswith("mma_") else
                             HOPPER_SHARED_MEMORY_BYTES if name.startswith("hopper_") else
                             OPT_IN_SHARED_BYTES.get(cc, SHARED_MEMORY_BYTES))
            failed += report["local_memory"] or report.get("spill_bytes", 0) > 0 or \
                "ptxas_error" in report or \
                report.get("shared_bytes", 0) > SHARED_MEMORY_BYTES or \
                dynamic_bytes > dynamic_limit or \
                (name.startswith("hopper_") and bool(report.get("ptxas_warnings")))
            print(json.dumps(report), flush=True)
            if args.save:
                os.makedirs(args.save, exist_ok=True)
                with open(os.path.join(args.save, f"{name}_sm{cc}.ptx"), "w") as f:
                    f.write(ptx)
    if not ptxas and not args.list:
        print("no ptxas found: registers and spills not checked", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
