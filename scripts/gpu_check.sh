#!/usr/bin/env bash
# One GPU check of the project, for the GPU machine (device tool): logs and JSON go to $OUT.
#   bash scripts/gpu_check.sh tests    # pytest -m gpu (intrinsics and tensor-core kernel first)
#   bash scripts/gpu_check.sh verify   # scripts/verify.py
#   bash scripts/gpu_check.sh bench    # scripts/bench.py, forward, fp32 + fp16, d64 + d128
#   bash scripts/gpu_check.sh api      # pytest -m gpu, the backend-level tests only
#   bash scripts/gpu_check.sh tune     # scripts/tune_mma.py, fwd + bwd, d64 + d128, N = 4096
#   bash scripts/gpu_check.sh sanitize # compute-sanitizer memcheck + racecheck on every kernel
#   bash scripts/gpu_check.sh reliability  # scripts/reliability.py repeat long jit
#   bash scripts/gpu_check.sh overhead # scripts/overhead.py: host time per call, with cProfile
#   bash scripts/gpu_check.sh decode   # forward_kvcache: pytest -m gpu tests/kvcache, memcheck of
#                                      # reliability.py sanitize-kvcache, scripts/bench_decode.py
#   bash scripts/gpu_check.sh ring     # ring_attention on one GPU: a world of one over NCCL,
#                                      # attention beside a copy on another stream
#   bash scripts/gpu_check.sh hopper   # the Hopper family (sm_90): its intrinsics and kernel
#                                      # tests, memcheck/racecheck/synccheck of reliability.py
#                                      # sanitize-hopper, bench.py (forward and forward +
#                                      # backward) beside numba-mma, flash, cuDNN
# Each stage fits one device call (under 10 minutes, JIT compilation included). The GPU
# machine's numba-cuda needs numpy < 2.5: carry a numpy 2.4 wheel in .whl/ (carry: [".whl"]).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 3
# pytest-xdist (on the GPU machine's image) compiles the kernels of different tests side by side.
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${PYTEST_WORKERS:-8}")
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
  # (the device's copy keeps an old HEAD: record the commit you sent yourself)
  echo "HEAD of the copy, not the tree sent: $(git rev-parse --short HEAD 2>/dev/null)"
} > "$OUT/env.txt"
status=0
for stage in "$@"; do
    case "$stage" in
        tests)
            timeout 560 python3 -m pytest $workers -m gpu -q -rs -p no:cacheprovider \
                tests/backends tests/api tests/device tests/kernels tests/gpu \
                2>&1 | tee "$OUT/gpu_tests.log" | tail -15 || status=1 ;;
        api)
            timeout 400 python3 -m pytest $workers -m gpu -q -rs -p no:cacheprovider \
                tests/gpu tests/api/test_torch.py 2>&1 | tee "$OUT/gpu_api.log" | tail -15 \
                || status=1 ;;
        tune)
            timeout 250 python3 scripts/tune_mma.py 2>&1 | tee "$OUT/tune_mma.log" || status=1 ;;
        sanitize)
            sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer \
                        2>/dev/null | head -1)
            if [ ! -x "$sanitizer" ]; then
                echo "compute-sanitizer not found" | tee "$OUT/sanitizer.log"; status=1; continue
            fi
            # The workload runs once without the sanitizer first, so that the kernels come
            # from Numba's on-disk cache under it (on a fresh machine this compilation takes
            # minutes). API errors are not reported: Numba's driver start-up probes
            # entry points with cuGetProcAddress, and each miss counts as one.
            timeout "${SANITIZE_WARMUP_TIMEOUT:-240}" python3 scripts/reliability.py sanitize \
                > /dev/null 2>&1
            for tool in memcheck racecheck; do
                echo "== compute-sanitizer --tool $tool" >> "$OUT/sanitizer.log"
                timeout "${SANITIZE_TIMEOUT:-200}" "$sanitizer" --tool "$tool" \
                    --report-api-errors no --error-exitcode 9 \
                    python3 scripts/reliability.py sanitize >> "$OUT/sanitizer.log" 2>&1 \
                    || { echo "compute-sanitizer $tool: exit $?" >> "$OUT/sanitizer.log"; status=1; }
                grep -E "SUMMARY|calls done|exit" "$OUT/sanitizer.log" | tail -3
            done ;;
        reliability)
            timeout "${RELIABILITY_TIMEOUT:-240}" python3 scripts/reliability.py repeat long jit 2>&1 \
                | tee "$OUT/reliability.log" || status=1 ;;
        overhead)
            (cd scripts && timeout 120 python3 overhead.py --profile) > "$OUT/overhead.log" 2>&1 \
                || status=1
            head -10 "$OUT/overhead.log" ;;
        decode)
            timeout 300 python3 -m pytest $workers -m gpu -q -rs -p no:cacheprovider \
                tests/kvcache 2>&1 | tee "$OUT/gpu_kvcache.log" | tail -8 || status=1
            sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer \
                        2>/dev/null | head -1)
            timeout 120 python3 scripts/reliability.py sanitize-kvcache > /dev/null 2>&1
            timeout 150 "$sanitizer" --tool memcheck --report-api-errors no --error-exitcode 9 \
                python3 scripts/reliability.py sanitize-kvcache > "$OUT/sanitizer_kvcache.log" \
                2>&1 || status=1
            tail -2 "$OUT/sanitizer_kvcache.log"
            # (BENCH_DECODE_ARGS: e.g. "--caches 8192 32768 --splits 16 64")
            timeout "${BENCH_TIMEOUT:-300}" python3 scripts/bench_decode.py \
                ${BENCH_DECODE_ARGS:-} --json "$OUT/bench_decode.json" 2>&1 \
                | tee "$OUT/bench_decode.log" || status=1 ;;
        ring)
            timeout 200 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/ring \
                2>&1 | tee "$OUT/gpu_ring.log" | tail -4 || status=1 ;;
        hopper)
            (cd tests/device && timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider \
                test_hopper_intrinsics.py) 2>&1 | tee "$OUT/hopper_intrinsics.log" | tail -2 \
                || status=1
            timeout 200 python3 -m pytest $workers -m gpu -q -p no:cacheprovider \
                tests/kernels/hopper 2>&1 | tee "$OUT/hopper_tests.log" | tail -2 || status=1
            sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer \
                        2>/dev/null | head -1)
            timeout 120 python3 scripts/reliability.py sanitize-hopper > /dev/null 2>&1
            for tool in memcheck racecheck synccheck; do
                echo "== compute-sanitizer --tool $tool" >> "$OUT/sanitizer_hopper.log"
                timeout 240 "$sanitizer" --tool "$tool" --report-api-errors no --error-exitcode 9 \
                    python3 scripts/reliability.py sanitize-hopper >> "$OUT/sanitizer_hopper.log" \
                    2>&1 || { echo "$tool: exit $?" >> "$OUT/sanitizer_hopper.log"; status=1; }
            done
            grep -E "SUMMARY|exit" "$OUT/sanitizer_hopper.log"
            (cd scripts && timeout "${BENCH_TIMEOUT:-360}" python3 bench.py --dtypes float16 \
                bfloat16 --head-dims 64 128 256 --seqlens 4096 16384 --causal false true \
                --passes fwd fwdbwd --backends numba-hopper numba-mma --sdpa flash cudnn \
                --json "$OUT/bench_hopper.json") 2>&1 | grep -v '^\[' \
                | tee "$OUT/bench_hopper.log" | tail -26 || status=1 ;;
        verify)
            timeout "${VERIFY_TIMEOUT:-560}" python3 scripts/verify.py ${VERIFY_ARGS:-} 2>&1 \
                | tee "$OUT/verify.log" \
                | grep -E "FAIL|N65536|passed" || status=1 ;;
        bench)
            timeout "${BENCH_TIMEOUT:-560}" python3 scripts/bench.py ${BENCH_ARGS:---dtypes \
                float32 float16 --head-dims 64 128 --seqlens 1024 4096 16384} \
                --json "$OUT/bench.json" --plot "$OUT/bench.png" \
                2>&1 | grep -v '^\[' | tee "$OUT/bench.log" || status=1 ;;
        *) echo "unknown stage $stage (tests, api, tune, sanitize, reliability, overhead, decode," \
                "ring, hopper, verify, bench)"; exit 2 ;;
    esac
done
exit $status
