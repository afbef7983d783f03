# tools/common.sh: what the quickstart and test commands share: install the Debian packages
# moonshard needs when they are missing, then configure and build into build/.
# Sourced, not run.  Honours BUILD_DIR (default build) and CMAKE_ARGS.

set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BUILD_DIR=${BUILD_DIR:-build}

# command-or-file -> Debian package
need_packages() {
  local missing=()
  command -v cmake >/dev/null || missing+=(cmake)
  command -v cc >/dev/null || missing+=(gcc)
  command -v g++ >/dev/null || missing+=(g++) # tests/sim (the simulated device) is C++
  [ -f /usr/include/stdio.h ] || missing+=(libc6-dev)
  command -v make >/dev/null || missing+=(make)
  command -v pkg-config >/dev/null || missing+=(pkg-config)
  command -v lua5.4 >/dev/null || missing+=(lua5.4)
  [ -f /usr/include/lua5.4/lua.h ] || missing+=(liblua5.4-dev)
  command -v busted >/dev/null || missing+=(lua-busted)
  command -v luajit >/dev/null || missing+=(luajit)
  [ -f /usr/include/luajit-2.1/luajit.h ] || missing+=(libluajit-5.1-dev)
  # the MPI backend and its suite (tests/mpi): mpirun, mpicc and the headers
  command -v mpirun >/dev/null || missing+=(openmpi-bin)
  dpkg-query -W -f='${Status}' libopenmpi-dev 2>/dev/null | grep -q 'ok installed' || missing+=(libopenmpi-dev)
  # the test command's PyTorch host tests (tests/torch) make a virtual environment
  if [ "${MOONSHARD_NEED_VENV:-0}" = 1 ]; then
    command -v python3 >/dev/null || missing+=(python3)
    python3 -c "import ensurepip, venv" 2>/dev/null || missing+=(python3-venv)
  fi
  printf '%s\n' "${missing[@]}"
}

install_missing() {
  local pkgs
  pkgs=$(need_packages)
  [ -z "$pkgs" ] && return 0
  echo "moonshard: installing missing Debian packages:" $pkgs
  if [ "$(id -u)" != 0 ]; then
    echo "moonshard: not root; install them with: sudo apt-get install -y" $pkgs >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # shellcheck disable=SC2086
  apt-get install -y -qq --no-install-recommends $pkgs
}

build() {
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-} >/dev/null
  cmake --build "$BUILD_DIR" -j "$(nproc)"
}
