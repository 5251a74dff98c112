#!/usr/bin/env bash
# The whole GPU verification of the CUDA emit path, in one go, on a machine with an NVIDIA GPU:
#   1. build libaiospec_cuda.so for sm_90 (aiospec.ops._build, the cache the library uses) and
#      the self-checking driver csrc/cuda/tools/emit_check.cu (against the CPU writer);
#   2. run the driver: byte identity with the CPU writer across wrap-arounds, every error
#      reported as the CPU writer reports it, ring full, CUDA graph replay, a reader at the
#      frontier that never sees the head before its commit word;
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
#   7. "probe": csrc/cuda/tools/emit_probe.cu, the bare probe (an empty kernel; N bytes written
#      into registered host memory with and without fences and a commit; cudaMemcpyAsync);
#      "timing": the driver's GPU time per emit (events around each, back to back, graph) and
#      the kernel's phase clocks (an AIOSPEC_PHASES build); "cold" times, each emit after a
#      kernel that evicts the L2, as in a decoding step, and two batches of small exchange
#      grids (64 and 100 rows x 6 tokens x top-5, every token an exception);
#      "ncu": Nsight Compute on the small and the 256 x 6 x 20 emit (the clocks left alone);
#      "roofline": scripts/bench_roofline.py with the driver and the probe built above, the
#      emit's GB/s per frame size (about 2 KB to 1 MB) against the probe's at the same sizes
#      and the link, the JSON into $OUT/roofline.json (with the tests stage, the run of
#      bench_roofline.py's GPU test, kept instead of a second run);
#   8. "step": scripts/bench_step.py, a decoding loop with a transformers Llama (random
#      weights) and six output paths (four in the step's stream, two on a side stream), the
#      JSON into $OUT/bench_step.json.
# The summary ends with each target of the GPU path, met or not met with its number.
# Optional stage "variants": rebuilds the driver with each measurement switch of
# csrc/cuda/emit_kernel.cuh and times them (docs/benchmarks.md); VARIANTS="pdl0 wc0" picks some.
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
STAGES="${*:-build driver tests timing probe roofline ncu sanitize bench step multi}"
DRIVER=/tmp/aiospec_emit_check
PROBE=/tmp/aiospec_emit_probe
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
# the driver (against the CPU writer), with measurement switches of emit_kernel.cuh if given:
# build_driver_bin OUT [FLAGS...]
build_driver_bin() {
  local out=$1
  shift
  nvcc -arch=sm_90 -O2 -std=c++17 -Icsrc/include -Ishm/include "$@" csrc/cuda/tools/emit_check.cu \
    csrc/cuda/emit_cuda.cu csrc/cpu/emit_cpu.cc -o "$out"
}
if has build; then
  build_library > "$LOGS/build_lib.log" 2>&1 &
  lib_pid=$!
  nvcc -arch=sm_90 -O2 -std=c++17 csrc/cuda/tools/emit_probe.cu -o "$PROBE" > "$LOGS/build_probe.log" 2>&1 &
  probe_pid=$!
  # the phase clocks of the kernel (AIOSPEC_PHASES), for the timing stage
  build_driver_bin "$DRIVER.phases" -DAIOSPEC_PHASES > "$LOGS/build_phases.log" 2>&1 &
  stage build_driver 300 bash -c "$(declare -f build_driver_bin); build_driver_bin \"\$0\" -lineinfo" "$DRIVER"
  wait $lib_pid
  rc=$?
  tail -n 20 "$LOGS/build_lib.log"
  summary+=("build_lib: rc=$rc")
  if [[ $rc -ne 0 ]]; then failed=$((failed + 1)); fi
  wait $probe_pid
  rc=$?
  tail -n 20 "$LOGS/build_probe.log"
  summary+=("build_probe: rc=$rc")
  if [[ $rc -ne 0 ]]; then failed=$((failed + 1)); fi
fi

if has driver; then
  stage driver 120 "$DRIVER" "${DRIVER_ITERS:-200}"
fi

