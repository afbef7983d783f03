#!/usr/bin/env bash
# bench_sweep.sh [BUILD_DIR] [TRIALS]: `moonshard sweep` of DeepSeek-V3 (671B) with
# fsdp2_default over 4096 ranks of h100-80gb (4096 tokens a sample, 4096 a step; every
# layout of pp, dp_replicate, dp_shard, cp, tp and ep, with and without activation
# checkpointing, at most --max-plans' default full plans), as a whole process, against
# interpreter start-up (`moonshard -e ''`) measured in the same run, interleaved
# (docs/performance.md).  The sweep itself = sweep process - start-up.  Target: under 10 s.
set -euo pipefail
usage() {
  cat <<'USAGE'
usage: bench/bench_sweep.sh [BUILD_DIR] [TRIALS]
  BUILD_DIR  the build folder holding moonshard (default: the repository's build)
  TRIALS     trials, an integer 1..100 (default 3)
USAGE
}
fail() { printf 'bench_sweep.sh: %s\n' "$1" >&2; usage | head -1 >&2; exit 2; }
for arg in "$@"; do [[ $arg = -h || $arg = --help ]] && { usage; exit 0; }; done
[ $# -le 2 ] || fail "unexpected argument '$3'; expected at most BUILD_DIR and TRIALS"
trials=${2:-3}
[[ $trials =~ ^[0-9]{1,3}$ ]] && ((10#$trials >= 1 && 10#$trials <= 100)) || fail "TRIALS wants an integer 1..100, got '$trials'"
trials=$((10#$trials))
build=${1:-$(dirname "$0")/../build}
[ -x "$build/moonshard" ] || fail "no moonshard in '$build': expected a build folder (cmake --build it first)"
build=$(cd "$build" && pwd)
cd "$(dirname "$0")/.."
sweep=(sweep --config examples/configs/deepseek_v3.json --world 4096 --device h100-80gb --seq-len 4096
  --global-batch 4096 --policy policies/fsdp2_default.lua --no-progress)
bins=("$build/moonshard")
[ -x "$build/moonshard-jit" ] && bins+=("$build/moonshard-jit")
now() { date +%s.%N; }
for bin in "${bins[@]}"; do
  "$bin" "${sweep[@]}" > /tmp/bench_sweep.$$.out # fails loudly if the sweep is broken
  starts="" selfs=""
  for ((k = 0; k < trials; k++)); do
    t0=$(now); "$bin" -e '' >/dev/null; t1=$(now)
    "$bin" "${sweep[@]}" >/dev/null; t2=$(now)
    starts+="$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}') "
    selfs+="$(awk -v a="$t0" -v b="$t1" -v c="$t2" 'BEGIN {print (c - b) - (b - a)}') "
  done
  med() { tr ' ' '\n' | grep . | sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
  s=$(echo "$starts" | med) w=$(echo "$selfs" | med)
  printf '%s: DeepSeek-V3 sweep over 4096 ranks: %s\n' "$(basename "$bin")" "$(sed -n 2p /tmp/bench_sweep.$$.out)"
  printf '  start-up %.3f s; the sweep itself %.2f s (median of %d; %.0fx start-up); target 10 s: %s\n' \
    "$s" "$w" "$trials" "$(awk -v a="$w" -v b="$s" 'BEGIN {print a / b}')" \
    "$(awk -v w="$w" 'BEGIN {print (w < 10) ? "met" : "missed"}')"
  tail -1 /tmp/bench_sweep.$$.out | sed 's/^/  /'
done
rm -f /tmp/bench_sweep.$$.out
