#!/usr/bin/env bash
# test.sh: installs what is missing, builds, and runs the whole test suite (unit and
# multi-process integration tests, each bounded in time). Then, when clang with libFuzzer is
# present, builds the fuzz targets in build-fuzz/ (ASan + UBSan, no libtorch) and runs each for
# a short smoke (tests/fuzz, docs/fuzzing.md); SWARM_FUZZ_SMOKE=0 skips that part.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
tools/build.sh
rc=0
(cd build && ctest --output-on-failure --timeout 600 -j 2 "$@") || rc=$?

if [ "${SWARM_FUZZ_SMOKE:-1}" = 0 ]; then
  echo "test.sh: fuzz smoke skipped (SWARM_FUZZ_SMOKE=0)"
elif ! command -v clang++ >/dev/null ||
     ! echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
       clang++ -x c++ -fsanitize=fuzzer - -o /dev/null 2>/dev/null; then
  echo "test.sh: fuzz smoke skipped: no clang++ with libFuzzer (Debian: clang libclang-rt-14-dev)"
else
  jobs=${SWARM_BUILD_JOBS:-$(nproc)}
  if [ ! -f build-fuzz/build.ninja ]; then
    CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DSWARM_FUZZ=ON -DSWARM_STAGES=OFF -DSWARM_BUILD_TESTS=OFF
  fi
  cmake --build build-fuzz -j "$jobs" --target fuzz
  (cd build-fuzz && ctest --output-on-failure -L fuzz) || rc=$?
fi
exit $rc