if has tests; then
  # with the roofline stage too, the GPU test of bench_roofline.py (a whole run) leaves its JSON
  # there, and that stage does not run the script a second time
  if has roofline; then export AIOSPEC_ROOFLINE_JSON="$OUT/roofline.json"; rm -f "$OUT/roofline.json"; fi
  stage tests 420 python3 -m pytest -p no:cacheprovider -v -rs -m gpu --junitxml="$LOGS/tests.xml" tests/test_ops_cuda.py \
    tests/test_integrations_fastdeploy.py tests/test_bench_roofline.py
fi

if has timing; then
  wait  # the phases build
  phases() {
    for c in "64 1 -1" "64 6 0" "64 1 20" "256 1 0" "256 6 20" "1024 1 -1"; do
      # shellcheck disable=SC2086
      "$DRIVER.phases" one $c 41
    done
  }
  export DRIVER
  # "cold": each emit after a kernel that overwrites 256 MiB, as a model's forward pass
  # leaves the caches; with the phase clocks from the AIOSPEC_PHASES build
  # "coldone": two batches whose exchange grids measured slow (docs/benchmarks.md, "Small
  # exchange grids"): 64 rows (fast since the launcher makes 32 blocks), 100 rows (still slow)
  stage timing 180 bash -c "$(declare -f phases); \"$DRIVER\" time 8 && phases && \"$DRIVER\" cold 41 && \"$DRIVER.phases\" cold 41 && \"$DRIVER\" coldone 64 6 5 2 41 && \"$DRIVER\" coldone 100 6 5 2 41"
  grep '^time\|^phases\|^cold' "$LOGS/timing.log" > "$OUT/timing.txt"
fi

if has probe; then
  stage probe 180 "$PROBE"
  grep '^probe' "$LOGS/probe.log" > "$OUT/probe.txt"
fi

if has roofline; then
  if has tests && [[ -s "$OUT/roofline.json" ]]; then
    echo "=== roofline: the tests stage's run (test_a_whole_run_on_a_gpu), $OUT/roofline.json"
    summary+=("roofline: the tests stage's run")
  else
    stage roofline 300 python3 scripts/bench_roofline.py --driver "$DRIVER" --probe "$PROBE" --json "$OUT/roofline.json"
  fi
fi

