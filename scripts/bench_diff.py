"""The numba backend's TFLOP/s in two bench.py (or two bench_variants.py) JSON files, row by
row: new / old.

    python scripts/bench_diff.py OLD.json NEW.json [--backend numba] [--tolerance 0.03]

Rows are matched on (passes, dtype, head dim, seqlen, causal), bench_variants.py's on (passes,
row name); a ratio below 1 - tolerance is flagged. Exits 1 if any row is flagged or missing
from the new file.
"""
import argparse
import json
import sys


def rows_by_case(path, backend):
    with open(path) as f:
        rows = json.load(f)
    rows = rows.get("rows", rows) if isinstance(rows, dict) else rows
    if rows and "row" in rows[0]:  # (bench_variants.py: a row name, each label's results)
        return {(r["passes"], r["row"]): r.get(backend, {}).get("tflops") for r in rows}
    return {(r["passes"], r["dtype"], r["headdim"], r["seqlen"],
             "causal" if r["causal"] else "full"): r["results"].get(backend, {}).get("tflops")
            for r in rows}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--backend", default="numba")
    parser.add_argument("--tolerance", type=float, default=0.03)
    args = parser.parse_args(argv)
    old, new = rows_by_case(args.old, args.backend), rows_by_case(args.new, args.backend)
    flagged = 0
    heading = (["pass", "dtype", "d", "N", "mask"] if len(next(iter(old), ())) == 5
               else ["pass", "row"]) + ["old TFLOP/s", "new TFLOP/s", "new / old"]
    print("| " + " | ".join(heading) + " |")
    print("|" + "---|" * len(heading))
    for case in sorted(old, key=str):
        before, after = old[case], new.get(case)
        ratio = after / before if before and after else None
        bad = ratio is None or ratio < 1 - args.tolerance
        flagged += bad
        cells = [*case, f"{before:.1f}" if before else "-", f"{after:.1f}" if after else "-",
                 (f"{ratio:.3f}" if ratio else "-") + (" **below**" if bad else "")]
        print("| " + " | ".join(map(str, cells)) + " |")
    print(f"{flagged} of {len(old)} rows below {1 - args.tolerance:.2f}x or missing")
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
