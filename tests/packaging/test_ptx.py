"""The Numba kernels compile for sm_80 and sm_90 (the Hopper family's for sm_90a) without a
GPU (libNVVM from pip) with the instructions the design relies on, no local memory, no
register spills, at most 48 KiB of static shared memory (ptxas -v, from the `test` extra) and
at most 99 KiB of dynamic shared memory for the tensor-core kernels; the SIMT kernels' configs
for each target may take what a block may have there.

The matrix of kernels (RUNS) is about 250 kernels of 5-12 s of one CPU core each. A test run
builds the kernels in ALWAYS and a sample of about a fifth of the others from each run, drawn
with a seed from the checked-out commit (so that each commit checks a different share, and a
run of one commit is repeatable): NUMBA_FLASH_PTX_SEED=N draws another, NUMBA_FLASH_PTX_ALL=1
builds them all (about half an hour on two cores: do it before landing a kernel change).
"""
import json
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "ptx_check.py"
OPT_IN_SHARED_BYTES = {"80": 163 * 1024, "90": 227 * 1024}  # per block, as in ptx_check.py
# sm_90 for the head dims that matter most, sm_80 for d128 (where the kernels come nearest
# their limits); the other config buckets once. The
# float16 and bfloat16 tensor-core kernels differ only in their mma and packing instructions
# (ptxas gives them the same registers), so each architecture builds one of the two: that
# halves the slowest compilations in CI. Likewise the SIMT kernels for bfloat16 differ from
# float16's only in how elements are decoded and encoded: built in the third run.
MMA_DTYPE = {80: "float16", 90: "bfloat16"}
RUNS = [["--cc", "80", "--head-dims", "128", "--dtypes", "float16", "float32",
         "--mma-dtypes", MMA_DTYPE[80]],  # (sm_80: the head dim nearest the limits)
        ["--cc", "90", "--head-dims", "64", "128", "--dtypes", "float16", "float32",
         "--mma-dtypes", MMA_DTYPE[90]],
        ["--cc", "90", "--head-dims", "32", "256", "--dtypes", "float32", "bfloat16",
         "--mma-dtypes", MMA_DTYPE[90], "--causal-only"],  # (the full ones are the others')
        # every variant at once, at the head dim and dtypes nearest the register limit
        ["--cc", "90", "--head-dims", "128", "--dtypes", "float32", "--mma-dtypes",
         MMA_DTYPE[90], "--variants"],
        # and the tensor-core backward's at d64 on sm_80, where the dQ kernel's loop over its
        # wider key tiles must still unroll
        ["--cc", "80", "--head-dims", "64", "--dtypes", "float16", "--mma-dtypes",
         MMA_DTYPE[80], "--variants", "--only", "mma_bwd"],
        # the split-KV decode family (KV-cache attention): every dtype at d128, the other
        # head dims' register tiles once
        ["--cc", "90", "--head-dims", "128", "--dtypes", "float16", "bfloat16", "float32",
         "--decode"],
        ["--cc", "80", "--head-dims", "128", "--dtypes", "float16", "--decode"],
        ["--cc", "90", "--head-dims", "64", "256", "--dtypes", "float16", "--decode"],
        # the Hopper family, for sm_90a: every head dim in float16, every variant at d128 in
        # bfloat16 (the two differ in their wgmma and packing instructions only)
        ["--hopper", "--head-dims", "64", "128", "256", "--mma-dtypes", "float16"],
        ["--hopper", "--head-dims", "128", "--mma-dtypes", "bfloat16", "--variants"]]


