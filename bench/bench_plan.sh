#!/usr/bin/env bash
# bench_plan.sh [BUILD_DIR] [TRIALS] [CASE]: planning DeepSeek-V3 (671B parameters) with the
# inkling2 policy on a 4096-rank mesh with ep=64 (CASE deepseek, the default), the same
# model with fsdp2_default on pp=16, dp_shard=256, ep=64 (4096 ranks; CASE deepseek_pp),
# Llama-3.1-70B with fsdp2_default on tp=8, dp_shard=2 with sequence parallel (CASE
# llama70b_tp) or on tp=8, pp=4, dp_shard=2 (CASE llama70b_tp_pp), the last two with a
# batch (8192 tokens a sample, 64 a step) and DeepSeek's pipeline with one (4096 tokens,
# 4096 a step), as a whole process, against interpreter
# start-up (`moonshard -e ''`) measured in the same run, interleaved (docs/performance.md).
# The plan itself = plan process - start-up.  Target: under 0.5 s.
# When moonshard-jit was built, the same under LuaJIT, interleaved with the Lua 5.4 runs,
# and LuaJIT against Lua 5.4: the per-trial ratio of the plan itself.
set -euo pipefail
usage() {
  cat <<'EOF'
usage: bench/bench_plan.sh [BUILD_DIR] [TRIALS] [CASE]
  the whole process planning DeepSeek-V3 (inkling2 policy, dp_shard=4096 ep=64) against
  interpreter start-up (moonshard -e ''), interleaved over the trials; min / median / max,
  the plan itself (median plan - median start-up) against its target of 0.5 s, and LuaJIT
  against Lua 5.4 when moonshard-jit was built.  A median of an even count is the mean of
  the middle two.
  BUILD_DIR  the build folder holding moonshard, from the current folder (default: the
             repository's build)
  TRIALS     trials, an integer 1..1000 (default 7)
  CASE       deepseek (default); deepseek_pp: DeepSeek-V3, fsdp2_default, pp=16
             dp_shard=256 ep=64, with a batch; deepseek_pp_device: the same with
             --device h100-80gb (the step-time estimate); llama70b_tp: Llama-3.1-70B, fsdp2_default,
             tp=8 dp_shard=2, sequence parallel, with a batch; llama70b_tp_pp: the same on
             tp=8 pp=4 dp_shard=2
EOF
}
# refuses a bad argument: the message, the synopsis, exit status 2
fail() { printf 'bench_plan.sh: %s\n' "$1" >&2; usage | head -1 >&2; exit 2; }
for arg in "$@"; do [[ $arg = -h || $arg = --help ]] && { usage; exit 0; }; done
[ $# -le 3 ] || fail "unexpected argument '$4'; expected at most BUILD_DIR, TRIALS and CASE"
case ${3:-deepseek} in
  deepseek)
    label="DeepSeek-V3 (671B), inkling2 policy, dp_shard=4096 ep=64"
    plan=(plan --config examples/configs/deepseek_v3.json --mesh "dp_shard=4096,ep=64" --policy policies/inkling2) ;;
  deepseek_pp)
    label="DeepSeek-V3 (671B), fsdp2_default, pp=16 dp_shard=256 ep=64 (4096 ranks), 4096 tokens x 4096"
    plan=(plan --config examples/configs/deepseek_v3.json --mesh "pp=16,dp_shard=256,ep=64"
      --policy policies/fsdp2_default.lua --seq-len 4096 --global-batch 4096) ;;
  deepseek_pp_device)
    label="DeepSeek-V3 (671B), fsdp2_default, pp=16 dp_shard=256 ep=64 (4096 ranks), 4096 tokens x 4096, h100-80gb step time"
    plan=(plan --config examples/configs/deepseek_v3.json --mesh "pp=16,dp_shard=256,ep=64"
      --policy policies/fsdp2_default.lua --seq-len 4096 --global-batch 4096 --device h100-80gb) ;;
  llama70b_tp)
    label="Llama-3.1-70B, fsdp2_default, tp=8 dp_shard=2, sequence parallel, 8192 tokens x 64"
    plan=(plan --config examples/configs/llama3.1_70b.json --mesh "dp_shard=2,tp=8" --policy policies/fsdp2_default.lua
      --set sequence_parallel=true --seq-len 8192 --global-batch 64) ;;
  llama70b_tp_pp)
    label="Llama-3.1-70B, fsdp2_default, tp=8 pp=4 dp_shard=2, sequence parallel, 8192 tokens x 64"
    plan=(plan --config examples/configs/llama3.1_70b.json --mesh "pp=4,dp_shard=2,tp=8"
      --policy policies/fsdp2_default.lua --set sequence_parallel=true --seq-len 8192 --global-batch 64) ;;
  *) fail "CASE is deepseek, deepseek_pp, deepseek_pp_device, llama70b_tp or llama70b_tp_pp, not '$3'" ;;
esac
trials=${2:-7}
[[ $trials =~ ^[0-9]{1,4}$ ]] && ((10#$trials >= 1 && 10#$trials <= 1000)) ||
  fail "TRIALS wants an integer 1..1000, got '$trials'"
trials=$((10#$trials))
build=${1:-$(dirname "$0")/../build}
[ -x "$build/moonshard" ] || fail "no moonshard in '$build': expected a build folder (cmake --build it first)"
build=$(cd "$build" && pwd) # before the cd below
cd "$(dirname "$0")/.."
bins=("$build/moonshard")
[ -x "$build/moonshard-jit" ] && bins+=("$build/moonshard-jit")
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
# awk: a[1..NR] the sorted numbers, med their median (the mean of the middle two for even NR)
spread='{a[NR]=$1} END {med = NR % 2 ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2;'
stats() { sorted | awk "$spread"' printf "min %.3f s  median %.3f s  max %.3f s", a[1], med, a[NR]}'; }
median() { sorted | awk "$spread"' print med}'; }

echo "moonshard plan, $label; $trials trials interleaved"
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
  sorted <<<"$ratios" | awk "$spread"'
    printf "LuaJIT / Lua 5.4, the plan itself, per trial: min %.2fx  median %.2fx  max %.2fx (below 1: LuaJIT faster)\n",
      a[1], med, a[NR] }'
fi
