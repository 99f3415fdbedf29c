#!/usr/bin/env bash
# test.sh: installs what is missing, builds, and runs the whole test suite (unit and
# multi-process integration tests, each bounded in time).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
tools/build.sh
cd build
ctest --output-on-failure --timeout 600 -j 2 "$@"
