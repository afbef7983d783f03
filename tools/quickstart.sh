#!/usr/bin/env bash
# Set up (Debian packages, build) and run the quickstart on 4 ranks as threads.
source "$(dirname "$0")/common.sh"
install_missing
build >/dev/null
exec "$BUILD_DIR/moonshard" -n 4 examples/quickstart.lua