#: built in every test run: the kernels whose instruction counts and registers the tests
#: below pin, and some of those nearest their limits (255 registers, as ptxas gave them on
#: 2026-12-07; the Hopper variants' and masks' kernels, where a ptxas warning would show first)
ALWAYS = {("mma_forward_d128_full_f16", 80), ("mma_bwd_dk_dv_d128_causal_f16", 80),
          ("mma_forward_d64_causal_bf16", 90), ("mma_bwd_dq_d64_causal_bf16", 90),
          ("mma_contiguous_bwd_dk_dv_d64_causal_bf16", 90),
          ("mma_bwd_dk_dv_d128_mask_mod_bf16", 90), ("mma_forward_d128_variants_bf16", 90),
          ("forward_d128_causal_float32_async", 90),
          ("decode_mma_d256_plain_paged_float16", 90),
          *((f"hopper_forward_d{head_dim}_{causal}_f16", "90a")
            for head_dim in (64, 128, 256) for causal in ("full", "causal")),
          ("hopper_forward_d128_bool_masked_bf16", "90a"),
          ("hopper_bwd_dk_dv_d128_variants_bf16", "90a"),
          ("hopper_bwd_dq_d128_mask_mod_varlen_bf16", "90a"),
          ("hopper_bwd_dk_dv_d64_causal_f16", "90a")}
SAMPLED_SHARE = 0.2
TIMEOUT_S = 2400  # (one ptx_check run, from its start)
ENV = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")


def _workers():
    return max(1, min(len(RUNS), os.cpu_count() or 1))


def _list(args):
    run = subprocess.run([sys.executable, str(SCRIPT), *args, "--list"], env=ENV, text=True,
                         capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return [(r["kernel"], r["cc"]) for r in map(json.loads, run.stdout.splitlines())]


@pytest.fixture(scope="module")
def matrix():
    """Every kernel of every run, listed (not built): [[(name, cc)] per run]."""
    with ThreadPoolExecutor(_workers()) as pool:
        return list(pool.map(_list, RUNS))


def listed(matrix):
    """Every (name, cc) of the matrix, as one set."""
    return {kernel for kernels in matrix for kernel in kernels}


def seed():
    """NUMBA_FLASH_PTX_SEED, else the checked-out commit's hash (0 outside a git checkout)."""
    if os.environ.get("NUMBA_FLASH_PTX_SEED"):
        return int(os.environ["NUMBA_FLASH_PTX_SEED"])
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True)
    return int(head.stdout[:8], 16) if head.returncode == 0 else 0


def chosen(kernels, rng):
    """The names of one run's kernels to build: ALWAYS's, and a share of the others (at least
    one)."""
    others = [kernel for kernel in kernels if kernel not in ALWAYS]
    picked = set(rng.sample(others, min(len(others),
                                        max(1, round(SAMPLED_SHARE * len(others))))))
    return [kernel[0] for kernel in kernels if kernel in ALWAYS or kernel in picked]


def _build(args, names):
    run = subprocess.run([sys.executable, str(SCRIPT), *args, "--names", *names], env=ENV,
                         text=True, capture_output=True, timeout=TIMEOUT_S)
    assert run.returncode in (0, 1), run.stderr[-3000:]
    assert "no ptxas found" not in run.stderr, "install the test extra (it brings ptxas)"
    return [json.loads(line) for line in run.stdout.splitlines()]


@pytest.fixture(scope="module")
def reports(matrix):
    """ptx_check's reports of the kernels chosen from each run, built a few runs at a time
    (each is a single-threaded compilation)."""
    if os.environ.get("NUMBA_FLASH_PTX_ALL") == "1":
        names = [[name for name, _ in kernels] for kernels in matrix]
    else:
        drawn = seed()
        print(f"ptx_check sample: NUMBA_FLASH_PTX_SEED={drawn}")  # (shown if a test fails)
        rng = random.Random(drawn)
        names = [chosen(kernels, rng) for kernels in matrix]
    with ThreadPoolExecutor(_workers()) as pool:
        found = [r for run in pool.map(_build, RUNS, names) for r in run]
    assert len(found) == sum(map(len, names)), "a chosen kernel was not built"
    return found


def test_the_always_built_kernels_are_in_the_matrix(matrix):
    assert ALWAYS <= listed(matrix), ALWAYS - listed(matrix)


