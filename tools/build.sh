#!/usr/bin/env bash
# build.sh: configures and builds swarm into build/ (Ninja, ccache when present).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${SWARM_BUILD_JOBS:-$(nproc)}
if [ ! -f build/build.ninja ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
cmake --build build -j "$jobs"
