#!/usr/bin/env bash
# Set up (Debian packages, build) and run every test through ctest: the C tests, the busted
# specs and the install test; then the GPU checks (tests/gpu/run.sh) on the simulated device
# of tests/sim, when the CUDA toolkit's and NCCL's headers are there; then both again on
# AddressSanitizer + UBSan builds, with the exhaustive cast sweeps cut down
# (MOONSHARD_TEST_QUICK=1).  Extra arguments go to ctest; MOONSHARD_TEST_JOBS its parallel jobs
# (default 2).  MOONSHARD_SKIP_ASAN=1 skips the
# sanitizer passes, MOONSHARD_SKIP_SIM=1 the simulated device, MOONSHARD_SKIP_TORCH=1 the
# PyTorch host's tests (tests/torch/run.sh, skipped by themselves without a package index).
[ "${MOONSHARD_SKIP_TORCH:-0}" = 1 ] || export MOONSHARD_NEED_VENV=1
source "$(dirname "$0")/common.sh"
install_missing
# the PyTorch host's virtual environment (tests/torch/run.sh --setup: torch and transformers
# from PyPI into a cache kept between runs), made in the background while the rest builds
# and runs: downloading is not what the two cores are busy with
torch_setup_log=$(mktemp)
if [ "${MOONSHARD_SKIP_TORCH:-0}" != 1 ]; then
  bash tests/torch/run.sh --setup >"$torch_setup_log" 2>&1 &
  torch_setup=$!
fi
build
# two at a time (the specs and MPI suites one at a time among themselves: RESOURCE_LOCK timing)
JOBS=${MOONSHARD_TEST_JOBS:-2}
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS" "$@"
if [ -n "${torch_setup:-}" ]; then
  echo "== the PyTorch host (tests/torch/run.sh: FSDP2 on CPU and gloo under torchrun) =="
  wait "$torch_setup" || true
  cat "$torch_setup_log"
  bash tests/torch/run.sh "$BUILD_DIR"
fi
rm -f "$torch_setup_log"
sim_ok=
if [ "${MOONSHARD_SKIP_SIM:-0}" != 1 ]; then
  cuda_inc=${CUDA_HOME:-/usr/local/cuda}/include
  if [ -f "$cuda_inc/cuda_runtime_api.h" ] && { [ -f "$cuda_inc/nccl.h" ] || [ -f /usr/include/nccl.h ]; }; then
    sim_ok=1
    echo "== the GPU checks on the simulated device (tests/sim, build-sim) =="
    MOONSHARD_CUDA_SIM=1 MOONSHARD_TEST_QUICK=1 bash tests/gpu/run.sh build-sim
  else
    echo "== no CUDA toolkit headers (cuda_runtime_api.h, nccl.h): the simulated device's checks are left out =="
  fi
fi
if [ "${MOONSHARD_SKIP_ASAN:-0}" != 1 ]; then
  echo "== again under AddressSanitizer + UBSan (build-asan) =="
  BUILD_DIR=build-asan CMAKE_ARGS="-DMOONSHARD_ASAN=ON -DMOONSHARD_BENCH=OFF" build
  MOONSHARD_TEST_QUICK=1 ctest --test-dir build-asan --output-on-failure -j "$JOBS" "$@"
  if [ -n "$sim_ok" ]; then
    echo "== the GPU checks on the simulated device under AddressSanitizer + UBSan (build-sim-asan) =="
    CMAKE_ARGS="-DMOONSHARD_ASAN=ON" MOONSHARD_CUDA_SIM=1 MOONSHARD_TEST_QUICK=1 bash tests/gpu/run.sh build-sim-asan
  fi
fi
