"""scripts/bench_diff.py, which judges a change against the tree before it from two benches'
JSON: bench.py's rows and bench_variants.py's, matched row by row, a row below the tolerance
or missing from the new file flagged (exit 1)."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_diff.py"


def diff(tmp_path, old, new):
    paths = []
    for name, rows in (("old", old), ("new", new)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(rows))
    run = subprocess.run([sys.executable, str(SCRIPT), *map(str, paths)], capture_output=True,
                         text=True, timeout=60)
    return run.returncode, run.stdout


def bench_row(passes, causal, tflops):
    return {"passes": passes, "dtype": "float16", "headdim": 64, "seqlen": 4096,
            "causal": causal, "results": {"numba": {"tflops": tflops}}}


def variants_row(passes, name, tflops):
    return {"passes": passes, "row": name, "numba": {"tflops": tflops, "ms": 1.0},
            "flash": {"tflops": 2 * tflops, "ms": 0.5}}


def test_bench_rows_matched_and_a_slower_row_flagged(tmp_path):
    old = [bench_row("fwd", True, 300.0), bench_row("fwd", False, 400.0)]
    code, out = diff(tmp_path, old, [bench_row("fwd", False, 404.0),
                                     bench_row("fwd", True, 270.0)])
    assert code == 1, out
    assert "| fwd | float16 | 64 | 4096 | full | 400.0 | 404.0 | 1.010 |" in out
    assert "| fwd | float16 | 64 | 4096 | causal | 300.0 | 270.0 | 0.900 **below** |" in out


def test_variant_rows_matched_by_name_and_a_missing_row_flagged(tmp_path):
    old = [variants_row("fwd", "mha causal", 500.0), variants_row("fwdbwd", "varlen", 200.0)]
    code, out = diff(tmp_path, old, [variants_row("fwd", "mha causal", 505.0)])
    assert code == 1, out
    assert "| fwd | mha causal | 500.0 | 505.0 | 1.010 |" in out
    assert "| fwdbwd | varlen | 200.0 | - | - **below** |" in out
    code, out = diff(tmp_path, old, [variants_row("fwdbwd", "varlen", 212.0),
                                     variants_row("fwd", "mha causal", 500.0)])
    assert code == 0, out
    assert "0 of 2 rows below" in out
