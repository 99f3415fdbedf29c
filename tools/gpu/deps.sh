# deps.sh: sourced by tools/gpu-check.sh and tools/gpu/check-debs.sh. Unpacks the .deb files of
# tools/gpu/debs.txt into a prefix and builds GoogleTest from their sources, then sets:
#   SWARM_DEPS_PREFIX      the prefix (PREFIX/usr/include/zmq.h, ...)
#   SWARM_DEPS_GTEST       GoogleTest's install dir
#   SWARM_DEPS_CMAKE_ARGS  the arguments that point swarm's CMake at them (an array)
#   LD_LIBRARY_PATH        the prefix's library dirs first (the binaries load libzmq from there)
# Usage: swarm_gpu_deps DEBS_DIR WORK_DIR PYTHON CXX11_ABI(0|1) LOG JOBS
swarm_gpu_deps() {
  local debs=$1 work=$2 python=$3 abi=$4 log=$5 jobs=$6
  local here
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  ls "$debs"/*.deb >/dev/null 2>&1 || {
    echo "no .deb files in $debs: make them with tools/gpu/fetch-debs.sh on a Debian 12 machine (docs/gpu.md)" >&2
    return 1
  }
  SWARM_DEPS_PREFIX=$work/deps
  rm -rf "$SWARM_DEPS_PREFIX"
  "$python" "$here/unpack_debs.py" "$SWARM_DEPS_PREFIX" "$debs"/*.deb >>"$log" 2>&1 || {
    echo "unpacking $debs failed (see $log)" >&2
    return 1
  }
  local libdirs=$SWARM_DEPS_PREFIX/usr/lib/x86_64-linux-gnu:$SWARM_DEPS_PREFIX/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH=$libdirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # GoogleTest from source with the C++ ABI libtorch was built with (Debian's libgtest.a has ABI 1,
  # PyTorch's wheels before 2.7 ABI 0).
  SWARM_DEPS_GTEST=$work/gtest/install
  if [ ! -f "$SWARM_DEPS_GTEST/lib/cmake/GTest/GTestConfig.cmake" ]; then
    cmake -S "$SWARM_DEPS_PREFIX/usr/src/googletest" -B "$work/gtest/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DBUILD_GMOCK=OFF -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DCMAKE_CXX_FLAGS="-D_GLIBCXX_USE_CXX11_ABI=$abi" \
      -DCMAKE_INSTALL_PREFIX="$SWARM_DEPS_GTEST" -DCMAKE_INSTALL_LIBDIR=lib >>"$log" 2>&1 &&
      cmake --build "$work/gtest/build" --target install -j "$jobs" >>"$log" 2>&1 || {
        echo "building GoogleTest failed (see $log)" >&2
        return 1
      }
  fi
  local p=$SWARM_DEPS_PREFIX
  SWARM_DEPS_CMAKE_ARGS=(
    -DCMAKE_INCLUDE_PATH="$p/usr/include" -DCMAKE_LIBRARY_PATH="${libdirs//:/;}"
    -Dcppzmq_DIR="$p/usr/share/cmake/cppzmq" -Dnlohmann_json_DIR="$p/usr/share/cmake/nlohmann_json"
    -DCLI11_DIR="$p/usr/share/cmake/CLI11" -DGTest_DIR="$SWARM_DEPS_GTEST/lib/cmake/GTest"
    -Dmsgpackc-cxx_DIR="$p/usr/lib/x86_64-linux-gnu/cmake/msgpackc-cxx"
  )
}
