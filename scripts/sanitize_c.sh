#!/usr/bin/env bash
# The CPython extension modules (shm/_native.c, aiospec/_speedups.c) and the emit op's C++ CPU
# writer (libaiospec_cpu.so) rebuilt with AddressSanitizer and UndefinedBehaviorSanitizer, and
# the tests that drive them run against those builds (every argument check included, and the
# differential test of the writer against the Python reference on arbitrary, mostly invalid,
# inputs). The regular extension builds are put back afterwards; the writer's sanitizer build
# goes to a build cache of its own (AIOSPEC_CXXFLAGS is part of the cache key).
# Exit status: the first failing pytest's. Needs gcc with libasan/libubsan.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SUFFIX=$($PY -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
INCLUDE=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
BACKUP=$(mktemp -d)
MODULES=(shm/_native aiospec/_speedups)
restore() {
  for m in "${MODULES[@]}"; do
    if [[ -f "$BACKUP/$(basename "$m")$SUFFIX" ]]; then cp "$BACKUP/$(basename "$m")$SUFFIX" "$m$SUFFIX"; else rm -f "$m$SUFFIX"; fi
  done
  rm -rf "$BACKUP"
}
trap restore EXIT
for m in "${MODULES[@]}"; do
  [[ -f "$m$SUFFIX" ]] && cp "$m$SUFFIX" "$BACKUP/"
  gcc -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -shared -fPIC \
    -I"$INCLUDE" -Ishm/include -Icsrc/include "$m.c" -o "$m$SUFFIX"
done
# leaks: CPython keeps its arenas and interned objects to the end; the checks here are
# out-of-bounds accesses, use after free and undefined behaviour
PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
ASAN_OPTIONS=detect_leaks=0 LD_PRELOAD="$PRELOAD" \
  $PY -m pytest -q -p no:cacheprovider tests/test_speedups.py tests/test_openai.py tests/test_ring_native.py \
  tests/test_ring_segment.py tests/test_ring_frames.py tests/test_ring_wakeup.py tests/test_ring_readers.py \
  tests/test_ring_liveness.py tests/test_ring_property.py "$@"
# the C++ writer, through its C ABI (ctypes) from numpy inputs. The Paddle tests are left out:
# they go through Paddle's own build of the op, and libpaddle itself trips ASan's
# alloc-dealloc-mismatch check when it loads.
CACHE=$(mktemp -d)
trap 'restore; rm -rf "$CACHE"' EXIT
AIOSPEC_CACHE_DIR="$CACHE" AIOSPEC_FORCE_CPU=1 \
AIOSPEC_CXXFLAGS="-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined" \
ASAN_OPTIONS=detect_leaks=0 LD_PRELOAD="$PRELOAD" \
  $PY -m pytest -q -p no:cacheprovider -k "not paddle" tests/test_ops_cpu.py tests/test_ops_prepared.py \
  tests/test_ops_producer.py tests/test_ops_reference.py tests/test_integrations_fastdeploy.py tests/test_ops_ring_faults.py
