#!/usr/bin/env bash
# gpu-check.sh: the one prepared GPU check (docs/gpu.md). On a machine with an NVIDIA GPU, PyTorch
# 2.x with CUDA, nvcc, CMake and Ninja, and no internet: unpacks the other dependencies from the
# .deb files in gpu-debs/ (made by tools/gpu/fetch-debs.sh) into a local prefix, builds swarm
# against PyTorch's libtorch with -DSWARM_CUDA=ON in build-gpu/, then runs in one go:
#   1. the CUDA codec tests (bit-equal to the CPU codec) and the device codec path of a stage;
#   2. scaled-dot-product attention against the math form, and the stage's precision tests;
#   3. a 1-stage swarm on the GPU against the single-process GPU reference (fp32, 10 steps,
#      losses within 1e-3 relative);
#   4. `swarm bench gpu --json` (mfu, vs_pytorch, gpu_1stage_vs_single, int8_encode_vs_d2d).
# Results go to $OUT (or build-gpu/out): gpu-check.log, each step's output, bench_gpu.jsonl and
# summary.json. Exit 0 when every step passed.
#
# Environment: SWARM_PYTHON (the python with torch; default python3), SWARM_GPU_DEBS (default
# gpu-debs/), SWARM_BUILD_JOBS (default: all cores), OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
work=$root/build-gpu
out=${OUT:-$work/out}
mkdir -p "$work" "$out"
logf=$out/gpu-check.log
: > "$logf"
say() { echo "gpu-check: $*" | tee -a "$logf"; }
die() { say "FAILED: $*"; exit 1; }
t0=$(date +%s)

# --- 1. What this machine has -------------------------------------------------------------
python=${SWARM_PYTHON:-python3}
torch_info=$("$python" - <<'PY' 2>&1
import torch
assert int(torch.__version__.split(".")[0]) >= 2, f"PyTorch {torch.__version__}: the CUDA build needs 2.x"
assert torch.cuda.is_available(), "torch.cuda.is_available() is False: no GPU visible to PyTorch"
cc = torch.cuda.get_device_capability(0)
print(torch.utils.cmake_prefix_path, int(torch._C._GLIBCXX_USE_CXX11_ABI), f"{cc[0]}{cc[1]}", torch.__version__,
      torch.version.cuda, torch.cuda.get_device_name(0).replace(" ", "_"))
PY
) || die "$python cannot give a CUDA PyTorch 2.x: $torch_info (set SWARM_PYTHON)"
read -r torch_prefix torch_abi cuda_arch torch_version torch_cuda device <<<"$(echo "$torch_info" | tail -1)"
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
[ -x "$nvcc" ] || die "no nvcc on PATH or in /usr/local/cuda/bin"
command -v cmake >/dev/null || die "no cmake"
command -v ninja >/dev/null || die "no ninja"
glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
say "device ${device//_/ } (sm_$cuda_arch), PyTorch $torch_version (CUDA $torch_cuda, C++ ABI $torch_abi), nvcc $("$nvcc" --version | tail -1), glibc $glibc"
case "$glibc" in 2.3[4-9]*|2.[4-9]*) ;; *) say "warning: the Debian 12 libraries need glibc >= 2.34; this one has $glibc";; esac

# --- 2. The dependencies, from .deb files -------------------------------------------------
jobs=${SWARM_BUILD_JOBS:-$(nproc)}
# shellcheck source=tools/gpu/deps.sh
source tools/gpu/deps.sh
swarm_gpu_deps "${SWARM_GPU_DEBS:-$root/gpu-debs}" "$work" "$python" "$torch_abi" "$logf" "$jobs" 2>>"$logf" ||
  die "$(tail -1 "$logf")"

# --- 3. Build ----------------------------------------------------------------------------
build=$work/build
say "configuring and building in $build ($jobs jobs)"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSWARM_CUDA=ON \
  -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES="$cuda_arch" \
  -DCMAKE_PREFIX_PATH="$torch_prefix;$SWARM_DEPS_GTEST;$SWARM_DEPS_PREFIX/usr" "${SWARM_DEPS_CMAKE_ARGS[@]}" \
  >"$out/configure.log" 2>&1 || die "configure (see $out/configure.log)"
tb=$(date +%s)
cmake --build "$build" -j "$jobs" >"$out/build.log" 2>&1 || die "build (see the end of $out/build.log)"
build_s=$(( $(date +%s) - tb ))
say "built in ${build_s} s"

# --- 4. The checks, in one go -------------------------------------------------------------
tr=$(date +%s)
declare -A result
step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  local ts=$(date +%s)
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  result[$name]="$rc $(( $(date +%s) - ts ))"
  if [ $rc -eq 0 ]; then say "PASS $name ($(( $(date +%s) - ts )) s)"; else say "FAIL $name (exit $rc; $out/$name.log)"; tail -20 "$out/$name.log" >>"$logf"; fi
}
step codec_cuda 120 "$build/compression/test_compression_cuda"
step stage_gpu 180 "$build/tests/test_stages" --gtest_filter='DeviceCodec.*:Attention.*:StagePrecision.*'
step swarm_vs_reference 240 "$build/tests/test_integration" --gtest_filter='GpuSwarm.*'
export SWARM_PYTHON=$python  # the bench's PyTorch eager baseline runs on it
step bench_gpu 300 "$build/swarm" bench gpu --json
cp "$out/bench_gpu.log" "$out/bench_gpu.jsonl"
run_s=$(( $(date +%s) - tr ))
say "checks ran in ${run_s} s (budget 480 s)"

# --- 5. Summary ----------------------------------------------------------------------------
"$python" - "$out" "$run_s" "$build_s" "${device//_/ }" "$torch_version" "$torch_cuda" \
  "codec_cuda=${result[codec_cuda]}" "stage_gpu=${result[stage_gpu]}" "swarm_vs_reference=${result[swarm_vs_reference]}" \
  "bench_gpu=${result[bench_gpu]}" <<'PY' | tee -a "$logf"
import datetime, json, sys
out, run_s, build_s, device, torch_v, cuda_v = sys.argv[1:7]
steps = {}
for kv in sys.argv[7:]:
    name, rest = kv.split("=", 1)
    rc, secs = (rest.split() + ["-1", "0"])[:2]
    steps[name] = {"exit": int(rc), "seconds": int(secs)}
figures = None
try:
    for line in open(f"{out}/bench_gpu.jsonl"):
        if line.startswith("{") and '"figures"' in line:
            figures = json.loads(line)["figures"]
except OSError:
    pass
summary = {"date": datetime.date.today().isoformat(), "device": device, "torch": torch_v, "cuda": cuda_v,
           "build_s": int(build_s), "checks_s": int(run_s), "steps": steps, "figures": figures,
           "passed": all(s["exit"] == 0 for s in steps.values())}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps(summary))
PY
total=$(( $(date +%s) - t0 ))
say "done in ${total} s; results in $out"
for name in codec_cuda stage_gpu swarm_vs_reference bench_gpu; do
  [ "${result[$name]%% *}" = 0 ] || exit 1
done
exit 0
