#!/usr/bin/env bash
# run.sh: the GPU checks, one prepared script for a machine with a CUDA device (a few
# minutes on one H200).  Builds with CUDA into build-gpu (Release, the Lua parts when Lua
# 5.4 is there), runs the tests labelled gpu: tests/gpu/test_cuda.c (casts on the device bit
# for bit against the CPU on every f32, every dtype pair, tensors between host and device)
# and tests/gpu/test_nccl.c (the NCCL backend on a one-GPU world: every collective and
# dtype on cuda and staged cpu tensors, tagged groups, shard units trained on the GPU and
# offloaded, bit for bit against the CPU's arithmetic); under Lua the tensor
# spec's device case, collectives.lua and units.lua (the inkling2 plan's units, on the GPU
# and offloaded) with --backend nccl; with two GPUs or more, the same on 2 NCCL ranks
# started torchrun-style (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and collectives.lua
# with mpirun; then bench_cuda (the casts' bandwidth as a fraction of a
# device-to-device copy's, same run).  Any step that fails stops the script.
#   bash tests/gpu/run.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-gpu}
t0=$(date +%s)
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
mkdir -p "$build"
lua=OFF
pkg-config --exists lua5.4 2>/dev/null && command -v busted >/dev/null && lua=ON
[ $lua = ON ] || echo "== no Lua 5.4 (pkg-config lua5.4) or no busted here: the Lua checks are left out"
# NCCL: the system's, else the nvidia-nccl wheel of this machine's python3 (GPU images often
# carry only that: libnccl.so.2 and nccl.h under nvidia/nccl)
nccl_root=${NCCL_HOME:-}
if [ -z "$nccl_root" ] && ! ls /usr/include/nccl.h /usr/local/cuda/include/nccl.h >/dev/null 2>&1; then
  nccl_root=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)
  [ -n "$nccl_root" ] && echo "== NCCL from the python wheel: $nccl_root"
fi
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DMOONSHARD_CUDA=ON -DMOONSHARD_LUA=$lua \
  ${nccl_root:+-DMOONSHARD_NCCL_ROOT="$nccl_root"} >"$build/configure.log" 2>&1 ||
  { cat "$build/configure.log"; exit 1; }
grep "moonshard: MPI" "$build/configure.log"
grep -q "CUDA ON" "$build/configure.log" || { echo "FAIL - CUDA was not found: no GPU build"; exit 1; }
cmake --build "$build" -j"$(nproc)" --target test_cuda test_nccl bench_cuda \
  $([ $lua = ON ] && echo moonshard_exe moonshard_lua)
echo "== tests labelled gpu (ctest -L gpu), run here directly: a skip is a failure on a GPU machine"
for t in test_cuda test_nccl; do
  rc=0
  "$build/$t" || rc=$?
  [ $rc = 77 ] && { echo "FAIL - $t skipped: this machine has no usable CUDA device or no NCCL"; exit 1; }
  [ $rc = 0 ] || { echo "FAIL - $t (exit $rc)"; exit 1; }
done
if [ $lua = ON ]; then
  echo "== Lua: tensors on cuda:0"
  MOONSHARD_BIN=$build/moonshard LUA_PATH="lua/?.lua;lua/?/init.lua;tests/lua/?.lua;$build/lua/?.lua;;" \
    LUA_CPATH="$build/lua/?.so;;" lua5.4 "$(command -v busted)" tests/lua/tensor_spec.lua
  echo "== Lua: collectives.lua on the NCCL backend, one rank"
  "$build/moonshard" --backend nccl -e 'local ms = require "moonshard"; assert(ms.backend() == "nccl")'
  "$build/moonshard" --backend nccl tests/lua/scripts/collectives.lua
  echo "== Lua: the inkling2 plan's units on the NCCL backend, one rank: shards on the GPU, then offloaded"
  "$build/moonshard" --backend nccl tests/lua/scripts/units.lua dp_shard=1
  "$build/moonshard" --backend nccl tests/lua/scripts/units.lua dp_shard=1 tests/lua/configs/inkling2_tiny.json offload
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
  if [ "$gpus" -ge 2 ]; then
    # torchrun2 NAME ARGS...: moonshard ARGS on 2 NCCL ranks started torchrun-style
    torchrun2() {
      local name=$1 pids=() r p
      shift
      for r in 0 1; do
        RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=29571 \
          "$build/moonshard" --backend nccl "$@" >"$build/$name$r.out" 2>&1 &
        pids+=($!)
      done
      for p in "${pids[@]}"; do wait "$p" || { cat "$build/$name"*.out; echo "FAIL - $name on 2 NCCL ranks"; exit 1; }; done
      cat "$build/$name"*.out
    }
    echo "== 2 NCCL ranks, torchrun-style rendezvous: collectives, units on the GPUs and offloaded"
    torchrun2 collectives tests/lua/scripts/collectives.lua
    torchrun2 units tests/lua/scripts/units.lua dp_shard=2
    torchrun2 units_offload tests/lua/scripts/units.lua dp_shard=2 tests/lua/configs/inkling2_tiny.json offload
    if command -v mpirun >/dev/null; then
      echo "== 2 NCCL ranks under mpirun"
      mpirun --allow-run-as-root --oversubscribe -np 2 "$build/moonshard" --backend nccl \
        tests/lua/scripts/collectives.lua
    fi
  else
    echo "== one GPU: the multi-rank NCCL runs need two (NCCL refuses two ranks on one GPU)"
  fi
fi
echo "== bench_cuda"
"$build/bench/bench_cuda"
echo "tests/gpu/run.sh: done in $(($(date +%s) - t0)) s"
