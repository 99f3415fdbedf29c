#!/usr/bin/env bash
# run_fuzz.sh: runs one libFuzzer target on a scratch copy of its committed corpus, with the
# memory limits every run uses, so that the committed corpus is never written to and crash-*
# inputs (known failures waiting for a fix, docs/fuzzing.md) do not stop the run; with the
# target's dictionary (tests/fuzz/<target>.dict) when it has one.
#   run_fuzz.sh BINARY CORPUS_DIR ARTIFACT_DIR [libFuzzer flags...]
# FUZZ_WORK_DIR=DIR keeps the growing corpus in DIR (created, seeded, never deleted) for long runs.
set -euo pipefail
bin=$1 corpus=$2 artifacts=$3
shift 3
if [ -n "${FUZZ_WORK_DIR:-}" ]; then
  work=$FUZZ_WORK_DIR
  mkdir -p "$work"
else
  work=$(mktemp -d "${TMPDIR:-/tmp}/swarm-fuzz.XXXXXX")
  trap 'rm -rf "$work"' EXIT
fi
find "$corpus" -maxdepth 1 -type f ! -name 'crash-*' -exec cp -n {} "$work/" \;
mkdir -p "$artifacts"
dict=$(dirname "$0")/$(basename "$bin").dict   # tests/fuzz/<target>.dict, when there is one
dict_flag=()
[ -f "$dict" ] && dict_flag=(-dict="$dict")
"$bin" "${dict_flag[@]}" -rss_limit_mb=2048 -malloc_limit_mb=1100 -timeout=30 -print_final_stats=1 \
  -artifact_prefix="$artifacts/$(basename "$bin")-" "$@" "$work"
