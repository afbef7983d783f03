#!/usr/bin/env bash
# Set up (Debian packages, build) and run every test: the C tests and the busted specs,
# all through ctest.
source "$(dirname "$0")/common.sh"
install_missing
build
ctest --test-dir "$BUILD_DIR" --output-on-failure "$@"
