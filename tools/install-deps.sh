#!/usr/bin/env bash
# install-deps.sh: installs from Debian 12's archive what swarm's build, tests and bundled
# example need. Idempotent: installs only what is missing; needs root (or sudo) for that.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libtorch-dev libopenblas0-pthread    # libtorch; without OpenBLAS it falls back to reference BLAS (~3x slower)
  libzmq3-dev cppzmq-dev               # transport
  libmsgpack-cxx-dev nlohmann-json3-dev libxxhash-dev
  libzstd-dev                          # entropy=zstd: lossless packing of codec output on the wire
  libcli11-dev libgtest-dev
  libjemalloc-dev                      # swarm's allocator: glibc's serialises threads freeing each other's memory (docs/scale.md)
  libcpp-httplib-dev                   # --http of swarm-router and swarm-stage: /metrics, /api/*, the dashboard
  prometheus                           # tests/integration/test_observability.cpp: promtool check metrics, a real scraping server
  chromium                             # tests/integration/test_observability.cpp: the dashboard in a headless browser
  fortunes                             # the bundled example's training text
  python3-torch                        # tests/python/check_export.py: `swarm export` read back by PyTorch
  python3-msgpack python3-zmq python3-xxhash python3-numpy  # examples/python_peer: the reference peer in Python (docs/model.md)
  iproute2                             # `ip netns`, veth, bridges and `tc ... tbf`: the namespaced hosts of test_hosts and `swarm bench hosts` (docs/hosts.md)
  clang libclang-rt-14-dev             # libFuzzer + ASan/UBSan for tests/fuzz (docs/fuzzing.md); tools/test.sh smokes them
  tcpdump                              # tests/integration/test_security.cpp: no plaintext on the wire under CURVE
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: everything is installed"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: run as root or install sudo" >&2; exit 1; }
  SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
