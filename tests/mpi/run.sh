#!/usr/bin/env bash
# tests/mpi/run.sh [BUILD_DIR]: the MPI backend end to end, 4 ranks as processes under
# mpirun (oversubscribed on small machines, allowed as root), checking every rank's output
# and the job's exit status:
#   - collectives.lua (every collective x dtype x op on the world and every mesh group) on
#     2, 3 and 4 ranks, the same check counts as the threads backend; again with tiny MPI
#     calls (MOONSHARD_MPI_MAX_BYTES=16) so the piecewise and above-INT_MAX paths run;
#     a 20 MiB all_reduce and reduce_scatter (big.lua) in several pieces
#   - a host's own communicator (test_mpi_comm: two halves of the world as worlds of their own;
#     there also ranks posting the same collective for different shard units: a mismatch)
#   - sends and receives (test_mpi_p2p), also in pieces of 16 bytes: values on every rank,
#     a bad peer, a mismatch, a timeout and a finished peer; p2p.lua on 2, 3 and 4 ranks
#     under both interpreters, and a send whose peer never comes ending the job
#   - the same reductions of inexact values bit for bit equal to the threads backend's
#   - examples/quickstart.lua and the shard-unit runtime (units.lua) on 4 ranks
#   - moe_trainer with ranks as processes: a pipeline (pp=2; pp=2,dp_shard=2 in 4
#     micro-batches), FSDP (dp_shard=4) and tensor parallelism (tp=2; dp_shard=2,tp=2 with
#     sequence parallel), LoRA adapters from a recipe (HSDP 2x2), a warm-up and cosine
#     schedule with held-out evals (dp_shard=4; pp=2) print the threads run's banner,
#     losses, learning rates, gradient norms and eval losses and save its parameters, bit
#     for bit (only the timing fields, the banner's backend line and its totals differ)
#   - Megatron-FSDP's buckets (megatron_units.lua, the four strategies), a recipe's fp8
#     all-gather (recipe_units.lua) and a packed unit against separate units
#     (packed_units.lua, the threads run's bits) on 4 ranks
#   - a checkpoint saved on 4 processes and loaded on 4 (ckpt_units.lua): rank files and the
#     export the threads run's bytes; checkpoint verify and info of what MPI wrote; HSDP,
#     tensor-parallel and Megatron-FSDP checkpoints saved on 4 and loaded on 2 processes on
#     other meshes, as the threads runs
#   - the backend choice: mpi under mpirun, --backend / MOONSHARD_BACKEND, -n refused
#   - failures: a rank's error, a mismatch, a rank that finishes without joining, a rank
#     that never arrives (timeout) and a killed rank each end the whole job non-zero within
#     seconds, with the rank-prefixed message
# Exits 0 only when every check holds.  MPIEXEC overrides the launcher (default mpirun).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

BUILD_DIR=${1:-build}
BIN=$BUILD_DIR/moonshard
MPIEXEC=${MPIEXEC:-mpirun}
# --oversubscribe: more ranks than cores; --allow-run-as-root: CI containers run as root.
LAUNCH=("$MPIEXEC" --allow-run-as-root --oversubscribe)
LIMIT=60 # seconds any one job may take before it counts as hung

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
source tests/mpi/report.sh

# job NAME NP [VAR=VALUE...] -- ARGS...: runs moonshard on NP ranks; sets $code, $ms, $secs and
# leaves the output in $TMP/NAME.out and $TMP/NAME.err.
job() {
  local name=$1 np=$2
  shift 2
  local envs=() fwd=()
  while [ "$1" != -- ]; do
    envs+=("$1")
    fwd+=(-x "${1%%=*}")
    shift
  done
  shift
  local t0
  t0=$(date +%s%N)
  env "${envs[@]}" timeout -k 5 "$LIMIT" "${LAUNCH[@]}" "${fwd[@]}" -np "$np" "$BIN" "$@" \
    >"$TMP/$name.out" 2>"$TMP/$name.err" </dev/null
  code=$?
  ms=$((($(date +%s%N) - t0) / 1000000))
  secs=$((ms / 1000)).$((ms % 1000 / 100))
}

# has FILE PATTERN (extended regex)
has() { grep -Eq -- "$2" "$1"; }

# every_rank NAME NP REGEX_WITH_R: each rank r in 0..NP-1 printed the line (R replaced by r).
every_rank() {
  local name=$1 np=$2 re=$3
  for ((r = 0; r < np; r++)); do has "$TMP/$name.out" "${re//R/$r}" || return 1; done
}