def test_the_sample_changes_with_the_seed(matrix):
    """Different commits check different kernels; the same commit the same ones."""
    draws = [[chosen(kernels, random.Random(s)) for kernels in matrix] for s in (1, 2, 1)]
    assert draws[0] == draws[2] and draws[0] != draws[1]
    assert all(len(kernels) > len(names) for kernels, names in zip(matrix, draws[0])
               if len(kernels) > 2)


def test_every_kernel_is_in_the_matrix(matrix):
    seen = listed(matrix)
    for cc in (80, 90):
        for head_dim in (64, 128) if cc == 90 else (128,):
            for causal in ("full", "causal"):
                for dtype in ("float16", "float32_async"):  # (float32: cp.async on sm_80+)
                    for kind in ("forward", "bwd_dk_dv", "bwd_dq"):
                        assert (f"{kind}_d{head_dim}_{causal}_{dtype}", cc) in seen
                dtype = {"float16": "f16", "bfloat16": "bf16"}[MMA_DTYPE[cc]]
                for kind in ("mma_forward", "mma_bwd_dk_dv", "mma_bwd_dq"):
                    assert (f"{kind}_d{head_dim}_{causal}_{dtype}", cc) in seen
    for head_dim in (32, 256):
        for dtype in ("float32_async", "bfloat16"):
            for kind in ("forward", "bwd_dk_dv", "bwd_dq"):
                assert (f"{kind}_d{head_dim}_causal_{dtype}", 90) in seen
        for kind in ("mma_forward", "mma_bwd_dk_dv", "mma_bwd_dq"):
            assert (f"{kind}_d{head_dim}_causal_bf16", 90) in seen


def test_the_variant_kernels_are_in_the_matrix(matrix):
    """GQA, a causal window, softcap, ALiBi and varlen at once (ptx_check.VARIANTS), the
    same with a floating attn_mask instead of varlen (ptx_check.MASKED), and a document
    mask_mod with causal, softcap and GQA (ptx_check.MASK_MODDED), at head dim 128, where the
    dense kernels come nearest to 255 registers (the tensor-core backward's also at d64 on
    sm_80, where its dQ kernel's loop over 64-key tiles must unroll): the checks below hold
    for them too."""
    seen = listed(matrix)
    for kind in ("forward", "bwd_dk_dv", "bwd_dq"):
        for variants in ("variants", "masked", "mask_mod"):
            assert (f"{kind}_d128_{variants}_float32_async", 90) in seen
            assert (f"mma_{kind}_d128_{variants}_bf16", 90) in seen
            if kind != "forward":
                assert (f"mma_{kind}_d64_{variants}_f16", 80) in seen


def test_the_decode_kernels_are_in_the_matrix(matrix):
    seen = listed(matrix)
    for cc in (80, 90):
        for dtype in ("float16", "bfloat16", "float32"):
            if cc == 80 and dtype != "float16":
                continue
            for head_dim in (128,) if cc == 80 or dtype != "float16" else (64, 128, 256):
                # (plain loads: unaligned caches)
                assert (f"decode_d{head_dim}_plain_contiguous_{dtype}_keys", cc) in seen
                for kind in ("plain", "variants"):
                    for layout in ("contiguous", "paged"):
                        assert (f"decode_d{head_dim}_{kind}_{layout}_{dtype}_async_keys",
                                cc) in seen  # (the warps splitting the keys: one token)
                # (many rows: chunked prefill, speculative tokens)
                assert (f"decode_d{head_dim}_plain_contiguous_{dtype}_async_rows", cc) in seen
                assert (f"decode_d{head_dim}_variants_paged_{dtype}_async_rows", cc) in seen
                if dtype != "float32":  # (the tensor-core kernel)
                    for kind in ("plain", "variants"):
                        for layout in ("contiguous", "paged"):
                            assert (f"decode_mma_d{head_dim}_{kind}_{layout}_{dtype}",
                                    cc) in seen
            assert (f"decode_combine_d128_{dtype}", cc) in seen
            for layout in ("contiguous", "paged"):
                assert (f"decode_append_{layout}_{dtype}", cc) in seen