if has ncu; then
  if command -v ncu > /dev/null; then
    ncu_one() {  # the 3rd of 4 emits of one batch: warm, the state in L2 as in a loop
      ncu --clock-control none -k regex:emit_kernel --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section SchedulerStats --section SourceCounters \
        --metrics gpu__time_duration.sum,sm__cycles_elapsed.max,smsp__cycles_active.max --print-details all \
        "$DRIVER" one "$@" 4
    }
    ncu_source() {  # where the small emit's warps stall, per source line
      ncu --clock-control none -k regex:emit_kernel --launch-skip 2 --launch-count 1 --section SourceCounters \
        --section WarpStateStats --page source --print-source cuda --csv "$DRIVER" one 64 1 -1 4
    }
    export DRIVER
    stage ncu 240 bash -c "$(declare -f ncu_one ncu_source); ncu_one 64 1 -1 && ncu_one 256 6 20 && ncu_source"
    cp "$LOGS/ncu.log" "$OUT/ncu.txt"
  else
    echo "ncu not found" | tee "$LOGS/ncu.log"
    summary+=("ncu: not found")
  fi
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
    build_driver_bin "$DRIVER.$name" "$@"
  }
  # VARIANTS picks some of them (default: all)
  declare -A flags=([f0]=-DAIOSPEC_FENCE_MODE=0 [f1]=-DAIOSPEC_FENCE_MODE=1 [f3]=-DAIOSPEC_FENCE_MODE=3
    [t128]=-DAIOSPEC_THREADS=128 [t512]=-DAIOSPEC_THREADS=512 [solo0]=-DAIOSPEC_SOLO_BYTES=0
    [solo64k]=-DAIOSPEC_SOLO_BYTES=65536 [inline0]=-DAIOSPEC_INLINE_TOKENS=0
    [inline8k]=-DAIOSPEC_INLINE_TOKENS=8192 [pdl0]=-DAIOSPEC_PDL=0 [pdl2]=-DAIOSPEC_PDL=2
    [wc0]=-DAIOSPEC_WARP_COUNTS=0 [hw0]=-DAIOSPEC_HEADER_WARP=0
    [empty]=-DAIOSPEC_EMPTY=1 [empty_pdl0]="-DAIOSPEC_EMPTY=1 -DAIOSPEC_PDL=0"
    [spec0]=-DAIOSPEC_SPECIALIZE=0 [spec2]=-DAIOSPEC_SPECIALIZE=2
    [pos8]=-DAIOSPEC_POS_LANES=8 [pos2]=-DAIOSPEC_POS_LANES=2 [minx1]=-DAIOSPEC_MIN_EXCHANGE_BLOCKS=1
    [wg0]=-DAIOSPEC_WARP_GATHER=0 [wg2]=-DAIOSPEC_WARP_GATHER=2 [nc1]=-DAIOSPEC_NO_COLUMNS=1 [nc2]=-DAIOSPEC_NO_COLUMNS=2 [co0]=-DAIOSPEC_COOP=0
    [dr]=-DAIOSPEC_DEVICE_RING=1)
  VARIANTS="${VARIANTS:-f0 f1 t128 t512 solo0 solo64k inline0 inline8k pdl0 pdl2 wc0 hw0 spec0 spec2 pos8 pos2 minx1 wg0 wg2 f3 nc1 nc2 co0 dr empty empty_pdl0}"
  # shellcheck disable=SC2086
  for v in $VARIANTS; do build_variant "$v" ${flags[$v]} & done
  wait
  variants() {
    echo "## default build (fence mode 2, 256 threads, PDL 1), rows per block 4 8 16 32"
    "$DRIVER" time 4 8 16 32
    for v in $VARIANTS; do
      echo "## $v"
      case $v in
        inline*) "$DRIVER.$v" cold 41 ;;  # the exceptions pre-pass always / up to 8192 tokens inline
        minx1)  # exchange grids as small as rows_per_block makes them, against the default build
          for c in "64 6 5 0" "128 1 20 1" "128 6 20 1"; do
            # shellcheck disable=SC2086
            "$DRIVER.$v" coldone $c 41 && "$DRIVER" coldone $c 41
          done ;;
        pdl*) "$DRIVER.$v" time 8 && "$DRIVER.$v" cold 41 ;;  # without PDL / the trigger at entry
        wg0)  # the exchange's counts gathered by every thread: its slow mode at 34, 50, 100 blocks
          "$DRIVER.$v" shapes 0 200 1 20 256 1 20 400 1 20 512 1 20 100 6 5 96 6 5
          "$DRIVER" shapes 0 200 1 20 256 1 20 400 1 20 512 1 20 100 6 5 96 6 5 ;;
        wg2)  # a warp per 32 blocks past 32: frames of 33 to 264 blocks
          "$DRIVER.$v" shapes 0 400 1 20 1000 1 20 512 6 20 1024 6 20
          "$DRIVER" shapes 0 400 1 20 1000 1 20 512 6 20 1024 6 20 ;;
        f3) "$DRIVER.$v" time 8; continue ;;  # no fences: a lower bound, not a correct protocol
        nc* | dr)  # measurement only (frames not the CPU writer's): stores left out, or to device memory
          "$DRIVER.$v" shapes 0 200 1 20 256 1 20 256 6 20 64 1 -1; continue ;;
        co0) "$DRIVER.$v" shapes 0 200 1 20 256 1 20 256 6 20; continue ;;  # correct only on an idle device
        empty*) "$DRIVER.$v" time 8; continue ;;  # nothing after the wait: the launch's floor
        *) "$DRIVER.$v" time 8 ;;
      esac
      "$DRIVER.$v" 60 | tail -n 1
    done
  }
  export DRIVER VARIANTS
  stage variants 300 bash -c "$(declare -f variants); variants"
fi

if has bench; then
  raise=()
  if [[ "${RAISE_MSGMAX:-1}" == 1 && $(id -u) == 0 ]]; then raise=(--raise-msgmax); fi
  # shellcheck disable=SC2086
  stage bench "${BENCH_TIMEOUT:-540}" python3 scripts/bench_emit.py --device cuda ${raise[@]+"${raise[@]}"} \
    --json "$OUT/bench_emit.json" ${BENCH_ARGS:-}