[ -x "$BIN" ] || { echo "FAIL - $BIN is not built"; exit 1; }
command -v "$MPIEXEC" >/dev/null || { echo "FAIL - no $MPIEXEC"; exit 1; }
echo "# MPI suite: $BIN under $("$MPIEXEC" --version 2>/dev/null | head -1)"

# ---------------------------------------------------------------- collectives, every rank
for np in 2 3 4; do
  "$BIN" -n "$np" tests/lua/scripts/collectives.lua >"$TMP/threads$np.out" 2>&1
  want=$(grep -Eo '[0-9]+ checks ok' "$TMP/threads$np.out" | head -1)
  job "coll$np" "$np" -- tests/lua/scripts/collectives.lua
  if [ "$code" = 0 ] && [ -n "$want" ] && every_rank "coll$np" "$np" "^rank R: $want\$" &&
    [ "$(grep -c 'checks ok' "$TMP/coll$np.out")" = "$np" ]; then
    ok "collectives.lua on $np ranks: every rank '$want' (as the threads backend)"
  else
    fail "collectives.lua on $np ranks (exit $code, want '$want' per rank)" "$TMP/coll$np.out" "$TMP/coll$np.err"
  fi
done

job coll_pieces 4 MOONSHARD_MPI_MAX_BYTES=16 -- tests/lua/scripts/collectives.lua
if [ "$code" = 0 ] && every_rank coll_pieces 4 "^rank R: $want\$"; then
  ok "collectives.lua on 4 ranks in 16-byte MPI calls (pieces, strided types): every rank '$want'"
else
  fail "collectives.lua in 16-byte MPI calls (exit $code)" "$TMP/coll_pieces.out" "$TMP/coll_pieces.err"
fi

# p2p.lua: sends and receives from Lua, each rank checking what it received; the same
# counts as on threads, under both interpreters
for np in 2 3 4; do
  for exe in moonshard moonshard-jit; do
    [ -x "$BUILD_DIR/$exe" ] || continue
    "$BUILD_DIR/$exe" -n "$np" tests/lua/scripts/p2p.lua >"$TMP/p2p_threads$np.out" 2>&1
    BIN=$BUILD_DIR/$exe job "p2p_lua$np" "$np" -- tests/lua/scripts/p2p.lua
    if [ "$code" = 0 ] && [ "$(grep -c 'p2p checks ok' "$TMP/p2p_lua$np.out")" = "$np" ] &&
      [ "$(sort "$TMP/p2p_lua$np.out")" = "$(sort "$TMP/p2p_threads$np.out")" ]; then
      ok "p2p.lua ($exe) on $np ranks: every rank's sends and receives checked, as many as on threads"
    else
      fail "p2p.lua ($exe) on $np ranks (exit $code)" "$TMP/p2p_lua$np.out" "$TMP/p2p_lua$np.err"
    fi
  done
done

job big 4 -- tests/mpi/big.lua
if [ "$code" = 0 ] && every_rank big 4 "^rank R: big ok\$"; then
  ok "big.lua on 4 ranks: 20 MiB all_reduce f32 and reduce_scatter bf16 in 8 MiB pieces"
else
  fail "big.lua on 4 ranks (exit $code)" "$TMP/big.out" "$TMP/big.err"
fi

# ---------------------------------------------------------------- a host's communicator
# tests/mpi/test_mpi_comm.c: worlds of MPI_COMM_WORLD and of two halves split from it
if [ -x "$BUILD_DIR/test_mpi_comm" ]; then
  timeout -k 5 "$LIMIT" "${LAUNCH[@]}" -np 4 "$BUILD_DIR/test_mpi_comm" >"$TMP/comm.out" 2>"$TMP/comm.err" </dev/null
  code=$?
  if [ "$code" = 0 ] && every_rank comm 4 "^rank R: mpi comm ok "; then
    ok "a host's communicator split in halves: each half a moonshard world beside MPI_COMM_WORLD's, every rank's sums and gathers right, a label mismatch named on every rank"
  else
    fail "a host's communicator (exit $code)" "$TMP/comm.out" "$TMP/comm.err"
  fi
else
  fail "$BUILD_DIR/test_mpi_comm is not built"
fi

