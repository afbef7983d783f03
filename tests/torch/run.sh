#!/usr/bin/env bash
# tests/torch/run.sh [BUILD_DIR]: moonshard_torch (examples/torch_host) on real torch, CPU and
# gloo, under torchrun: each plan applied with fully_shard and checked against the plan on
# every rank, and a few training steps against the same model unsharded.
#
#   bash tests/torch/run.sh --setup   only make the virtual environment (tools/test.sh starts
#                                     this in the background while it builds)
#
# The virtual environment (torch and transformers from PyPI, the versions of
# tests/reference/requirements.txt) lives in $MOONSHARD_TORCH_VENV, default
# ${XDG_CACHE_HOME:-~/.cache}/moonshard/torch-venv, kept between runs.  Where no package index
# is reachable it says so in one line and the tests are skipped (exit 0).  torch is never a
# dependency of the C library, the Lua library or the executables.
set -uo pipefail
cd "$(dirname "$0")/../.."
VENV=${MOONSHARD_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/moonshard/torch-venv}
PY=$VENV/bin/python
pins() { grep -E "^($1)==" tests/reference/requirements.txt | tr '\n' ' '; }

# (complete once the stamp is there: an install cut short is made again)
have_venv() { [ -f "$VENV/.moonshard-complete" ] && [ -x "$PY" ] && "$PY" -c "import torch, transformers" >/dev/null 2>&1; }

setup() {
  have_venv && return 0
  local index=${PIP_INDEX_URL:-https://pypi.org/simple}
  if ! python3 - "$index" <<'EOF' >/dev/null 2>&1; then
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=15)
EOF
    echo "tests/torch: no package index reachable ($index): the PyTorch host's tests are skipped"
    return 2
  fi
  echo "tests/torch: making $VENV ($(pins 'torch|transformers')from $index; kept for later runs)"
  mkdir -p "$(dirname "$VENV")"
  rm -rf "$VENV"
  if ! python3 -m venv "$VENV" >/dev/null || ! "$VENV/bin/pip" install -q --disable-pip-version-check \
    $(pins 'torch|transformers|numpy|safetensors'); then
    echo "tests/torch: FAIL - pip could not install torch and transformers into $VENV"
    return 1
  fi
  touch "$VENV/.moonshard-complete"
  have_venv
}

if [ "${1:-}" = --setup ]; then
  setup
  code=$?
  [ $code = 2 ] && exit 0
  exit $code
fi

BUILD_DIR=${1:-build}
setup
case $? in
  0) ;;
  2) exit 0 ;;
  *) exit 1 ;;
esac
export MOONSHARD_EMBED_LIB=${MOONSHARD_EMBED_LIB:-$PWD/$BUILD_DIR/libmoonshard_embed.so}
[ -f "$MOONSHARD_EMBED_LIB" ] || { echo "tests/torch: FAIL - no $MOONSHARD_EMBED_LIB (build first)"; exit 1; }
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore TORCH_CPP_LOG_LEVEL=ERROR
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
echo "# tests/torch: $("$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'), $MOONSHARD_EMBED_LIB"
pass=0 failed=0
ok() { echo "ok   - $1"; pass=$((pass + 1)); }
fail() {
  echo "FAIL - $1"
  failed=$((failed + 1))
  shift
  for f in "$@"; do [ -f "$f" ] && sed 's/^/    | /' "$f" | grep -v "Warning\|warn(" | tail -25; done
}
run() { # run NAME NP ARGS...: torchrun of train.py; its output in $TMP/NAME.out
  local name=$1 np=$2
  shift 2
  timeout -k 5 300 "$PY" -m torch.distributed.run --nproc_per_node "$np" --master_port $((29500 + RANDOM % 1000)) \
    examples/torch_host/train.py "$@" >"$TMP/$name.out" 2>&1
}
losses() { grep '^step [0-9]* loss ' "$1" | awk '{print $4}'; }
# close LOSSES_A LOSSES_B TOL: every pair within TOL relative; prints the largest difference
close() {
  "$PY" - "$1" "$2" "$3" <<'EOF'
import sys
a = [float(x) for x in open(sys.argv[1]).read().split()]
b = [float(x) for x in open(sys.argv[2]).read().split()]
tol = float(sys.argv[3])
d = max((abs(x - y) / abs(y) for x, y in zip(a, b)), default=float("inf"))
print("%.3g" % d)
sys.exit(0 if len(a) == len(b) and len(a) > 0 and d <= tol else 1)
EOF
}

