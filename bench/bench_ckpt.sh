#!/usr/bin/env bash
# bench_ckpt.sh [BUILD_DIR] [MIB] [TRIALS] [DIR]: moonshard.checkpoint's save and load on 4
# ranks as threads, then (when mpirun exists) on 4 MPI processes, each against plain
# write+fsync and pread of the same bytes (build/bench/bench_ckpt_io) interleaved in the same
# run (bench/bench_ckpt.lua; docs/performance.md).  MIB: the units' size in all (default
# 512); TRIALS (default 5); DIR: where the files go (default $TMPDIR or /tmp, a fresh folder
# removed at the end).  Target: plain time / checkpoint time >= 0.8.
set -euo pipefail
for arg in "$@"; do
  if [[ $arg = -h || $arg = --help ]]; then sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
done
build=${1:-$(dirname "$0")/../build}
mib=${2:-512} trials=${3:-5}
[ -x "$build/moonshard" ] && [ -x "$build/bench/bench_ckpt_io" ] ||
  { echo "bench_ckpt.sh: no moonshard or bench/bench_ckpt_io in '$build' (build it first)" >&2; exit 2; }
build=$(cd "$build" && pwd)
cd "$(dirname "$0")/.."
dir=${4:-$(mktemp -d "${TMPDIR:-/tmp}/bench_ckpt.XXXXXX")}
trap 'rm -rf "$dir"' EXIT
"$build/moonshard" -n 4 bench/bench_ckpt.lua "$build/bench/bench_ckpt_io" "$dir/threads" "$mib" "$trials"
if command -v mpirun >/dev/null; then
  mpirun --allow-run-as-root --oversubscribe -np 4 "$build/moonshard" bench/bench_ckpt.lua \
    "$build/bench/bench_ckpt_io" "$dir/mpi" "$mib" "$trials"
else
  echo "(no mpirun: the MPI run is skipped)"
fi