fi

if has step; then
  raise=()
  if [[ "${RAISE_MSGMAX:-1}" == 1 && $(id -u) == 0 ]]; then raise=(--raise-msgmax); fi
  # shellcheck disable=SC2086
  stage step "${STEP_TIMEOUT:-420}" python3 scripts/bench_step.py ${raise[@]+"${raise[@]}"} --json "$OUT/bench_step.json" \
    ${STEP_ARGS:-}
fi

targets() {  # each target of the GPU path (issue: GPU time, host time, the decoding step)
  python3 - "$OUT" << 'PY'
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
lines = []
def say(name, value, goal, met, unit="us"):
    state = "n/a (not measured)" if value is None else ("met" if met else "not met")
    lines.append(f"target {name}: {state}" + ("" if value is None else f" ({value} {unit}, goal {goal})"))
t = out / "timing.txt"
rows = {}
if t.exists():
    for ln in t.read_text().splitlines():
        kv = dict(re.findall(r"(\w+)=(\S+)", ln))
        if ln.startswith("time ") and "rows" in kv:
            rows[(kv["rows"], kv["tokens"], kv["k"])] = kv
small, big = rows.get(("64", "1", "-1")), rows.get(("256", "6", "20"))
for name, r, goal in (("small emit 64x1 no logprobs", small, 4.0), ("emit 256x6x20", big, 8.0)):
    for key in ("b2b_us", "gpu_us", "graph_us"):
        v = float(r[key]) if r else None
        say(f"{name} [{key}]", v, f"<= {goal}", v is not None and v <= goal)
b = out / "bench_emit.json"
if b.exists():
    res = json.loads(b.read_text())["results"]
    hp = [r["emit_host_us_producer_prepared"]["p50"] for r in res if "emit_host_us_producer_prepared" in r]
    v = max(hp) if hp else None
    say("host time per prepared emit, p50 (worst batch)", v, "<= 10", v is not None and v <= 10.0)
    sync = all(r["no_host_sync"]["stream_still_busy"] for r in res)
    lines.append(f"target zero host syncs: {'met' if sync else 'not met'}")
r = out / "roofline.json"
if r.exists():
    doc = json.loads(r.read_text())
    for f in doc["frames"]:
        lines.append(f"roofline {f['batch']} ({f['frame_bytes']:,} B): emit {f['emit_us']['b2b']} us b2b, "
                     f"{f['emit_gbps']} GB/s ({f['emit_of_link']:.0%} of {doc['link_gbps']}); probe "
                     f"{f['probe_us']['b2b']} us, {f['probe_gbps']} GB/s ({f['probe_bound']}); "
                     f"emit / probe {f['emit_over_probe']}x")
s = out / "bench_step.json"
if s.exists():
    for tg in json.loads(s.read_text())["targets"]:
        say(f"step batch {tg['batch']}: aiospec adds", tg["aiospec_added_pct"], "<= 0.5", tg["added_pct_met"], "%")
        if tg.get("control_added_us") is not None:
            lines.append(f"  (a trivial kernel captured the same way adds {tg['control_added_us']} us; "
                         f"{tg['captures']} captures a graph path)")
        x = min(tg["cheaper_than_fastdeploy_x"], tg["cheaper_than_vllm_x"])
        say(f"step batch {tg['batch']}: cheaper than FD / vLLM (min)", x, ">= 10", tg["cheaper_met"], "x")
        if "side_stream_added_pct" in tg:
            say(f"step batch {tg['batch']}: aiospec on a side stream adds", tg["side_stream_added_pct"], "<= 0.5",
                tg["side_stream_added_pct_met"], "%")
            x = min(tg["side_stream_cheaper_than_x"].values())
            say(f"step batch {tg['batch']}: side stream cheaper than FD / vLLM / vLLM side stream (min)", x, ">= 10",
                tg["side_stream_cheaper_met"], "x")
print("\n".join(lines))
PY
}
targets > "$LOGS/targets.log" 2>&1
while IFS= read -r line; do summary+=("$line"); done < "$LOGS/targets.log"

echo "=== summary"
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.log"
tar -C "$LOGS" -czf "$OUT/logs.tgz" .
exit $failed