# case NAME NP TOL MODEL_ARGS -- SHARD_ARGS: the sharded run, checked on every rank, against
# the reference (the same model and frozen parameters, unsharded, the whole batch)
case_run() {
  local name=$1 np=$2 tol=$3
  shift 3
  local margs=() sargs=()
  while [ "$1" != -- ]; do margs+=("$1"); shift; done
  shift
  sargs=("$@")
  # (one reference run per model and frozen set: cases that share them share it)
  local key
  key=$(printf '%s_' "${margs[@]}" | tr -c 'A-Za-z0-9_' '_')
  [ -s "$TMP/reference_$key" ] || "$PY" examples/torch_host/train.py --reference "${margs[@]}" >"$TMP/reference_$key" 2>&1
  cp "$TMP/reference_$key" "$TMP/$name.ref"
  run "$name" "$np" "${margs[@]}" "${sargs[@]}"
  local code=$? checks
  checks=$(grep -c "^rank [0-9]*: check ok: " "$TMP/$name.out")
  losses "$TMP/$name.out" >"$TMP/$name.l1"
  losses "$TMP/$name.ref" >"$TMP/$name.l2"
  local diff
  diff=$(close "$TMP/$name.l1" "$TMP/$name.l2" "$tol")
  local close_ok=$?
  if [ $code = 0 ] && [ "$checks" = "$np" ] && [ $close_ok = 0 ]; then
    ok "$name on $np processes: every rank's parameters, units and bytes as planned; losses of $(wc -l <"$TMP/$name.l1") steps within $diff of the unsharded model's (tolerance $tol)"
  else
    fail "$name on $np processes (exit $code, $checks of $np ranks checked, loss difference $diff, tolerance $tol)" \
      "$TMP/$name.out" "$TMP/$name.ref"
  fi
}

# fp32 tolerance: the same model and batch, sums in another order
case_run llama_fsdp2_dp2 2 1e-6 --model llama -- --policy policies/full_fp32.lua
case_run llama_hsdp_frozen 4 1e-6 --model llama --untied --freeze layers.0.mlp -- --policy policies/full_fp32.lua \
  --mesh dp_replicate=2,dp_shard=2
# tensor parallelism: the TP plan through parallelize_module, alone and under FSDP (2-D:
# _StridedShard on dp_shard, Shard on tp), lm_head's 67 rows split 34 + 33
case_run llama_tp2 2 1e-6 --model llama --untied -- --policy policies/full_fp32.lua --mesh tp=2
case_run llama_fsdp_tp 4 1e-6 --model llama --untied -- --policy policies/full_fp32.lua --mesh dp_shard=2,tp=2
# activation checkpointing of transformers' decoder layers (CheckpointWrapper, as planned)
case_run llama_checkpointed 2 1e-6 --model llama -- --policy policies/full_fp32.lua --set activation_checkpointing=true
# bf16 compute with fp32 islands and the policy's own precision: bf16's tolerance
case_run islands_inkling2_dp4 4 5e-3 --model islands -- --policy policies/inkling2
# expert parallelism: the experts DTensors on the MoE mesh's ep axis, left alone by the layers'
# units (ep_shard = 1), or sharded further by units of their own on ep_shard (Shard(1))
case_run islands_ep2 2 5e-3 --model islands -- --policy policies/inkling2 --mesh dp_shard=2,ep=2
case_run islands_ep2_ep_shard2 4 5e-3 --model islands -- --policy policies/inkling2 --mesh dp_shard=4,ep=2
# the islands packed into their layers' units (pack_islands): the model is stored in f32, so
# FSDP2 holds each packed unit with torch's param_dtype_override_fn (the islands gather in
# f32, the rest in bf16) and moonshard_torch gives each island the casts its own unit made:
# checked on every rank (each parameter's gather dtype too), and the separate units' losses
run islands_packed 4 --model islands --policy policies/inkling2 --set pack_islands=true
if [ "$(grep -c '^rank [0-9]*: check ok: ' "$TMP/islands_packed.out")" = 4 ] &&
  [ "$(losses "$TMP/islands_packed.out" | wc -l)" = "$(losses "$TMP/islands_inkling2_dp4.out" | wc -l)" ] &&
  [ "$(losses "$TMP/islands_packed.out" | wc -l)" -gt 0 ] &&
  cmp -s <(losses "$TMP/islands_packed.out") <(losses "$TMP/islands_inkling2_dp4.out"); then
  ok "islands packed into their layers' units on 4 processes (param_dtype_override_fn): checked on every rank, the separate units' losses to the last digit"
