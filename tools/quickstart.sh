#!/usr/bin/env bash
# quickstart.sh: installs what is missing, builds, and trains the bundled example on a whole
# swarm on this machine (a router and 4 stages x 2 stage servers on loopback).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
tools/build.sh
exec build/swarm local examples/tiny_gpt/job.json --peers-per-stage 2 "$@"
