#!/usr/bin/env bash
# The whole GPU verification of the CUDA emit path, in one go, on a machine with an NVIDIA GPU:
#   1. build libaiospec_cuda.so for sm_90 (aiospec.ops._build, the cache the library uses) and
#      the self-checking driver csrc/cuda/tools/emit_check.cu (against the CPU writer);
#   2. run the driver: byte identity with the CPU writer across wrap-arounds, every error
#      reported as the CPU writer reports it, ring full, CUDA graph replay;
#   3. pytest -m gpu tests/test_ops_cuda.py;
#   4. compute-sanitizer --tool memcheck on the driver (valid and invalid inputs alike must
#      never touch memory out of bounds), and racecheck / synccheck on a shorter run;
#   5. scripts/bench_emit.py, the JSON into $OUT/bench_emit.json. It raises kernel.msgmax /
#      msgmnb for the FastDeploy-style baseline when it runs as root (FastDeploy's own advice),
#      unless RAISE_MSGMAX=0.
#   6. "multi": scripts/gpu_multi.py --device cuda, the JSON into $OUT/gpu_multi.json: a PD pair
#      and two ranks of one engine, one producer process per GPU (both on GPU 0 when only one
#      is visible; the JSON's layout says which ran), one Hub in a third process. MULTI_ARGS
#      adds arguments to it.
# Optional stage "variants": rebuilds the driver with each measurement switch of
# csrc/cuda/emit_kernel.cuh and times them (docs/benchmarks.md).
# $OUT (default /tmp/aiospec-gpu-check) gets summary.log, bench_emit.json and logs.tgz (every
# stage's log). Every stage runs even when an earlier one failed; the exit status is the
# number of failed stages. Stages can be picked: gpu_check.sh build driver tests sanitize
# multi variants bench (default: all but variants). BENCH_ARGS adds arguments to the benchmark.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/aiospec-gpu-check}"
LOGS=$(mktemp -d /tmp/gpu_check.XXXXXX)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export AIOSPEC_CACHE_DIR="${AIOSPEC_CACHE_DIR:-/tmp/aiospec-cache}"
export AIOSPEC_CUDA_ARCH="${AIOSPEC_CUDA_ARCH:-90}"
STAGES="${*:-build driver tests multi sanitize bench}"
DRIVER=/tmp/aiospec_emit_check
failed=0
summary=()

has() { [[ " $STAGES " == *" $1 "* ]]; }

stage() {  # stage NAME SECONDS COMMAND...: run (killed after SECONDS), log to $LOGS/NAME.log
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "=== $name: $*"
  timeout -k 10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$LOGS/$name.log"
  summary+=("$name: rc=$rc, $((SECONDS - t0)) s")
  if [[ $rc -ne 0 ]]; then failed=$((failed + 1)); fi
  return $rc
}

{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1
  nvcc --version 2>&1 | tail -n 1
  python3 -c 'import sys, numpy, pytest; print(sys.version.split()[0], "numpy", numpy.__version__, "pytest", pytest.__version__)'
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
  python3 -c 'import msgspec; print("msgspec", msgspec.__version__)' 2>&1
  df -h /dev/shm | tail -n 1
  echo "msgmax $(cat /proc/sys/kernel/msgmax) msgmnb $(cat /proc/sys/kernel/msgmnb)"
} > "$LOGS/env.log" 2>&1
cat "$LOGS/env.log"

build_library() {
  python3 -c 'from aiospec.ops import _cuda; print(_cuda.load_library()._name)'
}
if has build; then
  build_library > "$LOGS/build_lib.log" 2>&1 &
  lib_pid=$!
  stage build_driver 300 nvcc -arch=sm_90 -O2 -lineinfo -std=c++17 -Icsrc/include -Ishm/include csrc/cuda/tools/emit_check.cu \
    csrc/cuda/emit_cuda.cu csrc/cpu/emit_cpu.cc -o "$DRIVER"
  wait $lib_pid
  rc=$?
  tail -n 20 "$LOGS/build_lib.log"
  summary+=("build_lib: rc=$rc")
  if [[ $rc -ne 0 ]]; then failed=$((failed + 1)); fi
fi

if has driver; then
  stage driver 120 "$DRIVER" "${DRIVER_ITERS:-200}"
fi

if has tests; then
  stage tests 420 python3 -m pytest -p no:cacheprovider -v -rs -m gpu --junitxml="$LOGS/tests.xml" tests/test_ops_cuda.py \
    tests/test_integrations_fastdeploy.py
fi

if has multi; then
  # shellcheck disable=SC2086
  stage multi "${MULTI_TIMEOUT:-540}" python3 scripts/gpu_multi.py --device cuda --json "$OUT/gpu_multi.json" \
    ${MULTI_ARGS:-}
  summary+=("  $(tail -n 1 "$LOGS/multi.log")")
fi

if has sanitize; then
  if command -v compute-sanitizer > /dev/null; then
    stage memcheck 300 compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 "$DRIVER" 40
    stage racecheck 200 compute-sanitizer --tool racecheck --error-exitcode 9 "$DRIVER" 8
    stage synccheck 200 compute-sanitizer --tool synccheck --error-exitcode 9 "$DRIVER" 8
  else
    echo "compute-sanitizer not found" | tee "$LOGS/memcheck.log"
    summary+=("memcheck: compute-sanitizer not found")
    failed=$((failed + 1))
  fi
fi

if has variants; then
  # measurement builds of the driver (AIOSPEC_FENCE_MODE, AIOSPEC_THREADS in
  # emit_kernel.cuh): GPU time per emit for each, rows per block 4..32 for the default
  build_variant() {  # NAME FLAGS...
    local name=$1
    shift
    nvcc -arch=sm_90 -O2 -std=c++17 -Icsrc/include -Ishm/include "$@" csrc/cuda/tools/emit_check.cu csrc/cuda/emit_cuda.cu \
      csrc/cpu/emit_cpu.cc -o "$DRIVER.$name"
  }
  build_variant f0 -DAIOSPEC_FENCE_MODE=0 &
  build_variant f1 -DAIOSPEC_FENCE_MODE=1 &
  build_variant f3 -DAIOSPEC_FENCE_MODE=3 &
  build_variant t128 -DAIOSPEC_THREADS=128 &
  build_variant t512 -DAIOSPEC_THREADS=512 &
  wait
  variants() {
    echo "## default build (fence mode 2, 256 threads), rows per block 4 8 16 32"
    "$DRIVER" time 4 8 16 32
    for v in f0 f1 t128 t512; do
      echo "## $v"
      "$DRIVER.$v" time 8
      "$DRIVER.$v" 60 | tail -n 1
    done
    echo "## f3: no fences, a lower bound"
    "$DRIVER.f3" time 8
  }
  export DRIVER
  stage variants 300 bash -c "$(declare -f variants); variants"
fi

if has bench; then
  raise=()
  if [[ "${RAISE_MSGMAX:-1}" == 1 && $(id -u) == 0 ]]; then raise=(--raise-msgmax); fi
  # shellcheck disable=SC2086
  stage bench "${BENCH_TIMEOUT:-540}" python3 scripts/bench_emit.py --device cuda ${raise[@]+"${raise[@]}"} \
    --json "$OUT/bench_emit.json" ${BENCH_ARGS:-}
fi

echo "=== summary"
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.log"
tar -C "$LOGS" -czf "$OUT/logs.tgz" .
exit $failed
