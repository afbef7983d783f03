#!/usr/bin/env bash
# gpu_carry.sh: makes .carry/ (git-ignored), what tests/gpu/run.sh needs on a GPU machine
# whose image lacks it, copied from this machine's Debian packages: Lua 5.4's headers and
# shared library (liblua5.4-dev), so that the moonshard executable builds there and the Lua
# checks (collectives.lua, units.lua on the NCCL backend) run.  Plain copies, no links (a
# carried tree may not keep them).  Then run the device command with carry [".carry"]:
#   bash tools/gpu_carry.sh && <device> bash tests/gpu/run.sh
set -euo pipefail
cd "$(dirname "$0")/.."
lib=$(ldconfig -p | awk '/liblua5\.4\.so\.0 / {print $NF; exit}')
[ -f /usr/include/lua5.4/lua.h ] && [ -n "$lib" ] ||
  { echo "gpu_carry.sh: Lua 5.4 is not installed here (apt-get install liblua5.4-dev)" >&2; exit 1; }
rm -rf .carry
mkdir -p .carry/lua/include .carry/lua/lib
cp /usr/include/lua5.4/*.h .carry/lua/include/
real=$(readlink -f "$lib")
cp "$real" .carry/lua/lib/liblua5.4.so.0 # the name the executable asks for (its soname)
cp "$real" .carry/lua/lib/liblua5.4.so   # the name the linker looks for
du -sh .carry | awk '{print "gpu_carry.sh: .carry holds " $1 ": Lua 5.4 headers and library"}'
