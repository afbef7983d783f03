#!/usr/bin/env bash
# run.sh: the GPU checks, one prepared script for a machine with a CUDA device (a few
# minutes on one H200).  Builds with CUDA into build-gpu (Release, the Lua parts when Lua
# 5.4 is there), runs the tests labelled gpu (tests/gpu/test_cuda.c: casts on the device bit
# for bit against the CPU on every f32, every dtype pair, tensors between host and device),
# the tensor spec's device case under Lua when built, and bench_cuda (the casts' bandwidth
# as a fraction of a device-to-device copy's, same run).
#   bash tests/gpu/run.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-gpu}
t0=$(date +%s)
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
mkdir -p "$build"
lua=OFF
pkg-config --exists lua5.4 2>/dev/null && command -v busted >/dev/null && lua=ON
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DMOONSHARD_CUDA=ON -DMOONSHARD_LUA=$lua >"$build/configure.log" 2>&1 ||
  { cat "$build/configure.log"; exit 1; }
grep "moonshard: MPI" "$build/configure.log"
grep -q "CUDA ON" "$build/configure.log" || { echo "FAIL - CUDA was not found: no GPU build"; exit 1; }
cmake --build "$build" -j"$(nproc)" --target test_cuda bench_cuda $([ $lua = ON ] && echo moonshard_exe moonshard_lua)
echo "== tests labelled gpu (ctest -L gpu), run here directly: a skip is a failure on a GPU machine"
rc=0
"$build/test_cuda" || rc=$?
[ $rc = 77 ] && { echo "FAIL - test_cuda skipped: this machine has no usable CUDA device"; exit 1; }
[ $rc = 0 ] || { echo "FAIL - test_cuda (exit $rc)"; exit 1; }
if [ $lua = ON ]; then
  echo "== Lua: tensors on cuda:0"
  MOONSHARD_BIN=$build/moonshard LUA_PATH="lua/?.lua;lua/?/init.lua;tests/lua/?.lua;$build/lua/?.lua;;" \
    LUA_CPATH="$build/lua/?.so;;" lua5.4 "$(command -v busted)" tests/lua/tensor_spec.lua
fi
echo "== bench_cuda"
"$build/bench/bench_cuda"
echo "tests/gpu/run.sh: done in $(($(date +%s) - t0)) s"
