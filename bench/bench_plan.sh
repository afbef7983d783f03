#!/usr/bin/env bash
# bench_plan.sh [BUILD_DIR] [TRIALS]: planning DeepSeek-V3 (671B parameters) with the
# inkling2 policy on a 4096-rank mesh with ep=64, as a whole process, against interpreter
# start-up (`moonshard -e ''`) measured in the same run, interleaved (PERF.md).
# The plan itself = plan process - start-up.  Target: under 0.5 s.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
trials=${2:-7}
bin="$build/moonshard"
plan=("$bin" plan --config examples/configs/deepseek_v3.json --mesh dp_shard=4096,ep=64 --policy policies/inkling2)
"${plan[@]}" >/dev/null # warm the page cache; fails loudly if the plan is broken

now() { date +%s.%N; }
starts=() plans=()
for ((k = 0; k < trials; k++)); do
  t0=$(now); "$bin" -e '' >/dev/null; t1=$(now)
  "${plan[@]}" >/dev/null; t2=$(now)
  starts+=("$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')")
  plans+=("$(awk -v a="$t1" -v b="$t2" 'BEGIN {print b - a}')")
done
stats() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {printf "min %.3f s  median %.3f s  max %.3f s", a[1], a[int((NR+1)/2)], a[NR]}'; }
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
echo "moonshard plan, DeepSeek-V3 (671B), inkling2 policy, dp_shard=4096 ep=64; $trials trials interleaved"
echo "  interpreter start-up:  $(stats "${starts[@]}")"
echo "  plan (whole process):  $(stats "${plans[@]}")"
ms=$(median "${starts[@]}"); mp=$(median "${plans[@]}")
awk -v s="$ms" -v p="$mp" 'BEGIN {
  printf "  the plan itself (medians): %.3f s, whole process %.1fx start-up; target < 0.5 s: %s\n",
    p - s, p / s, (p - s < 0.5) ? "met" : "MISSED" }'
