#!/usr/bin/env bash
# fetch-debs.sh: downloads the .deb files of tools/gpu/debs.txt into gpu-debs/ (git-ignored), for
# tools/gpu-check.sh on a GPU machine without internet. Run on a Debian 12 (bookworm) amd64
# machine with apt and internet; no root needed. docs/gpu.md, "The offline dependencies".
set -euo pipefail
cd "$(dirname "$0")/../.."
mapfile -t packages < <(grep -v -e '^#' -e '^[[:space:]]*$' tools/gpu/debs.txt)
mkdir -p gpu-debs
cd gpu-debs
rm -f ./*.deb
apt-get download "${packages[@]}"
echo "fetch-debs: $(ls ./*.deb | wc -l) packages, $(du -sh . | cut -f1) in $(pwd)"
