#!/usr/bin/env bash
# bench_plan.sh [BUILD_DIR] [TRIALS]: planning DeepSeek-V3 (671B parameters) with the
# inkling2 policy on a 4096-rank mesh with ep=64, as a whole process, against interpreter
# start-up (`moonshard -e ''`) measured in the same run, interleaved (PERF.md).
# The plan itself = plan process - start-up.  Target: under 0.5 s.
# When moonshard-jit was built, the same under LuaJIT, interleaved with the Lua 5.4 runs,
# and LuaJIT against Lua 5.4: the per-trial ratio of the plan itself.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
trials=${2:-7}
bins=("$build/moonshard")
[ -x "$build/moonshard-jit" ] && bins+=("$build/moonshard-jit")
plan=(plan --config examples/configs/deepseek_v3.json --mesh "dp_shard=4096,ep=64" --policy policies/inkling2)
# warm the page cache; fails loudly if a plan is broken
for bin in "${bins[@]}"; do "$bin" "${plan[@]}" >/dev/null; done

now() { date +%s.%N; }
diff_s() { awk -v a="$1" -v b="$2" 'BEGIN {print b - a}'; }
# starts[i], plans[i], selfs[i]: space-separated seconds of bins[i], one a trial
starts=() plans=() selfs=()
for ((k = 0; k < trials; k++)); do
  for i in "${!bins[@]}"; do
    t0=$(now); "${bins[i]}" -e '' >/dev/null; t1=$(now)
    "${bins[i]}" "${plan[@]}" >/dev/null; t2=$(now)
    start=$(diff_s "$t0" "$t1") whole=$(diff_s "$t1" "$t2")
    starts[i]+="$start " plans[i]+="$whole " selfs[i]+="$(diff_s "$start" "$whole") "
  done
done
# of the space-separated numbers on stdin
sorted() { tr ' ' '\n' | grep . | sort -g; }
stats() { sorted | awk '{a[NR]=$1} END {printf "min %.3f s  median %.3f s  max %.3f s", a[1], a[int((NR+1)/2)], a[NR]}'; }
median() { sorted | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

echo "moonshard plan, DeepSeek-V3 (671B), inkling2 policy, dp_shard=4096 ep=64; $trials trials interleaved"
for i in "${!bins[@]}"; do
  echo "${bins[i]##*/} ($("${bins[i]}" --version | sed 's/.*(\([^,]*\),.*/\1/'))"
  echo "  interpreter start-up:  $(stats <<<"${starts[i]}")"
  echo "  plan (whole process):  $(stats <<<"${plans[i]}")"
  awk -v s="$(median <<<"${starts[i]}")" -v p="$(median <<<"${plans[i]}")" 'BEGIN {
    printf "  the plan itself (medians): %.3f s, whole process %.1fx start-up; target < 0.5 s: %s\n",
      p - s, p / s, (p - s < 0.5) ? "met" : "MISSED" }'
done
if [ "${#bins[@]}" = 2 ]; then
  read -ra lua54 <<<"${selfs[0]}"
  read -ra jit <<<"${selfs[1]}"
  ratios=""
  for ((k = 0; k < trials; k++)); do ratios+="$(awk -v a="${lua54[k]}" -v b="${jit[k]}" 'BEGIN {print b / a}') "; done
  sorted <<<"$ratios" | awk '{a[NR]=$1} END {
    printf "LuaJIT / Lua 5.4, the plan itself, per trial: min %.2fx  median %.2fx  max %.2fx (below 1: LuaJIT faster)\n",
      a[1], a[int((NR+1)/2)], a[NR] }'
fi
