#!/usr/bin/env bash
# A commit's importable tree, for judging a change against the tree before it in one GPU run
# (bench_compare.sh OLD_TREE NEW_TREE, or any script run with the tree first on PYTHONPATH).
#
#   bash scripts/tree_at.sh COMMIT DIR     # on the CPU machine, in the checkout
#   bash scripts/tree_at.sh 070d871 .trees/old && bash scripts/tree_at.sh HEAD .trees/new
#   # then on the GPU machine (carry [".whl", ".trees"]), after its setup (gpu_check.sh's):
#   BENCH=bench_variants.py bash scripts/bench_compare.sh .trees/old .trees/new --rows mask_mod
#
# DIR gets numba_flash/ as the installed package lays it out (backends/ inside it, as
# setup.cfg's package_dir maps it) and the commit's scripts/, from `git archive`: no build, no
# pip, so DIR can be carried to the GPU machine (run's carry, e.g. ".trees") beside the working
# tree. There, from the working tree's root:
#
#   PYTHONPATH=$PWD/DIR:/tmp/site python3 DIR/scripts/bench.py ...
#
# (a script's own folder comes first on sys.path, then PYTHONPATH: `python3 -c` or `-m` from
# the repository root would import the working tree's numba_flash instead.)
set -euo pipefail
commit=$1 dir=$2
if ! git rev-parse --verify --quiet "$commit^{commit}" > /dev/null; then
    echo "no commit $commit" >&2
    exit 2
fi
top=$(git rev-parse --show-toplevel)
rm -rf "$dir"
mkdir -p "$dir"
git -C "$top" archive --format=tar "$commit" numba_flash backends scripts | tar -x -C "$dir"
mv "$dir/backends" "$dir/numba_flash/backends"
git rev-parse --short "$commit" > "$dir/COMMIT"
echo "$dir: numba_flash of $(cat "$dir/COMMIT")"
