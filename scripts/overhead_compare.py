"""Host time per replayed call of two trees, alternated in one run (overhead.py --host-only).

    python scripts/overhead_compare.py OLD_TREE NEW_TREE [--rounds 3] [-- overhead.py options]

A TREE is a folder with an importable numba_flash, installed from a checkout with
`pip install --no-deps --no-build-isolation --target TREE .` (the tree before the redesign
also needs its backends/ copied beside it); the runs put it first on PYTHONPATH and start in
this scripts/ folder (from a checkout's root, its own numba_flash would be imported instead),
and the script stops if a run would not import the tree's. Each tree first runs once untimed
(its kernels compile), then each round runs this checkout's overhead.py --host-only once per
tree in fresh processes, the trees alternated. The table gives each row's median over the
rounds, and its median ratio to torch's SDPA forward timed in turns with it in the same
process: the host's speed of the GPU machines drifts by up to 2x from one process to the
next, so the ratio is what compares trees (column "by ctl": new/ctl over old/ctl); the log
has every round's values.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROW = re.compile(r"^(.*?)\s+([0-9.]+) us per call$")
#: the row both trees time with the same code (torch's own), by which each round's rows are
#: divided: the host's speed drifts by up to 2x between processes on the GPU machines
CONTROL = "sdpa forward"


def run(tree, command):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [tree] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return subprocess.run([sys.executable, *command], env=env, cwd=HERE, text=True,
                          capture_output=True)


def check_imports(tree):
    """Stop unless a process with the tree on PYTHONPATH imports the tree's numba_flash."""
    found = run(tree, ["-c", "import numba_flash; print(numba_flash.__file__)"]).stdout.strip()
    if not os.path.realpath(found).startswith(os.path.realpath(tree)):
        sys.exit(f"{tree}: a process with it first on PYTHONPATH imports "
                 f"{found or 'no numba_flash'}")


def host_times(tree, options):
    """{row: µs per call} of one overhead.py --host-only run."""
    result = run(tree, ["overhead.py", "--host-only", *options])
    if result.returncode:
        sys.exit(f"overhead.py failed with {tree}:\n{result.stdout}\n{result.stderr}")
    print(result.stdout, flush=True)
    return {m[1].strip(): float(m[2]) for m in map(ROW.match, result.stdout.splitlines()) if m}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=3)
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.options = argv[split + 1:]  # overhead.py's own options
    trees = {"old": args.old, "new": args.new}
    for tree in trees.values():
        check_imports(tree)
        host_times(tree, [*args.options, "--calls", "10"])  # (compilation: not counted)
    rounds = {side: [] for side in trees}
    for number in range(args.rounds):
        for side, tree in trees.items():
            print(f"== round {number + 1}, {side} ({tree})")
            rounds[side].append(host_times(tree, args.options))
    print(f"\nmedian of {args.rounds} rounds: us per call, and per call of the control "
          f"({CONTROL!r}, the same code in both trees, timed in turns with the rows)")
    print(f"{'row':34s} {'old':>8s} {'new':>8s} {'new/old':>8s} {'old/ctl':>8s} "
          f"{'new/ctl':>8s} {'by ctl':>8s}")
    for row in rounds["new"][0]:
        (old, old_ratio), (new, new_ratio) = (median_of(rounds[side], row)
                                              for side in ("old", "new"))
        print(f"{row:34s} {old:8.1f} {new:8.1f} {new / old:8.2f} {old_ratio:8.2f} "
              f"{new_ratio:8.2f} {new_ratio / old_ratio:8.2f}")
    return 0


def median_of(rounds, row):
    """The row's median µs over the rounds that have it, and its median ratio to the control
    in the same round (nan where no round has it)."""
    have = [r for r in rounds if row in r]
    if not have:
        return float("nan"), float("nan")
    return (statistics.median(r[row] for r in have),
            statistics.median(r[row] / r[CONTROL] for r in have if CONTROL in r)
            if any(CONTROL in r for r in have) else float("nan"))


if __name__ == "__main__":
    sys.exit(main())
