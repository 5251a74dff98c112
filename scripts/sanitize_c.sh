#!/usr/bin/env bash
# The CPython extension modules (shm/_native.c, aiospec/_speedups.c) rebuilt with
# AddressSanitizer and UndefinedBehaviorSanitizer, and the tests that drive them run against
# those builds (every argument check included). The regular builds are put back afterwards.
# Exit status: pytest's. Needs gcc with libasan/libubsan.
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
ASAN_OPTIONS=detect_leaks=0 LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \
  $PY -m pytest -q -p no:cacheprovider tests/test_speedups.py tests/test_openai.py tests/test_ring_native.py \
  tests/test_ring_segment.py tests/test_ring_frames.py tests/test_ring_wakeup.py tests/test_ring_readers.py \
  tests/test_ring_liveness.py tests/test_ring_property.py "$@"