def test_the_hopper_kernels_are_in_the_matrix(matrix):
    seen = {name for name, cc in listed(matrix) if cc == "90a"}
    for head_dim in (64, 128, 256):
        for causal in ("full", "causal"):
            assert f"hopper_forward_d{head_dim}_{causal}_f16" in seen
    for head_dim in (64, 128):  # the backward (dK/dV: Sᵀ, dPᵀ, dV, dK; dQ: S, dP, dQ)
        for kind in ("dk_dv", "dq"):
            for causal in ("full", "causal"):
                assert f"hopper_bwd_{kind}_d{head_dim}_{causal}_f16" in seen
    # (masks: their smaller tiles; a mask_mod without GQA: wider dK/dV tiles than with it)
    for variants in ("variants", "masked", "mask_mod", "mask_mod_mha", "mask_mod_varlen"):
        for kernel in ("forward", "bwd_dk_dv", "bwd_dq"):
            assert f"hopper_{kernel}_d128_{variants}_bf16" in seen
    # where blocks are few (hopper/grids.py): a split group's dK/dV kernel, the tiles along
    # grid.y, and the sums of the parts
    for name in ("hopper_forward_d64_causal_f16_queries_slowest",
                 "hopper_forward_d128_mask_mod_bf16_queries_slowest",
                 "hopper_bwd_dk_dv_d128_variants_bf16_split2_keys_slowest",
                 "hopper_bwd_dk_dv_d64_causal_f16_split1_keys_slowest",
                 "hopper_bwd_dq_d64_causal_f16_queries_slowest",
                 "hopper_forward_d128_bool_masked_bf16",
                 "bwd_group_sums_d128_bfloat16_varlen"):
        assert name in seen


def test_the_hopper_kernels_compiled_for_sm_90a(reports):
    """The forward and the backward: wgmma products from the PTX on, register reallocation for
    the two roles, the mbarrier pipeline fed by the copy engine (varlen's kernels, the
    "variants" spec and "mask_mod_varlen", narrowing each sequence's maps to its rows) or
    cp.async (d64's backward of a mask_mod with GQA and varlen), and no ptxas warning (C7508:
    setmaxnreg ignored; C7512, C7513, C7515: wgmma serialised): a warning fails here."""
    found = {r["kernel"]: r for r in reports if r["cc"] == "90a"}
    # D/16 + block_n/16 per tile, written twice where the consumers take turns (the first
    # tile's S and the last tile's P V stand apart from the loop's products): d256 does not
    for head_dim, products in ((64, 24), (128, 32), (256, 20)):
        for causal in ("full", "causal"):
            assert found[f"hopper_forward_d{head_dim}_{causal}_f16"]["wgmma.mma_async"] == \
                products
    # a boolean mask on the forward's plain tiles and turns (hopper/config.py): as many
    # products as the plain kernel
    assert found["hopper_forward_d128_bool_masked_bf16"]["wgmma.mma_async"] == \
        found["hopper_forward_d128_causal_f16"]["wgmma.mma_async"]
    for name, r in found.items():
        if name.startswith("bwd_group_sums"):  # (plain loads and stores: no pipeline)
            continue
        # (a mask_mod with GQA and varlen: its backward on cp.async; the variants spec is
        # varlen too)
        varlen = "_variants_" in name or "_varlen_" in name
        copy_engine = not (name.startswith("hopper_bwd_") and "_mask_mod_varlen_" in name)
        copies = r["cp.async.bulk.tensor"] if copy_engine else r["cp.async.cg"]
        assert r["wgmma.mma_async"] > 0 and r["setmaxnreg"] == 2, r
        assert r["mbarrier.try_wait"] > 0 and copies > 0, r
        assert r["cp.async.bulk.tensor" if not copy_engine else "cp.async.cg"] == 0, r
        assert (r["tensormap.replace.tile.global_dim"] > 0) == (varlen and copy_engine), r
        assert r["ptxas_warnings"] == [], (name, r["ptxas_warnings"])


def test_ptxas_accepted_every_kernel(reports):
    errors = [(r["kernel"], r["cc"], r["ptxas_error"]) for r in reports if "ptxas_error" in r]
    assert not errors, errors