# tests/mpi/test_mpi_p2p.c: sends and receives, every rank checking what it received; again
# with every tensor in pieces of 16 bytes
for pieces in "" 16; do
  name=p2p${pieces:+_pieces}
  if [ -x "$BUILD_DIR/test_mpi_p2p" ]; then
    env ${pieces:+MOONSHARD_MPI_MAX_BYTES=$pieces} timeout -k 5 "$LIMIT" "${LAUNCH[@]}" \
      ${pieces:+-x MOONSHARD_MPI_MAX_BYTES} -np 4 "$BUILD_DIR/test_mpi_p2p" >"$TMP/$name.out" 2>"$TMP/$name.err" </dev/null
    code=$?
    if [ "$code" = 0 ] && every_rank "$name" 4 "^rank R: mpi p2p ok "; then
      ok "sends and receives${pieces:+ in pieces of $pieces bytes}: ring, pipeline, pairs, every peer at once, groups, each rank's tensors right; a bad peer, a mismatch, a timeout naming rank 3, a finished peer"
    else
      fail "sends and receives${pieces:+ in pieces} (exit $code)" "$TMP/$name.out" "$TMP/$name.err"
    fi
  else
    fail "$BUILD_DIR/test_mpi_p2p is not built"
  fi
done

# ---------------------------------------------------------------- bit for bit as threads
"$BIN" -n 4 tests/mpi/same_bits.lua "$TMP/bits_threads" >/dev/null 2>"$TMP/bits_threads.err"
cat "$TMP"/bits_threads.[0-3] 2>/dev/null | sort >"$TMP/bits_threads.txt"
nlines=$(wc -l <"$TMP/bits_threads.txt")
for max in default 16; do
  envs=()
  [ "$max" = 16 ] && envs=(MOONSHARD_MPI_MAX_BYTES=16)
  job "bits$max" 4 "${envs[@]}" -- tests/mpi/same_bits.lua "$TMP/bits_mpi$max"
  cat "$TMP/bits_mpi$max".[0-3] 2>/dev/null | sort >"$TMP/bits_mpi$max.txt"
  if [ "$code" = 0 ] && [ "$nlines" -gt 800 ] && cmp -s "$TMP/bits_threads.txt" "$TMP/bits_mpi$max.txt"; then
    ok "same_bits.lua: $nlines reductions (f32 bf16 f16 fp8 f64; 7 and 3001 elements) bit for bit equal to threads (MPI calls: $max bytes)"
  else
    diff "$TMP/bits_threads.txt" "$TMP/bits_mpi$max.txt" >"$TMP/bits$max.diff"
    fail "same_bits.lua differs from the threads backend (exit $code, MPI calls: $max bytes)" \
      "$TMP/bits$max.diff" "$TMP/bits$max.err"
  fi
done

