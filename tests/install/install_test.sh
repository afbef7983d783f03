#!/usr/bin/env bash
# install_test.sh BUILD_DIR: installs the build into a scratch prefix and uses it the way a
# user would: the installed moonshard, `require "moonshard"` from a stock lua5.4, and a C
# host compiled against libmoonshard found through pkg-config.
set -euo pipefail
build=$1
cd "$(dirname "$0")/../.."
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix" >/dev/null

out=$("$prefix/bin/moonshard" -n 2 -e 'local ms = require "moonshard"; print(ms.rank(), ms.backend())' | sort)
[ "$out" = $'0\tthreads\n1\tthreads' ] || { echo "installed moonshard printed: $out"; exit 1; }

# the installed policies and configs plan from anywhere, with the installed executable
share=$prefix/share/moonshard
out=$(cd / && "$prefix/bin/moonshard" plan --config "$share/configs/inkling2_small.json" --mesh dp_shard=8 \
      --policy "$share/policies/inkling2" --json)
case $out in *'"units"'*) ;; *) echo "installed plan printed: $out"; exit 1 ;; esac
for f in policies/fsdp2_default.lua policies/by_dtype.lua policies/inkling2/fp32_modules.lua configs/llama3.1_8b.json; do
  [ -f "$share/$f" ] || { echo "not installed: $share/$f"; exit 1; }
done

libdir=$(dirname "$(find "$prefix" -name 'libmoonshard.so' | head -1)")
# the installed libraries export their headers' functions and nothing else (no ms__ internals,
# none of the Lua binding inside libmoonshard_embed)
for pair in "libmoonshard.so:moonshard.h" "libmoonshard_embed.so:moonshard_embed.h"; do
  lib=$libdir/${pair%%:*} header=$prefix/include/${pair#*:}
  [ -f "$lib" ] || continue
  names=$(nm -D --defined-only "$lib" | awk '$2 ~ /^[TDBRVWGS]$/ {print $3}')
  [ -n "$names" ] || { echo "$lib exports nothing"; exit 1; }
  for sym in $names; do
    grep -q "\<$sym(" "$header" || { echo "$lib exports $sym, which $header does not declare"; exit 1; }
  done
done
# the embedding library finds libmoonshard beside it (RUNPATH $ORIGIN), wherever the prefix is
if ldd "$libdir/libmoonshard_embed.so.0" | grep -q 'not found'; then
  echo "installed libmoonshard_embed has unresolved libraries:"; ldd "$libdir/libmoonshard_embed.so.0"; exit 1
fi
out=$(cd / && LUA_PATH="$prefix/share/lua/5.4/?.lua;$prefix/share/lua/5.4/?/init.lua;;" \
      LUA_CPATH="$libdir/lua/5.4/?.so;;" \
      lua5.4 -e 'local ms = require "moonshard"; print(ms.world_size(), ms.from_table({1/3}, "bf16"):bits()[1])')
[ "$out" = $'1\t16043' ] || { echo "stock lua5.4 printed: $out"; exit 1; }

# LuaJIT: the installed moonshard-jit, and `require "moonshard"` from a stock luajit through
# the FFI (the library found next to the installed cdef.lua; no LUA_CPATH)
if [ -x "$prefix/bin/moonshard-jit" ]; then
  out=$("$prefix/bin/moonshard-jit" -n 2 -e 'local ms = require "moonshard"; print(ms.rank(), jit.version)' | sort)
  v=$(luajit -e 'io.write(jit.version)')
  [ "$out" = "0	$v"$'\n'"1	$v" ] || { echo "installed moonshard-jit printed: $out"; exit 1; }
  out=$(cd / && LUA_PATH="$prefix/share/lua/5.4/?.lua;$prefix/share/lua/5.4/?/init.lua;;" \
        luajit -e 'local ms = require "moonshard"; print(ms.world_size(), ms.from_table({1/3}, "bf16"):bits()[1])')
  [ "$out" = $'1\t16043' ] || { echo "stock luajit printed: $out"; exit 1; }
fi

cat >"$prefix/host.c" <<'C'
#include <moonshard.h>
#include <stdio.h>
int main(void) {
    ms_tensor *t;
    ms_status st = ms_tensor_new(&t, 2, (int64_t[]){3, 4}, MS_BF16, MS_DEVICE_CPU, 0);
    if (st) { printf("%s: %s\n", ms_status_name(st), ms_last_error()); return 1; }
    printf("%lld\n", (long long)ms_tensor_nbytes(t));
    ms_tensor_release(t);
    return 0;
}
C
export PKG_CONFIG_PATH="$libdir/pkgconfig"
# shellcheck disable=SC2046
cc -std=c11 -Wall -Werror "$prefix/host.c" $(pkg-config --cflags --libs moonshard) \
   -Wl,-rpath,"$libdir" -o "$prefix/host"
out=$("$prefix/host")
[ "$out" = 24 ] || { echo "host printed: $out"; exit 1; }
# the embedding host of examples/embed_host, found with find_package and with pkg-config
cmake -S examples/embed_host -B "$prefix/build-host" -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$prefix/build-host" >/dev/null
out=$(cd / && "$prefix/build-host/embed_host" 2 "$OLDPWD/examples/configs/inkling2_small.json" "$OLDPWD/policies/inkling2" | sort)
echo "$out" | grep -q "^rank 1: 27 units (27 planned, 0 ep-local), 8164000 parameters gathered, .*, prefetch 1/1$" ||
  { echo "embed_host printed: $out"; exit 1; }
# with ep = 2 each rank also holds an ep-local unit per MoE layer, which the plan does not
# count: the host gathers them too (its half of the experts)
out=$(cd / && "$prefix/build-host/embed_host" 2 "$OLDPWD/examples/configs/inkling2_small.json" "$OLDPWD/policies/inkling2" \
  dp_shard=2,ep=2 | sort)
[ "$(echo "$out" | grep -c "^rank [01]: 31 units (27 planned, 4 ep-local), 5018272 parameters gathered, ")" = 2 ] ||
  { echo "embed_host (ep=2) printed: $out"; exit 1; }
# shellcheck disable=SC2046
cc -std=c11 -Wall -Werror examples/embed_host/host.c $(pkg-config --cflags --libs moonshard-embed) -pthread \
   -Wl,-rpath,"$libdir" -o "$prefix/host2"
"$prefix/host2" 1 examples/configs/inkling2_small.json policies/inkling2 | grep -q "27 units (27 planned" ||
  { echo "the pkg-config embed host failed"; exit 1; }
echo "install test: exported symbols as the headers declare them, installed executable, installed policies and configs, stock lua5.4 require, pkg-config host, find_package embed host: ok"