def test_no_local_memory_and_no_spills(reports):
    bad = [(r["kernel"], r["cc"], r.get("spill_bytes")) for r in reports
           if r["local_memory"] or r["spill_bytes"] > 0]
    assert not bad, f"kernels using local memory or spilling registers: {bad}"


def test_shared_memory_fits(reports):
    bad = [(r["kernel"], r["cc"], r["shared_bytes"]) for r in reports
           if r["shared_bytes"] > 48 * 1024]
    assert not bad, f"over 48 KiB of static shared memory: {bad}"
    bad = [(r["kernel"], r["cc"], r["dynamic_shared_bytes"]) for r in reports
           if r["dynamic_shared_bytes"] > (99 * 1024 if r["kernel"].startswith("mma_")
                                           else OPT_IN_SHARED_BYTES[str(r["cc"])[:2]])]
    assert not bad, f"over the dynamic shared memory a block may have: {bad}"
    assert all(r["dynamic_shared_bytes"] > 0 for r in reports if r["kernel"].startswith("mma_"))


def test_instructions_present(reports):
    for r in reports:
        name = r["kernel"]
        if name.startswith("bwd_delta") or name.startswith("bwd_group_sums") or \
                name.startswith("decode_combine") or \
                name.startswith("decode_append") or name.startswith("hopper_"):  # (hopper:
            continue  # test_the_hopper_kernels_compiled_for_sm_90a)
        if name.startswith("decode_mma_"):  # tensor cores fed by ldmatrix and cp.async
            assert r["mma.sync"] > 0 and r["ldmatrix"] > 0 and r["cp.async.cg"] > 0, r
            assert r["bar.sync"] > 0 and r["ex2.approx"] > 0, r
            continue
        if name.startswith("decode_"):  # 16-byte reads of the key tiles, cp.async in _async
            assert r["bar.sync"] > 0 and r["ex2.approx"] > 0 and r["fma.rn.f32"] >= 16, r
            assert r["ld.shared.v4"] > 0 and (r["cp.async.cg"] > 0) == ("_async" in name), r
            continue
        assert r["bar.sync"] > 0 and r["ex2.approx"] > 0, r
        if name.startswith("mma_"):  # tensor cores fed by ldmatrix and cp.async
            assert r["mma.sync"] > 0 and r["ldmatrix"] > 0 and r["cp.async.cg"] > 0, r
        else:  # register-tiled FMAs fed by 16-byte shared loads
            assert r["fma.rn.f32"] >= 16 and r["ld.shared.v4.f32"] > 0, r
            # tiles copied by cp.async exactly in the forward's _async variants
            assert (r["cp.async.cg"] > 0) == ("_async" in name), r


# (kernel name prefix, compute capability or None for both): most registers allowed. With
# every ldmatrix address hoisted into a register of its own, as before the ldmatrix_x4_at
# reads, these kernels needed about 246 and 182 (docs/KERNEL_NOTES.md). (The d128 forward's
# two-slice config takes 254 registers either way: only the spill check holds it.)
REGISTER_CAPS = {("mma_forward_d64", None): 235, ("mma_bwd_dq_d64", 90): 175,
                 # three blocks of 128 threads per multiprocessor (below, two): 9 % of the
                 # causal d64 backward's speed on the H200 (docs/PERFORMANCE.md, 2026-12-01)
                 ("mma_contiguous_bwd_dk_dv_d64", 90): 168}


def test_register_caps(reports):
    """In their key-tile loops the tensor-core kernels read at a per-tile base plus constant
    offsets (intrinsics.opaque); a compiler that hoisted every address again would show here.
    And the d64 dK/dV kernel keeps the registers that let three blocks share a
    multiprocessor."""
    for (prefix, cc), cap in REGISTER_CAPS.items():
        found = [r for r in reports if r["kernel"].startswith(prefix) and cc in (None, r["cc"])]
        assert found and all(r["registers"] <= cap for r in found), [
            (r["kernel"], r["cc"], r["registers"]) for r in found]