# ---------------------------------------------------------------- moe_trainer
# Under mpirun each process is one rank (run_mpi_rank in examples/moe_trainer/main.c); the
# sends between pipeline stages, the units' collectives and the loss all go through MPI,
# and give what the threads world gives (the reductions are bit for bit the same).
TRAINER=$BUILD_DIR/moe_trainer
# trainer_bits FILE: the trainer's output without what differs between identical runs or
# backends: the timing fields (time_ms, tokens_per_s: the last on a step or eval line), the
# banner's first line (threads or MPI processes) and its totals ("# done:").
trainer_bits() { sed -E -e '/^# (moe_trainer|done):/d' -e 's/ time_ms .*$//' "$1"; }
if [ -x "$TRAINER" ]; then
  printf 'hidden_size = 32\nexpert_dim = 32\nseq_len = 32\n' >"$TMP/trainer.cfg"
  sched="--lr 1e-2 --warmup-steps 2 --min-lr 1e-3 --eval-every 2 --eval-batches 2"
  for case in "2 pp=2" "4 pp=2,dp_shard=2 --microbatches 4" "4 dp_shard=4" "2 tp=2" "4 dp_shard=2,tp=2 --sequence-parallel" \
    "4 dp_replicate=2,dp_shard=2 --recipe examples/recipes/moe_trainer_lora.lua" "4 dp_shard=4 $sched" "2 pp=2 $sched"; do
    read -r np mesh extra <<<"$case"
    name=trainer_${mesh//[=,]/_}${extra:+_$(printf %s "$extra" | cksum | cut -d' ' -f1)}
    targs=(-n "$np" --mesh "$mesh" --policy policies/full_fp32.lua --steps 5 --seed 7 --config "$TMP/trainer.cfg")
    [ -n "${extra:-}" ] && read -r -a more <<<"$extra" && targs+=("${more[@]}")
    "$TRAINER" "${targs[@]}" --save "$TMP/$name.threads.st" >"$TMP/$name.threads.out" 2>&1
    BIN=$TRAINER job "$name" "$np" -- "${targs[@]}" --save "$TMP/$name.st"
    evals=0 what="losses, learning rates, gradient norms" # --eval-every 2 of 5 steps: after steps 2, 4 and 5
    [[ "${extra:-}" == *--eval-every* ]] && evals=3 what+=", eval losses"
    if [ "$code" = 0 ] && [ "$(grep -c '^step [0-9]* loss [^ ]* lr [^ ]* grad_norm ' "$TMP/$name.out")" = 5 ] &&
      [ "$(grep -c '^eval [0-9]* loss ' "$TMP/$name.out")" = "$evals" ] && grep -q '^# units: ' "$TMP/$name.out" &&
      cmp -s <(trainer_bits "$TMP/$name.out") <(trainer_bits "$TMP/$name.threads.out") &&
      cmp -s "$TMP/$name.st" "$TMP/$name.threads.st"; then
      ok "moe_trainer -np $np --mesh $mesh${extra:+ $extra}: ranks as processes, the threads run's banner, $what and saved parameters bit for bit"
    else
      fail "moe_trainer -np $np --mesh $mesh (exit $code; the threads run printed $(grep -c '^step' "$TMP/$name.threads.out") steps)" \
        "$TMP/$name.out" "$TMP/$name.err" "$TMP/$name.threads.out"
    fi
  done
  BIN=$TRAINER job trainer_np 3 -- -n 2 --mesh pp=2 --policy policies/full_fp32.lua --steps 1 --seed 7
  if [ "$code" != 0 ] && has "$TMP/trainer_np.err" "-n 2, but the MPI launcher started 3 ranks"; then
    ok "moe_trainer -n 2 under mpirun -np 3: refused, naming both counts"
  else
    fail "moe_trainer -n 2 under mpirun -np 3 (exit $code)" "$TMP/trainer_np.out" "$TMP/trainer_np.err"
  fi
  # checkpoints: saved at step 3 by 4 processes, resumed to step 5 by 4 processes (the
  # uninterrupted threads run's bits, "4 dp_shard=4" above) and by 2 threads (dp_shard=2)
  cargs=(--policy policies/full_fp32.lua --seed 7 --config "$TMP/trainer.cfg")
  BIN=$TRAINER job trainer_ckpt_save 4 -- -n 4 --mesh dp_shard=4 "${cargs[@]}" --steps 3 --save-dir "$TMP/trainer_ckpt"
  save_code=$code
  BIN=$TRAINER job trainer_ckpt_resume 4 -- -n 4 --mesh dp_shard=4 "${cargs[@]}" --steps 5 --resume "$TMP/trainer_ckpt" \
    --save "$TMP/trainer_ckpt_resume.st"
  "$TRAINER" -n 2 --mesh dp_shard=2 "${cargs[@]}" --steps 5 --resume "$TMP/trainer_ckpt" >"$TMP/trainer_ckpt_2.out" 2>&1
  threads2=$?
  if [ "$save_code" = 0 ] && [ "$code" = 0 ] && [ "$threads2" = 0 ] &&
    cmp -s <(grep '^step [45] ' "$TMP/trainer_ckpt_resume.out" | sed 's/ time_ms .*//') \
      <(grep '^step [45] ' "$TMP/trainer_dp_shard_4.threads.out" | sed 's/ time_ms .*//') &&
    cmp -s "$TMP/trainer_ckpt_resume.st" "$TMP/trainer_dp_shard_4.threads.st" &&
    [ "$(grep -c '^step [45] ' "$TMP/trainer_ckpt_2.out")" = 2 ]; then
    ok "moe_trainer checkpoint of 4 processes at step 3: resumed by 4 processes to step 5 bit for bit, and by 2 threads"
  else
    fail "moe_trainer checkpoint saved by 4 processes, resumed (exit $save_code, $code, $threads2)" \
      "$TMP/trainer_ckpt_save.err" "$TMP/trainer_ckpt_resume.out" "$TMP/trainer_ckpt_resume.err" "$TMP/trainer_ckpt_2.out"
  fi
fi

# ---------------------------------------------------------------- the quickstart, units
job quickstart 4 -- examples/quickstart.lua
if [ "$code" = 0 ] && has "$TMP/quickstart.out" "4 ranks .*backend mpi" &&
  every_rank quickstart 4 "rank R ok: .*54/54 bits exact, grad max diff 0"; then
  ok "quickstart.lua on 4 ranks: backend mpi, every rank ok, bf16 gather bit-exact"
else
  fail "quickstart.lua on 4 ranks (exit $code)" "$TMP/quickstart.out" "$TMP/quickstart.err"
fi

for mesh in dp_shard=4 dp_replicate=2,dp_shard=2 dp_shard=4,ep=2; do
  job "units_$mesh" 4 -- tests/lua/scripts/units.lua "$mesh"
  if [ "$code" = 0 ] && every_rank "units_$mesh" 4 "^rank R: units ok"; then
    ok "units.lua $mesh on 4 ranks (collectives from the communication threads): every rank ok"
  else
    fail "units.lua $mesh (exit $code)" "$TMP/units_$mesh.out" "$TMP/units_$mesh.err"
  fi
done

# Megatron-FSDP's buckets (ZeRO-0..3), the fp8 all-gather of a recipe's plan
for strategy in no_shard optim optim_grads optim_grads_params; do
  job "megatron_$strategy" 4 -- tests/lua/scripts/megatron_units.lua "$strategy"
  if [ "$code" = 0 ] && every_rank "megatron_$strategy" 4 "^rank R: megatron $strategy W=4: params max diff 0 "; then
    ok "megatron_units.lua $strategy on 4 ranks: every rank's slice the 1-rank run's bits"
  else
    fail "megatron_units.lua $strategy (exit $code)" "$TMP/megatron_$strategy.out" "$TMP/megatron_$strategy.err"
  fi
done
job recipe_units 4 -- tests/lua/scripts/recipe_units.lua hsdp
if [ "$code" = 0 ] && every_rank recipe_units 4 "^recipe_units ok R$"; then
  ok "recipe_units.lua hsdp on 4 ranks: the fp8 step's weights gathered as torchao's e4m3 on every rank"
else
  fail "recipe_units.lua hsdp (exit $code)" "$TMP/recipe_units.out" "$TMP/recipe_units.err"
fi

# a packed unit (the layer and its fp32 islands in one unit) against separate units: the same
# bits on every rank, and the threads backend's bits
job packed_units 4 -- tests/lua/scripts/packed_units.lua hsdp bf16reduce
"$BIN" -n 4 tests/lua/scripts/packed_units.lua hsdp bf16reduce >"$TMP/packed_threads.out" 2>&1
if [ "$code" = 0 ] && every_rank packed_units 4 "^packed_units ok R collectives 5/18 " &&
  [ "$(grep '^packed_units ok' "$TMP/packed_units.out" | sort)" = \
    "$(grep '^packed_units ok' "$TMP/packed_threads.out" | sort)" ]; then
  ok "packed_units.lua hsdp bf16reduce on 4 ranks: the separate units' bits in 5 collectives for 18, the threads run's"
else
  fail "packed_units.lua hsdp bf16reduce (exit $code)" "$TMP/packed_units.out" "$TMP/packed_units.err" \
    "$TMP/packed_threads.out"
fi

# ---------------------------------------------------------------- checkpoints
# saved on 4 processes after step 2 and loaded on 4 to step 4: the rank files and the export
# the same bytes as the threads run's; checkpoint verify of what MPI wrote
"$BIN" -n 4 tests/lua/scripts/ckpt_units.lua dp_shard=4 2 "save=2:$TMP/ckpt_threads" >"$TMP/ckpt_t1.out" 2>&1 &&
  "$BIN" -n 4 tests/lua/scripts/ckpt_units.lua dp_shard=4 4 "load=$TMP/ckpt_threads" "export=$TMP/export_threads" \
    >"$TMP/ckpt_t2.out" 2>&1
tcode=$?
job ckpt_save 4 -- tests/lua/scripts/ckpt_units.lua dp_shard=4 2 "save=2:$TMP/ckpt_mpi"
scode=$code
job ckpt_load 4 -- tests/lua/scripts/ckpt_units.lua dp_shard=4 4 "load=$TMP/ckpt_mpi" "export=$TMP/export_mpi"
same=yes
for f in "$TMP"/ckpt_threads/step_00000002/rank*.safetensors; do
  cmp -s "$f" "$TMP/ckpt_mpi/step_00000002/${f##*/}" || same=no
done
cat "$TMP"/export_threads/*.safetensors >"$TMP/export_threads.bin" 2>/dev/null
cat "$TMP"/export_mpi/*.safetensors >"$TMP/export_mpi.bin" 2>/dev/null
cmp -s "$TMP/export_threads.bin" "$TMP/export_mpi.bin" && [ -s "$TMP/export_mpi.bin" ] || same=no
if [ "$tcode" = 0 ] && [ "$scode" = 0 ] && [ "$code" = 0 ] && [ $same = yes ] &&
  every_rank ckpt_load 4 "^rank R: ckpt_units ok"; then
  ok "checkpoint saved on 4 MPI processes, loaded on 4 and trained on: rank files and export the threads run's bytes"
else
  fail "checkpoint under MPI (threads $tcode, save $scode, load $code, same bytes $same)" "$TMP/ckpt_save.err" \
    "$TMP/ckpt_load.err" "$TMP/ckpt_t1.out" "$TMP/ckpt_t2.out"
fi
# other units and meshes: HSDP saved, loaded on dp_shard=2,ep=2; tensor parallelism saved on
# tp=2,dp_shard=2, loaded on tp=2; Megatron-FSDP ZeRO-3 buckets saved, loaded as ZeRO-1 on 2.
# Each saved by 4 processes and loaded by the load's count of processes: the rank files and
# the export the bytes of the same two runs on threads.
for case in "dp_replicate=2,dp_shard=2|2|dp_shard=2,ep=2|" "tp=2,dp_shard=2|2|tp=2|heads=4:2" \
  "dp_shard=4|2|dp_shard=2|mfsdp=optim_grads_params|mfsdp=optim"; do
  IFS='|' read -r smesh lnp lmesh sextra lextra <<<"$case"
  [ -n "$lextra" ] || lextra=$sextra
  name=ckpt_${smesh//[=,]/_}_${lmesh//[=,]/_}
  sx=() lx=()
  [ -n "$sextra" ] && sx=("$sextra")
  [ -n "$lextra" ] && lx=("$lextra")
  "$BIN" -n 4 tests/lua/scripts/ckpt_units.lua "$smesh" 2 "${sx[@]}" "save=2:$TMP/$name.threads" \
    >"$TMP/$name.t1.out" 2>&1 &&
    "$BIN" -n "$lnp" tests/lua/scripts/ckpt_units.lua "$lmesh" 4 "${lx[@]}" "load=$TMP/$name.threads" \
      "export=$TMP/$name.export_threads" >"$TMP/$name.t2.out" 2>&1
  tcode=$?
  job "${name}_save" 4 -- tests/lua/scripts/ckpt_units.lua "$smesh" 2 "${sx[@]}" "save=2:$TMP/$name.mpi"
  scode=$code
  job "${name}_load" "$lnp" -- tests/lua/scripts/ckpt_units.lua "$lmesh" 4 "${lx[@]}" "load=$TMP/$name.mpi" \
    "export=$TMP/$name.export_mpi"
  same=yes files=0
  for f in "$TMP/$name.threads"/step_00000002/rank*.safetensors; do
    cmp -s "$f" "$TMP/$name.mpi/step_00000002/${f##*/}" || same=no
    files=$((files + 1))
  done
  cat "$TMP/$name.export_threads"/*.safetensors >"$TMP/$name.et.bin" 2>/dev/null
  cat "$TMP/$name.export_mpi"/*.safetensors >"$TMP/$name.em.bin" 2>/dev/null
  cmp -s "$TMP/$name.et.bin" "$TMP/$name.em.bin" && [ -s "$TMP/$name.em.bin" ] || same=no
  if [ "$tcode" = 0 ] && [ "$scode" = 0 ] && [ "$code" = 0 ] && [ $same = yes ] && [ "$files" -ge 2 ] &&
    every_rank "${name}_load" "$lnp" "^rank R: ckpt_units ok"; then
    ok "checkpoint of $smesh${sextra:+ $sextra} saved by 4 MPI processes ($files rank files), loaded on $lnp as $lmesh${lextra:+ $lextra}: the threads runs' bytes"
  else
    fail "checkpoint $smesh -> $lmesh under MPI (threads $tcode, save $scode, load $code, same bytes $same, $files files)" \
      "$TMP/${name}_save.err" "$TMP/${name}_load.err" "$TMP/$name.t1.out" "$TMP/$name.t2.out"
  fi
done
"$BIN" checkpoint verify "$TMP/ckpt_mpi" >"$TMP/ckpt_verify.out" 2>&1
vcode=$?
"$BIN" checkpoint info "$TMP/ckpt_mpi" >"$TMP/ckpt_info.out" 2>&1
if [ $vcode = 0 ] && has "$TMP/ckpt_verify.out" ': ok, [0-9]+ boxes of 45 tensors in 4 files' &&
  has "$TMP/ckpt_info.out" 'written by 4 ranks \(mpi\)'; then
  ok "checkpoint verify of what 4 MPI processes wrote: every box's crc32c right, the index says mpi"
else
  fail "checkpoint verify of the MPI checkpoint (exit $vcode)" "$TMP/ckpt_verify.out" "$TMP/ckpt_info.out"
fi

# ---------------------------------------------------------------- LuaJIT ranks over MPI
if [ -x "$BUILD_DIR/moonshard-jit" ]; then
  BIN=$BUILD_DIR/moonshard-jit job jit_who 2 -- -e 'print((jit and jit.version or "not LuaJIT") .. " " ..
    require("moonshard").backend())'
  jit_code=$code
  BIN=$BUILD_DIR/moonshard-jit job quickstart_jit 4 -- examples/quickstart.lua
  if [ "$jit_code" = 0 ] && has "$TMP/jit_who.out" "^LuaJIT .* mpi$" && [ "$code" = 0 ] &&
    has "$TMP/quickstart_jit.out" "4 ranks .*backend mpi" &&
    every_rank quickstart_jit 4 "rank R ok: .*54/54 bits exact, grad max diff 0"; then
    ok "moonshard-jit: quickstart.lua on 4 MPI ranks, each a LuaJIT state: every rank ok"
  else
    fail "moonshard-jit quickstart.lua on 4 MPI ranks (exit $code)" "$TMP/quickstart_jit.out" "$TMP/quickstart_jit.err"
  fi
fi

# ---------------------------------------------------------------- the backend choice
who='local ms = require "moonshard"; print(ms.backend(), ms.rank(), ms.world_size())'
job who 3 -- -e "$who"
if [ "$code" = 0 ] && every_rank who 3 "^mpi	R	3\$"; then
  ok "under mpirun: ms.backend() is mpi, ranks 0..2 of 3"
else
  fail "backend under mpirun (exit $code)" "$TMP/who.out" "$TMP/who.err"
fi
job who_flag 2 -- --backend threads -e "$who"
if [ "$code" = 0 ] && [ "$(grep -c '^threads	0	1$' "$TMP/who_flag.out")" = 2 ]; then
  ok "--backend threads under mpirun: each process its own threads world"
else
  fail "--backend threads under mpirun (exit $code)" "$TMP/who_flag.out" "$TMP/who_flag.err"
fi
job who_env 2 MOONSHARD_BACKEND=threads -- -e "$who"
if [ "$code" = 0 ] && [ "$(grep -c '^threads	0	1$' "$TMP/who_env.out")" = 2 ]; then
  ok "MOONSHARD_BACKEND=threads under mpirun: threads"
else
  fail "MOONSHARD_BACKEND=threads under mpirun (exit $code)" "$TMP/who_env.out" "$TMP/who_env.err"
fi
job n_refused 2 -- -n 2 -e "$who"
if [ "$code" = 2 ] && has "$TMP/n_refused.err" "-n 2: with the mpi backend each process is one rank"; then
  ok "-n 2 under mpirun: usage error, exit 2"
else
  fail "-n 2 under mpirun (exit $code)" "$TMP/n_refused.out" "$TMP/n_refused.err"
fi
timeout "$LIMIT" "$BIN" --backend mpi -e "$who" >"$TMP/single.out" 2>"$TMP/single.err"
code=$?
if [ "$code" = 0 ] && has "$TMP/single.out" "^mpi	0	1\$"; then
  ok "--backend mpi without a launcher: a world of one rank"
else
  fail "--backend mpi without a launcher (exit $code)" "$TMP/single.out" "$TMP/single.err"
fi

# ---------------------------------------------------------------- failures end the job
group='local ms = require "moonshard"; local g = ms.mesh({{"dp", 4}}):group("dp")'
quick=10 # seconds within which a failed job must have ended

job error 4 -- -e "$group
if ms.rank() == 2 then error('boom on purpose') end
g:all_reduce(ms.tensor({8}))
print('rank', ms.rank(), 'passed')"
if [ "$code" != 0 ] && has "$TMP/error.err" "^\[rank 2\] \(command line\):2: boom on purpose" &&
  has "$TMP/error.err" "^\[rank 2\] stack traceback:" && ! has "$TMP/error.out" passed &&
  ((ms < quick * 1000)); then
  ok "a rank's error: '[rank 2] ... boom on purpose', the job aborted (exit $code) in $secs s"
else
  fail "a rank's error (exit $code, $secs s)" "$TMP/error.out" "$TMP/error.err"
fi

job mismatch 4 -- -e "$group
g:all_reduce(ms.tensor({ms.rank() == 1 and 4 or 8}))"
if [ "$code" != 0 ] &&
  has "$TMP/mismatch.err" "^\[rank [0-3]\] .*moonshard mismatch error: all_reduce on group \[0 1 2 3\]: ranks disagree: ranks 0 2 3: 8 x f32 sum; rank 1: 4 x f32 sum" &&
  ((ms < quick * 1000)); then
  ok "a mismatch: 'ranks disagree: ranks 0 2 3: 8 x f32 sum; rank 1: 4 x f32 sum', exit $code in $secs s"
else
  fail "a mismatch (exit $code, $secs s)" "$TMP/mismatch.out" "$TMP/mismatch.err"
fi

job finished 4 MOONSHARD_TIMEOUT=60 -- -e "$group
if ms.rank() ~= 3 then g:barrier() end"
if [ "$code" != 0 ] && has "$TMP/finished.err" "peer_failed error: barrier on group \[0 1 2 3\]: rank 3 finished its script without joining barrier" &&
  ((ms < quick * 1000)); then
  ok "a rank that finishes without joining: peers fail at once ('rank 3 finished its script without joining barrier') in $secs s"
else
  fail "a rank that finishes without joining (exit $code, $secs s)" "$TMP/finished.out" "$TMP/finished.err"
fi

job timeout 4 MOONSHARD_TIMEOUT=2 -- -e "$group
if ms.rank() == 2 then local t = os.time(); while os.time() - t < 30 do end else g:all_reduce(ms.tensor({8})) end"
if [ "$code" != 0 ] && has "$TMP/timeout.err" "timeout error: all_reduce on group \[0 1 2 3\] timed out after 2 s: ranks that did not arrive: 2 " &&
  ((ms < (2 + quick) * 1000)); then
  ok "a rank that never arrives: MOONSHARD_TIMEOUT=2 ends the job (exit $code) in $secs s, not 30, naming rank 2"
else
  fail "a rank that never arrives (exit $code, $secs s)" "$TMP/timeout.out" "$TMP/timeout.err"
fi

# (the ranks the send does not involve stay too: Open MPI 4.1 was seen to hang the job past
# MPI_Abort when ranks had finalized before the abort)
job p2p_timeout 4 MOONSHARD_TIMEOUT=2 -- -e "$group
if ms.rank() == 0 then g:send(ms.tensor({8}), 2) else local t = os.time(); while os.time() - t < 30 do end end"
if [ "$code" != 0 ] && has "$TMP/p2p_timeout.err" "timeout error: send/recv on group \[0 1 2 3\] between rank 0 and rank 2 timed out after 2 s: rank 2 did not arrive" &&
  ((ms < (2 + quick) * 1000)); then
  ok "a send whose peer never comes: MOONSHARD_TIMEOUT=2 ends the job (exit $code) in $secs s, naming rank 2"
else
  fail "a send whose peer never comes (exit $code, $secs s)" "$TMP/p2p_timeout.out" "$TMP/p2p_timeout.err"
fi

job killed 4 -- -e "$group
if ms.rank() == 1 then os.execute('kill -9 \$PPID') end
g:barrier()"
if [ "$code" != 0 ] && has "$TMP/killed.err" "rank 1 .*(signal 9|Killed)" && ((ms < quick * 1000)); then
  ok "a killed rank (SIGKILL): the launcher ends the job (exit $code) in $secs s"
else
  fail "a killed rank (exit $code, $secs s)" "$TMP/killed.out" "$TMP/killed.err"
fi

echo "# MPI suite: $passed passed, $failed failed"
[ "$failed" = 0 ]
