#!/usr/bin/env bash
# A change judged against the tree before it, in one GPU run: each tree's own scripts/bench.py,
# one after the other on the same machine, after both trees' kernels are compiled.
#
#   bash scripts/bench_compare.sh OLD_TREE NEW_TREE [bench.py arguments]
#   BENCH=bench_variants.py bash scripts/bench_compare.sh OLD_TREE NEW_TREE [its arguments]
#
# A TREE is a folder with an importable numba_flash and its scripts/ (of a commit:
# scripts/tree_at.sh COMMIT TREE on the CPU machine, then carry TREE). The trees'
# kernels are first compiled into their on-disk caches by small runs of the same cases, side by
# side (one process per dtype and head dim), so that the timed runs compile nothing. The old
# tree runs without torch's peers; PEERS (an environment variable, e.g. "--sdpa flash cudnn",
# default "--no-torch") goes to the new tree's run only, so that the peers are timed once,
# beside the new tree. BACKEND (default numba) is the backend compared: both trees run it alone
# (give the same --backends to bench.py). Logs and JSON land in $OUT as bench_old.*,
# bench_new.*, and scripts/bench_diff.py prints the new tree's TFLOP/s against the old's, row
# by row. BENCH=bench_variants.py compares the variant rows instead (PEERS then e.g.
# "--flex"): this checkout's bench_variants.py runs for both trees (the same rows, timed
# alike), the two processes side by side, each row compiled by its first call and then timed
# holding a lock file ($OUT/gpu.lock; harness.gpu_turn), so that the trees time in turns. A
# row's first call in one process may land among the other's timed calls (medians of up to
# 60 rounds).
set -uo pipefail
old=$1 new=$2
shift 2
backend=${BACKEND:-numba}
bench=${BENCH:-bench.py}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# the dtypes and head dims of the cases, for the warm-up runs
dtypes=$(python3 - "$@" <<'EOF'
import sys
args, picked, key = sys.argv[1:], {"--dtypes": [], "--head-dims": []}, None
for a in args:
    key = a if a.startswith("--") else key
    if not a.startswith("--") and key in picked:
        picked[key].append(a)
print(" ".join(f"{d}:{h}" for d in picked["--dtypes"] or ["float32", "float16"]
               for h in picked["--head-dims"] or ["64", "128"]))
EOF
)
warm() {  # tree, dtype:head_dim -- the same cases at a tiny size, nothing timed that counts
    local tree=$1 dtype=${2%:*} head_dim=${2#*:}
    PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} timeout 600 python3 "$tree/scripts/bench.py" \
        --dtypes "$dtype" --head-dims "$head_dim" --seqlens 128 --tokens 128 \
        --causal false true --passes fwd fwdbwd --backends "$backend" --no-torch > /dev/null 2>&1 \
        || echo "warm-up $tree $dtype d$head_dim: exit $?"
}
timed() {  # side (old/new), then the bench's extra arguments: its run, log and JSON in $OUT
    local side=$1 tree=$old script extra=(--no-torch)
    shift
    if [ "$side" = new ]; then tree=$new; read -ra extra <<< "${PEERS:---no-torch}"; fi
    script="$tree/scripts/$bench"
    [ "$bench" = bench.py ] || script="$(dirname "$0")/$bench"
    PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} python3 "$script" "${args[@]}" "${extra[@]}" \
        "$@" --json "$OUT/bench_$side.json" 2>&1 | grep -v '^\[' > "$OUT/bench_$side.log"
    tail -3 "$OUT/bench_$side.log"
}
args=("$@")
start=$(date +%s)
if [ "$bench" = bench.py ]; then
    for tree in "$old" "$new"; do
        for case in $dtypes; do warm "$tree" "$case" & done
    done
    wait
    echo "warm-up (compilation) of both trees: $(( $(date +%s) - start )) s"
    timed old
    timed new
else
    # A mask_mod's kernels have no disk cache, so a warm-up in another process would not
    # spare the timed one its compilation: the two trees' runs go side by side, each row
    # compiled by its first call without the lock, then timed holding it.
    rm -f "$OUT/gpu.lock"
    timed old --lock "$OUT/gpu.lock" &
    timed new --lock "$OUT/gpu.lock" &
    wait
    echo "both trees, side by side: $(( $(date +%s) - start )) s"
fi
python3 "$(dirname "$0")/bench_diff.py" "$OUT/bench_old.json" "$OUT/bench_new.json" \
    --backend "$backend" \
    | tee "$OUT/bench_diff.log"
