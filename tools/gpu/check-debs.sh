#!/usr/bin/env bash
# check-debs.sh: proves gpu-debs/ (tools/gpu/debs.txt) is complete, on this Debian machine, without
# a GPU: unpacks the .debs into an empty prefix, builds swarm in a scratch dir against them and
# this machine's libtorch (Debian's 1.13: no CUDA libtorch here, so SWARM_CUDA stays off), then
# checks that no header of a dependency came from /usr/include and that the binaries load libzmq,
# libxxhash and libzstd from the prefix. Run it after changing debs.txt. docs/gpu.md.
#   tools/gpu/check-debs.sh [SCRATCH_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
work=${1:-$(mktemp -d /tmp/swarm-check-debs-XXXXXX)}
mkdir -p "$work"
log=$work/check-debs.log
jobs=${SWARM_BUILD_JOBS:-$(nproc)}
# shellcheck source=tools/gpu/deps.sh
source tools/gpu/deps.sh
swarm_gpu_deps "$root/gpu-debs" "$work" python3 1 "$log" "$jobs"
echo "check-debs: building in $work/build against $SWARM_DEPS_PREFIX (log $log)"
cmake -S . -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSWARM_CUDA_KERNELS=OFF \
  -DCMAKE_PREFIX_PATH="$SWARM_DEPS_GTEST;$SWARM_DEPS_PREFIX/usr" "${SWARM_DEPS_CMAKE_ARGS[@]}" >>"$log" 2>&1
nice -n 5 cmake --build "$work/build" -j "$jobs" >>"$log" 2>&1 || { tail -30 "$log"; exit 1; }

# Every header of a dependency must come from the prefix, never from this machine's /usr/include.
leaks=$(ninja -C "$work/build" -t deps | grep -E '^ +/usr/include/(zmq|msgpack|nlohmann/|CLI/|xxhash|xxh3|zstd|gtest/)' | sort -u || true)
if [ -n "$leaks" ]; then
  echo "check-debs: FAILED: headers taken from the system, missing from debs.txt:"
  echo "$leaks"
  exit 1
fi
# The link lines name the prefix's libraries, and the loader finds them there.
loaded=$(ldd "$work/build/swarm-stage")
for lib in libzmq libxxhash libzstd; do
  grep -q "$SWARM_DEPS_PREFIX/usr/lib/x86_64-linux-gnu/$lib" "$work/build/build.ninja" ||
    { echo "check-debs: FAILED: $lib is not linked from the prefix"; exit 1; }
  line=$(grep "^[[:space:]]*$lib" <<<"$loaded" || true)
  [[ "$line" == *"$SWARM_DEPS_PREFIX"* ]] ||
    { echo "check-debs: FAILED: swarm-stage loads $lib from outside the prefix: ${line:-not at all}"; exit 1; }
done
# And the build works: the CPU suite's quick parts.
(cd "$work/build" && ctest -R 'Codec|Wire|JobSpec|Precision|MemoryPlacement' -j "$jobs" --timeout 300 >>"$log" 2>&1) ||
  { echo "check-debs: FAILED: tests (see $log)"; exit 1; }
echo "check-debs: OK: $(ls "$root"/gpu-debs/*.deb | wc -l) packages are enough to build and run swarm (scratch dir $work)"
