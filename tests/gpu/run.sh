#!/usr/bin/env bash
# run.sh: the GPU checks, one prepared script for a machine with a CUDA device (a few
# minutes on one H200).  Builds with CUDA into build-gpu (Release; the Lua parts when Lua
# 5.4 is there, from pkg-config or from .carry/lua, which tools/gpu_carry.sh makes for a GPU
# image without it), then runs every check below, each up to 5 minutes, and goes on after a
# failure so that one run on a lent GPU says everything; the summary at the end lists what
# failed, and the exit status is 1 when anything did:
#   - tests/gpu/test_cuda.c: casts on the device bit for bit against the CPU on every f32,
#     every dtype pair, tensors between host and device;
#   - tests/gpu/test_nccl.c: the NCCL backend on a one-GPU world, every collective and dtype
#     on cuda and staged cpu tensors, tagged groups, a collective and a split queued behind
#     a pending unit, sends and receives refused on one rank, shard units trained on the GPU
#     and offloaded, bit for bit against the CPU's arithmetic;
#   - under Lua: the tensor spec's device case (when busted is there), collectives.lua,
#     p2p.lua and units.lua (the inkling2 plan's units, on the GPU and offloaded, and with its
#     FP32 islands packed into their layers' units on 2 ranks) with
#     --backend nccl; with two GPUs or more the same on 2 NCCL ranks started torchrun-style
#     (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), sends and receives that disagree (both
#     ranks fail) or whose peer never comes (a timeout naming it), a rank that leaves
#     mid-run (the other's next collective must end in the timeout), and collectives.lua
#     under mpirun and under torchrun (through torchrun's own store; when PyTorch is
#     installed); with 3 GPUs and with 4, collectives.lua, p2p.lua and units.lua on 3 and 4
#     ranks (NCCL's rounding in bf16, f16 and fp8 reductions, uneven shards, groups of mesh
#     axes, expert-parallel units);
#   - bench_cuda: the casts' bandwidth as a fraction of a device-to-device copy's (same run).
# A test that skips (exit 77: no device, or no NCCL in the build) is a failure here.
#   [CMAKE_ARGS="-D..."] bash tests/gpu/run.sh [BUILD_DIR]
# MOONSHARD_CUDA_SIM=1 runs the same checks on a machine without a GPU, against tests/sim (a
# host simulation of the CUDA runtime and NCCL: -DMOONSHARD_CUDA_SIM=ON, default BUILD_DIR
# build-sim), leaving out bench_cuda: it checks the device code paths' plumbing (pointers,
# sizes, streams, events, ordering, errors) and the kernels' code run on the host, never a
# GPU; its ranks are processes of this machine, each with 4 simulated devices, so the runs
# on 2, 3 and 4 ranks are made too (reducing in NCCL's arithmetic), and the NCCL backend's failure paths are run through the simulation's
# fault switches.  The test command (tools/test.sh) runs it that way.
set -uo pipefail
cd "$(dirname "$0")/../.."
sim=${MOONSHARD_CUDA_SIM:-0}
if [ "$sim" = 1 ]; then build=${1:-build-sim}; else build=${1:-build-gpu}; fi
t0=$(date +%s)
failed=()

# step NAME COMMAND...: runs COMMAND (a program: 5 minutes at most), records NAME when it fails
step() {
  local name=$1 rc=0
  shift
  echo "== $name"
  if declare -F "$1" >/dev/null; then "$@" || rc=$?; else timeout 300 "$@" || rc=$?; fi
  [ $rc = 77 ] && echo "FAIL - $name skipped (exit 77): no usable CUDA device, or no NCCL in the build"
  [ $rc = 124 ] && echo "FAIL - $name did not finish within 300 s"
  [ $rc = 0 ] || { failed+=("$name (exit $rc)"); echo "FAIL - $name (exit $rc)"; }
}