else
  fail "islands packed (pack_islands=true) on 4 processes" "$TMP/islands_packed.out"
fi

# fsdp2_default (bf16) with the policy's options: CPU offload of every unit, a deeper
# prefetch (explicit lists)
case_run llama_offload_prefetch 2 5e-3 --model llama -- --policy policies/fsdp2_default.lua --set offload_policy=cpu \
  --set prefetch.forward=2 --set prefetch.backward=2

# a plan written by one run, applied by another; refused for another mesh or model
run plan_write 2 --model llama --policy policies/fsdp2_default.lua --write-plan "$TMP/plan.json"
run plan_read 2 --model llama --plan "$TMP/plan.json"
run plan_other_mesh 2 --model llama --plan "$TMP/plan.json" --mesh dp_replicate=1,dp_shard=1
c_other=$?
run plan_other_model 2 --model llama --untied --plan "$TMP/plan.json"
c_model=$?
if [ -s "$TMP/plan.json" ] && [ "$(grep -c 'check ok' "$TMP/plan_read.out")" = 2 ] &&
  cmp -s <(losses "$TMP/plan_write.out") <(losses "$TMP/plan_read.out") &&
  [ $c_other != 0 ] && grep -q "mesh axis dp_shard: 2 in the plan, 1 asked for" "$TMP/plan_other_mesh.out" &&
  [ $c_model != 0 ] && grep -q "lm_head.weight is in the model, not in the plan" "$TMP/plan_other_model.out"; then
  ok "a plan written to a file and applied by another run: checked, the writer's losses; refused for another mesh or model, naming the difference"
else
  fail "a plan from a file (exit codes $c_other $c_model)" "$TMP/plan_read.out" "$TMP/plan_other_mesh.out" \
    "$TMP/plan_other_model.out"
fi

# the plan of `moonshard plan --config` (the model built from the same config.json by
# moonshard's builder) applied to transformers' model
"$PY" - "$TMP/config.json" <<'EOF'
import sys
sys.path.insert(0, "examples/torch_host")
import models
models.build("llama").config.to_json_file(sys.argv[1])  # (architectures set by models.llama)
EOF
"$BUILD_DIR/moonshard" plan --config "$TMP/config.json" --mesh dp_shard=2 --policy policies/fsdp2_default.lua --json \
  >"$TMP/cli_plan.json" 2>"$TMP/cli_plan.err"
run cli_plan 2 --model llama --plan "$TMP/cli_plan.json"
if [ "$(grep -c 'check ok' "$TMP/cli_plan.out")" = 2 ] && cmp -s <(losses "$TMP/cli_plan.out") <(losses "$TMP/plan_write.out") &&
  [ "$(losses "$TMP/cli_plan.out" | wc -l)" = 3 ]; then
  ok "moonshard plan --config --json of the model's config.json, applied to transformers' model: checked on every rank, the losses of planning in the process"
else
  fail "a plan of moonshard plan --config applied" "$TMP/cli_plan.err" "$TMP/cli_plan.out"
fi

for c in divergence refusals; do
  timeout -k 5 300 "$PY" -m torch.distributed.run --nproc_per_node 2 --master_port $((29500 + RANDOM % 1000)) tests/torch/cases.py \
    "$c" >"$TMP/$c.out" 2>&1
  code=$?
  if [ $code = 0 ] && [ "$(grep -c "^rank [01]: $c ok" "$TMP/$c.out")" = 2 ]; then
    ok "cases.py $c: $(grep -m1 "^rank 0: $c ok" "$TMP/$c.out" | cut -c1-150)"
  else
    fail "cases.py $c (exit $code)" "$TMP/$c.out"
  fi
done

echo "# tests/torch: $pass passed, $failed failed"
[ $failed = 0 ]
