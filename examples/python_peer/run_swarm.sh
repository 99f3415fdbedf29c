#!/usr/bin/env bash
# run_swarm.sh: a swarm on this machine with the Python peer serving one stage and swarm-stage
# serving the others: a router, one peer per stage, the job submitted and followed to its end.
# Usage: examples/python_peer/run_swarm.sh [JOB.json] [PYTHON_STAGE] [--all-cpp]
#   JOB.json      default examples/tiny_gpt/job.json (its data must exist: tools/install-deps.sh)
#   PYTHON_STAGE  the stage the Python peer serves (default 1)
#   --all-cpp     swarm-stage on every stage instead: the run to compare with
# Prints the job's final status as JSON (val_loss, train_loss, tokens_per_s); logs in $LOG_DIR
# (default a new folder under /tmp). Every process it starts is stopped when it exits.
set -euo pipefail
cd "$(dirname "$0")/../.."
job=${1:-examples/tiny_gpt/job.json}
py_stage=${2:-1}
all_cpp=${3:-}
build=${BUILD_DIR:-build}
log=${LOG_DIR:-$(mktemp -d /tmp/swarm-python-XXXXXX)}
mkdir -p "$log"
stages=$(/usr/bin/python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['partition']['stages'])" "$job")
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true' EXIT

"$build/swarm-router" --bind 'tcp://127.0.0.1:*' --ready-file "$log/endpoint" >"$log/router.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -s "$log/endpoint" ] && break; sleep 0.1; done
router=$(cat "$log/endpoint")
for s in $(seq 0 $((stages - 1))); do
  if [ "$s" = "$py_stage" ] && [ "$all_cpp" != "--all-cpp" ]; then
    /usr/bin/python3 examples/python_peer/swarm_peer.py --router "$router" --stage "$s" --name "python$s" >"$log/python$s.log" 2>&1 &
  else
    "$build/swarm-stage" --router "$router" --stage "$s" --name "cpp$s" --threads 1 --listen 'tcp://127.0.0.1:*' >"$log/cpp$s.log" 2>&1 &
  fi
  pids+=($!)
done
echo "run_swarm: router $router, logs in $log" >&2
"$build/swarm" submit "$job" --router "$router" --follow --json | tail -1