summary() {
  echo "tests/gpu/run.sh: done in $(($(date +%s) - t0)) s"
  [ ${#failed[@]} = 0 ] && { echo "tests/gpu/run.sh: every check passed"; exit 0; }
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
}

[ "$sim" = 1 ] && echo "== simulated device (tests/sim): the plumbing of the device paths, on the host; not a GPU"
if [ "$sim" != 1 ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
echo "== $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo 'no nvcc'); $(cmake --version | head -1);" \
  "$(cc --version 2>/dev/null | head -1 || echo 'no cc'); mpirun: $(command -v mpirun || echo none)"
mkdir -p "$build"

# Lua 5.4: pkg-config's, else the carried copy
lua=OFF lua_prefix=
if pkg-config --exists lua5.4 2>/dev/null; then
  lua=ON
elif [ -f .carry/lua/include/lua.h ]; then
  lua=ON lua_prefix=$PWD/.carry/lua
  echo "== Lua 5.4 from .carry/lua (tools/gpu_carry.sh)"
else
  echo "== no Lua 5.4 here (pkg-config lua5.4, or .carry/lua from tools/gpu_carry.sh): the Lua checks are left out"
fi
# NCCL: the system's, else the nvidia-nccl wheel of this machine's python3 (GPU images often
# have only that: libnccl.so.2 and nccl.h under nvidia/nccl)
nccl_root=${NCCL_HOME:-}
if [ -z "$nccl_root" ] && ! ls /usr/include/nccl.h /usr/local/cuda/include/nccl.h >/dev/null 2>&1; then
  nccl_root=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)
  [ -n "$nccl_root" ] && echo "== NCCL from the python wheel: $nccl_root"
fi
cuda_args=(-DMOONSHARD_CUDA=ON) want="CUDA ON"
[ "$sim" = 1 ] && cuda_args=(-DMOONSHARD_CUDA=OFF -DMOONSHARD_CUDA_SIM=ON -DMOONSHARD_BENCH=OFF) want="CUDA SIMULATED"
# shellcheck disable=SC2086 # CMAKE_ARGS: more -D options, split on spaces (-DMOONSHARD_ASAN=ON)
if ! cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release "${cuda_args[@]}" -DMOONSHARD_LUA=$lua ${CMAKE_ARGS:-} \
  -DMOONSHARD_LUA_SPECS=OFF ${lua_prefix:+-DCMAKE_PREFIX_PATH="$lua_prefix"} \
  ${nccl_root:+-DMOONSHARD_NCCL_ROOT="$nccl_root"} >"$build/configure.log" 2>&1; then
  cat "$build/configure.log"
  failed+=("configure")
  summary
fi
grep "moonshard: MPI" "$build/configure.log"
grep -q "$want" "$build/configure.log" || { failed+=("CUDA was not found: no GPU build"); summary; }
step "build" cmake --build "$build" -j"$(nproc)" --target test_cuda test_nccl $([ "$sim" = 1 ] || echo bench_cuda) \
  $([ $lua = ON ] && echo moonshard_exe moonshard_lua)

step "test_cuda" "$build/test_cuda"
step "test_nccl" "$build/test_nccl"
if [ "$sim" = 1 ]; then # what one H200 cannot show: two devices, a device without memory pools
  step "sim: test_cuda --tensors with 2 devices (copies between them)" env MS_SIM_DEVICES=2 "$build/test_cuda" --tensors
  step "sim: test_nccl on a device without memory pools (cudaMalloc)" env MS_SIM_NO_POOLS=1 "$build/test_nccl"
fi
if [ $lua = ON ]; then
  ms=$build/moonshard
  if command -v busted >/dev/null && command -v lua5.4 >/dev/null; then
    lua_env=() # a stock lua5.4 loading a sanitized core.so needs the runtimes first
    case "${CMAKE_ARGS:-}" in *MOONSHARD_ASAN=ON*)
      lua_env=("LD_PRELOAD=$(cc -print-file-name=libasan.so):$(cc -print-file-name=libubsan.so)"
        ASAN_OPTIONS=detect_leaks=0) ;;
    esac
    step "Lua: tensors on cuda:0 (tensor_spec)" env "${lua_env[@]}" MOONSHARD_BIN="$ms" \
      LUA_PATH="lua/?.lua;lua/?/init.lua;tests/lua/?.lua;$build/lua/?.lua;;" LUA_CPATH="$build/lua/?.so;;" \
      lua5.4 "$(command -v busted)" tests/lua/tensor_spec.lua
  else
    echo "== no busted or lua5.4 here: tensor_spec is left out"
  fi
  step "Lua: the backend is nccl" "$ms" --backend nccl -e 'assert(require("moonshard").backend() == "nccl")'
  step "Lua: collectives.lua on one NCCL rank" "$ms" --backend nccl tests/lua/scripts/collectives.lua
  step "Lua: p2p.lua on one NCCL rank (its argument checks)" "$ms" --backend nccl tests/lua/scripts/p2p.lua
  step "Lua: the inkling2 units on one NCCL rank, on the GPU" "$ms" --backend nccl tests/lua/scripts/units.lua \
    dp_shard=1
  step "Lua: the inkling2 units on one NCCL rank, offloaded" "$ms" --backend nccl tests/lua/scripts/units.lua \
    dp_shard=1 tests/lua/configs/inkling2_tiny.json offload
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
  # the simulation: ranks are processes meeting in shared memory, each with 4 simulated
  # devices (LOCAL_RANK, or rank mod 4, picks one)
  sim_env=()
  [ "$sim" = 1 ] && gpus=4 sim_env=(MS_SIM_DEVICES=4)
  mpi_env=("${sim_env[@]}") # Open MPI leaks at exit (its plugins): LeakSanitizer would fail the step
  [ "$sim" = 1 ] && case "${CMAKE_ARGS:-}" in *MOONSHARD_ASAN=ON*) mpi_env+=(ASAN_OPTIONS=detect_leaks=0) ;; esac
  if [ "${gpus:-0}" -ge 2 ]; then
    # launch_ranks N NAME ARGS...: moonshard ARGS on N NCCL ranks started torchrun-style
    launch_ranks() {
      local n=$1 name=$2 pids=() r p rc=0
      shift 2
      for ((r = 0; r < n; r++)); do
        env "${sim_env[@]}" RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=29571 \
          timeout 300 "$ms" --backend nccl "$@" >"$build/$name$r.out" 2>&1 &
        pids+=($!)
      done
      for p in "${pids[@]}"; do wait "$p" || rc=1; done
      for ((r = 0; r < n; r++)); do cat "$build/$name$r.out"; done
      return $rc
    }
    step "2 NCCL ranks torchrun-style: collectives.lua" launch_ranks 2 collectives tests/lua/scripts/collectives.lua
    step "2 NCCL ranks torchrun-style: p2p.lua" launch_ranks 2 p2p tests/lua/scripts/p2p.lua
    # sends and receives that disagree fail on both ranks; a peer that never comes is a timeout naming it
    p2p_failures() {
      launch_ranks 2 p2p_mismatch --timeout 20 -e 'local ms = require "moonshard"
local g = ms.mesh{{"pp", 2}}:group("pp")
local t = ms.tensor({4}, ms.rank() == 0 and "f32" or "bf16", ms.device())
if ms.rank() == 0 then g:send(t, 1) else g:recv(t, 0) end'
      local r
      for r in 0 1; do
        grep -q "mismatch error: send/recv on group \[0 1\] between rank 0 and rank 1: the sides disagree: tensor 1 of 1 from rank 0 to rank 1: sent as tag 0 \[4\] f32, received as tag 0 \[4\] bf16 (the dtype differs)" \
          "$build/p2p_mismatch$r.out" || return 1
      done
      launch_ranks 2 p2p_timeout --timeout 2 -e 'local ms = require "moonshard"
local g = ms.mesh{{"pp", 2}}:group("pp")
if ms.rank() == 0 then g:send(ms.tensor({8}, "f32", ms.device()), 1) end'
      grep -q "send/recv on group \[0 1\] between rank 0 and rank 1: rank 1 did not arrive within 2 s" \
        "$build/p2p_timeout0.out"
    }
    step "2 NCCL ranks torchrun-style: p2p mismatch on both ranks, a peer that never comes" p2p_failures
    step "2 NCCL ranks torchrun-style: units on the GPUs" launch_ranks 2 units tests/lua/scripts/units.lua dp_shard=2
    step "2 NCCL ranks torchrun-style: units offloaded" launch_ranks 2 units_offload tests/lua/scripts/units.lua \
      dp_shard=2 tests/lua/configs/inkling2_tiny.json offload
    step "2 NCCL ranks torchrun-style: units with the FP32 islands packed, on the GPUs" launch_ranks 2 units_packed \
      tests/lua/scripts/units.lua dp_shard=2 tests/lua/configs/inkling2_tiny.json packed
    step "2 NCCL ranks torchrun-style: units with the FP32 islands packed, offloaded" launch_ranks 2 \
      units_packed_offload tests/lua/scripts/units.lua dp_shard=2 tests/lua/configs/inkling2_tiny.json offload,packed
    step "2 NCCL ranks torchrun-style: a packed unit with two reduce dtypes, the separate units' bits" launch_ranks 2 \
      packed_units tests/lua/scripts/packed_units.lua bf16reduce
    step "2 NCCL ranks torchrun-style: the same, offloaded" launch_ranks 2 packed_units_offload \
      tests/lua/scripts/packed_units.lua bf16reduce offload
    # rank 1 leaves after the first collective: rank 0's next one ends in the timeout (2 s)
    rank_dies() {
      launch_ranks 2 rank_dies --timeout 2 -e 'local ms = require "moonshard"
local g = ms.mesh{{"dp", 2}}:group("dp")
local t = ms.tensor({8}, "f32", ms.device())
g:all_reduce(t, "sum")
if ms.rank() == 1 then os.exit(3) end
g:all_reduce(t, "sum")
print("rank 0: the all_reduce without rank 1 returned")'
      grep -q "all_reduce on group \[0 1\]: not every rank arrived within 2 s" "$build/rank_dies0.out"
    }
    step "2 NCCL ranks torchrun-style: rank 1 dies, rank 0 times out" rank_dies
    # torchrun itself serves a store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True):
    # the ranks must rendezvous through it (when PyTorch is installed here)
    if type -P torchrun >/dev/null; then
      step "2 NCCL ranks under torchrun: collectives.lua" env "${sim_env[@]}" timeout 300 torchrun --no-python \
        --nproc_per_node 2 --master_port 29573 "$ms" --backend nccl tests/lua/scripts/collectives.lua
    else
      echo "== no torchrun here: the run under torchrun is left out"
    fi
    if command -v mpirun >/dev/null; then
      step "2 NCCL ranks under mpirun: collectives.lua" env "${mpi_env[@]}" mpirun --allow-run-as-root \
        --oversubscribe -np 2 "$ms" --backend nccl tests/lua/scripts/collectives.lua
    fi
  else
    echo "== one GPU: the multi-rank NCCL runs need two (NCCL refuses two ranks on one GPU)"
  fi
  # 3 ranks: averages multiply by 1/3 rounded to the dtype, uneven shards (torch.chunk 2, 2, 0);
  # 4 ranks: groups of mesh axes (ncclCommSplit), expert-parallel units
  if [ "${gpus:-0}" -ge 3 ]; then
    step "3 NCCL ranks torchrun-style: collectives.lua" launch_ranks 3 collectives3 tests/lua/scripts/collectives.lua
    step "3 NCCL ranks torchrun-style: p2p.lua" launch_ranks 3 p2p3 tests/lua/scripts/p2p.lua
    step "3 NCCL ranks torchrun-style: units on the GPUs" launch_ranks 3 units3 tests/lua/scripts/units.lua dp_shard=3
  fi
  if [ "${gpus:-0}" -ge 4 ]; then
    step "4 NCCL ranks torchrun-style: collectives.lua" launch_ranks 4 collectives4 tests/lua/scripts/collectives.lua
    step "4 NCCL ranks torchrun-style: p2p.lua" launch_ranks 4 p2p4 tests/lua/scripts/p2p.lua
    step "4 NCCL ranks torchrun-style: expert-parallel units on the GPUs" launch_ranks 4 units4 \
      tests/lua/scripts/units.lua dp_shard=4,ep=2
    step "4 NCCL ranks torchrun-style: expert-parallel units offloaded" launch_ranks 4 units4_offload \
      tests/lua/scripts/units.lua dp_shard=4,ep=2 tests/lua/configs/inkling2_tiny.json offload
  fi
