#!/usr/bin/env bash
# tests/mpi/netns.sh [BUILD_DIR]: moonshard across two hosts, MPI over TCP between them.
#
# The two hosts are network namespaces on this machine joined by a veth pair with private
# addresses (10.77.0.1 and 10.77.0.2/24: nothing leaves the machine), each with its own
# hostname (a UTS namespace).  mpirun runs in the first; its rsh agent is a script that
# starts OpenMPI's daemon in the namespace named by the host instead of over ssh.  Two
# ranks per host; the TCP BTL carries the traffic between the hosts, shared memory within
# one.  Checks: the quickstart and collectives.lua across the hosts (every rank ok, ranks 0
# and 1 on h1, 2 and 3 on h2, the veth carried the bytes), and a rank failing on the
# second host ending the job within seconds.
#
# Needs root (ip netns, veth) and unshare; exits 77 (skipped) without them.  Everything it
# creates is removed on exit.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

BUILD_DIR=${1:-build}
BIN=$(realpath -m "$BUILD_DIR/moonshard") # the namespaces' shells start elsewhere
MPIEXEC=${MPIEXEC:-mpirun}
NS=ms$$ # namespaces $NS-h1, $NS-h2; veths ${NS}a, ${NS}b (15 characters at most)

skip() { echo "skip - $1"; exit 77; }
[ "$(id -u)" = 0 ] || skip "not root"
command -v ip >/dev/null && command -v unshare >/dev/null || skip "no ip or unshare"
[ -x "$BIN" ] || { echo "FAIL - $BIN is not built"; exit 1; }

TMP=$(mktemp -d)
cleanup() {
  for h in h1 h2; do
    for pid in $(ip netns pids "$NS-$h" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
    ip netns del "$NS-$h" 2>/dev/null
  done
  rm -rf "$TMP"
}
trap cleanup EXIT

ip netns add "$NS-h1" && ip netns add "$NS-h2" || skip "cannot create network namespaces"
ip netns exec "$NS-h1" unshare --uts true || skip "cannot enter a network namespace with its own hostname"
ip link add "${NS}a" type veth peer name "${NS}b" || skip "cannot create a veth pair"
ip link set "${NS}a" netns "$NS-h1"
ip link set "${NS}b" netns "$NS-h2"
ip -n "$NS-h1" addr add 10.77.0.1/24 dev "${NS}a"
ip -n "$NS-h2" addr add 10.77.0.2/24 dev "${NS}b"
for h in h1 h2; do ip -n "$NS-$h" link set lo up; done
ip -n "$NS-h1" link set "${NS}a" up
ip -n "$NS-h2" link set "${NS}b" up

# OpenMPI's rsh agent: "agent HOST COMMAND..." runs COMMAND in host HOST's namespace.
cat >"$TMP/agent.sh" <<EOF
#!/bin/sh
host=\$1; shift
exec ip netns exec "$NS-\$host" unshare --uts sh -c "hostname \$host; \$*"
EOF
chmod +x "$TMP/agent.sh"
printf 'h1 slots=2\nh2 slots=2\n' >"$TMP/hosts"

source tests/mpi/report.sh

tx_bytes() { ip -n "$NS-h1" -s link show "${NS}a" | awk '/TX:/ { getline; print $1; exit }'; }

# across NAME ARGS...: moonshard on 4 ranks over the two hosts; sets $code, $ms.
across() {
  local name=$1
  shift
  local args="" a t0
  for a in "$@"; do args+=" '${a//\'/\'\\\'\'}'"; done
  t0=$(date +%s%N)
  timeout -k 5 120 ip netns exec "$NS-h1" unshare --uts sh -c "hostname launcher; exec $MPIEXEC \
    --allow-run-as-root --hostfile $TMP/hosts -np 4 \
    --mca plm_rsh_agent $TMP/agent.sh --mca plm_rsh_no_tree_spawn 1 \
    --mca oob_tcp_if_include 10.77.0.0/24 --mca btl_tcp_if_include 10.77.0.0/24 --mca btl tcp,vader,self \
    $BIN $args" >"$TMP/$name.out" 2>"$TMP/$name.err" </dev/null
  code=$?
  ms=$((($(date +%s%N) - t0) / 1000000))
}

echo "# multi-host: hosts h1 (10.77.0.1) and h2 (10.77.0.2) as network namespaces, MPI over TCP"

across where -e 'local ms = require "moonshard"; print(ms.rank(), ms.backend(), io.popen("hostname"):read("l"))'
if [ "$code" = 0 ] && grep -q "^0	mpi	h1$" "$TMP/where.out" && grep -q "^1	mpi	h1$" "$TMP/where.out" &&
  grep -q "^2	mpi	h2$" "$TMP/where.out" && grep -q "^3	mpi	h2$" "$TMP/where.out"; then
  ok "4 ranks: 0 and 1 on h1, 2 and 3 on h2, backend mpi"
else
  fail "placement across the hosts (exit $code)" "$TMP/where.out" "$TMP/where.err"
fi

tx0=$(tx_bytes)
across quickstart examples/quickstart.lua
tx1=$(tx_bytes)
if [ "$code" = 0 ] && grep -q "4 ranks .*backend mpi" "$TMP/quickstart.out" &&
  [ "$(grep -c 'rank [0-3] ok: .*54/54 bits exact, grad max diff 0' "$TMP/quickstart.out")" = 4 ] &&
  [ $((tx1 - tx0)) -gt 0 ]; then
  ok "quickstart.lua across the hosts: every rank ok ($((tx1 - tx0)) bytes sent from h1 over the veth)"
else
  fail "quickstart.lua across the hosts (exit $code, $((tx1 - tx0)) bytes over the veth)" \
    "$TMP/quickstart.out" "$TMP/quickstart.err"
fi

across coll tests/lua/scripts/collectives.lua
if [ "$code" = 0 ] && [ "$(grep -c '^rank [0-3]: 1264 checks ok$' "$TMP/coll.out")" = 4 ]; then
  ok "collectives.lua across the hosts: every rank 1264 checks ok"
else
  fail "collectives.lua across the hosts (exit $code)" "$TMP/coll.out" "$TMP/coll.err"
fi

across dead -e 'local ms = require "moonshard"; local g = ms.mesh({{"dp", 4}}):group("dp")
if ms.rank() == 3 then error("boom on h2") end
g:all_reduce(ms.tensor({8}))'
if [ "$code" != 0 ] && grep -q '^\[rank 3\] (command line):2: boom on h2' "$TMP/dead.err" && [ "$ms" -lt 15000 ]; then
  ok "a rank failing on h2 ends the job across both hosts (exit $code) in $((ms / 1000)).$((ms % 1000 / 100)) s"
else
  fail "a rank failing on h2 (exit $code, $ms ms)" "$TMP/dead.out" "$TMP/dead.err"
fi

echo "# multi-host: $passed passed, $failed failed"
[ "$failed" = 0 ]
