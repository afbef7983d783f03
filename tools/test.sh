#!/usr/bin/env bash
# Set up (Debian packages, build) and run every test through ctest: the C tests, the busted
# specs and the install test; then again on an AddressSanitizer + UBSan build, with the
# exhaustive cast sweeps cut down (MOONSHARD_TEST_QUICK=1).  Extra arguments go to ctest.
# MOONSHARD_SKIP_ASAN=1 skips the sanitizer pass.
source "$(dirname "$0")/common.sh"
install_missing
build
ctest --test-dir "$BUILD_DIR" --output-on-failure "$@"
if [ "${MOONSHARD_SKIP_ASAN:-0}" != 1 ]; then
  echo "== again under AddressSanitizer + UBSan (build-asan) =="
  BUILD_DIR=build-asan CMAKE_ARGS="-DMOONSHARD_ASAN=ON -DMOONSHARD_BENCH=OFF" build
  MOONSHARD_TEST_QUICK=1 ctest --test-dir build-asan --output-on-failure "$@"
fi