fi
if [ "$sim" = 1 ] && [ $lua = ON ]; then
  # The NCCL backend's failure paths, through the simulation's fault switches (nccl_sim.cc):
  # each must end in its error, named, within the --timeout of 2 s, never hang.
  errors_lua='local ms = require "moonshard"
local g = ms.mesh{{"dp", 1}}:group("dp")
local t = ms.tensor({8}, "f32", ms.device())
g:all_reduce(t, "sum")
local ok, e = pcall(g.all_reduce, g, t, "sum")
assert(not ok and e:find("peer_failed error: all_reduce on group %[0%]: NCCL: "), tostring(e))
ok, e = pcall(g.barrier, g)
assert(not ok and e:find("unusable after an earlier failure"), tostring(e))
print("the failed collective and the next call: errors as expected")'
  # expect_error PATTERN COMMAND...: COMMAND fails, within a minute, saying PATTERN
  expect_error() {
    local pattern=$1 out rc=0
    shift
    out=$(timeout 60 "$@" 2>&1) || rc=$?
    grep -m1 -- "$pattern" <<<"$out" || { printf '%s\n' "$out" | tail -5; return 1; }
    [ $rc != 0 ] && [ $rc != 124 ]
  }
  nccl2s=("$ms" --backend nccl --timeout 2)
  step "sim faults: a collective that never completes" expect_error \
    "all_gather on group \[0\]: not every rank arrived within 2 s" \
    env MS_SIM_NCCL_HANG=3 "${nccl2s[@]}" tests/lua/scripts/collectives.lua
  step "sim faults: the world's communicator never made" expect_error \
    "ncclCommInitRank did not complete within 2 s" \
    env MS_SIM_NCCL_HANG_INIT=1 "${nccl2s[@]}" tests/lua/scripts/collectives.lua
  step "sim faults: an error while enqueueing" expect_error \
    "peer_failed error: nccl backend: ncclAllGather (the call's descriptor): remote process exited" \
    env MS_SIM_NCCL_ENQUEUE_ERROR=3 "${nccl2s[@]}" tests/lua/scripts/collectives.lua
  step "sim faults: an asynchronous error, then the group is unusable" \
    env MS_SIM_NCCL_ASYNC_ERROR=4 "${nccl2s[@]}" -e "$errors_lua"
  # The first ncclCommFinalize never completes: at exit moonshard must wait the --timeout
  # (2 s) for it, then abort that communicator, and the script still succeeds.  The
  # simulation's NCCL_DEBUG=INFO line "- Abort COMPLETE (its ncclCommFinalize in progress for
  # S s)" shows the abort and how long the finalization had waited: at least 1.5 s (the 2 s
  # less a margin, as moonshard may take its deadline just before it calls ncclCommFinalize;
  # an abort at once would be milliseconds) and under 60 s: 30 times the timeout, far beyond
  # any delay of a loaded machine, and far under the 300 s that a finalization bounded by the
  # default timeout instead of --timeout would wait.  The whole run takes at least the 2 s.
  finalize_aborted() {
    local out rc=0 t0 ms pending
    t0=$(date +%s%N)
    out=$(env MS_SIM_NCCL_HANG_FINALIZE=1 NCCL_DEBUG=INFO timeout 300 "${nccl2s[@]}" \
      tests/lua/scripts/collectives.lua 2>&1) || rc=$?
    ms=$((($(date +%s%N) - t0) / 1000000))
    pending=$(sed -n 's/.* - Abort COMPLETE (its ncclCommFinalize in progress for \([0-9.]*\) s)$/\1/p' \
      <<<"$out" | head -1)
    grep -E "checks ok|NCCL (INFO|WARN)" <<<"$out"
    echo "exit $rc after $((ms / 1000)).$((ms % 1000 / 100)) s; the pending finalization aborted after ${pending:-(none)} s"
    if [ $rc != 0 ] || ! grep -q "^rank 0: [0-9]* checks ok" <<<"$out"; then
      printf '%s\n' "$out" | tail -5
      return 1
    fi
    [ -n "$pending" ] || { echo "no communicator was aborted while its ncclCommFinalize was pending"; return 1; }
    awk -v p="$pending" 'BEGIN { exit !(p >= 1.5 && p < 60) }' ||
      { echo "the finalization was aborted after $pending s, not after the 2 s timeout"; return 1; }
    ((ms >= 2000)) || { echo "the run took $ms ms, less than the 2 s timeout"; return 1; }
  }
  step "sim faults: a finalization that never completes (aborted after 2 s)" finalize_aborted
fi
[ "$sim" = 1 ] || step "bench_cuda" "$build/bench/bench_cuda"
summary
