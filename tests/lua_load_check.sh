#!/usr/bin/env bash
# lua_load_check.sh LUA54 LUAJIT: every shipped Lua file compiles under both interpreters,
# so the library, the policies, the examples, the tools and the specs stay in the subset
# Lua 5.4 and LuaJIT both accept (no //, no bitwise operators, no <const>/<close>, no
# integer-only literals).  Prints each file that does not, with the interpreter's message.
set -euo pipefail
cd "$(dirname "$0")/.."
lua54=$1 luajit=$2

# Left out on purpose: a policy fixture that is a syntax error for policy_spec to report.
mapfile -t shared < <(find lua/moonshard policies examples tools tests/lua tests/mpi tests/fuzz tests/reference -name '*.lua' \
  ! -path tests/lua/policies/broken/syntax.lua | sort)
# LuaJIT's own tests may use its extensions (64-bit integer literals, ...).
mapfile -t jit_only < <(find tests/luajit -name '*.lua' | sort)

# loads each file named in arg; prints what failed, prefixed by the interpreter
check='local bad = 0
for _, f in ipairs(arg) do
  local ok, err = loadfile(f)
  if not ok then
    bad = bad + 1
    print(((jit and jit.version) or _VERSION) .. ": " .. err)
  end
end
os.exit(bad == 0 and 0 or 1)'

status=0
"$lua54" - "${shared[@]}" <<<"$check" || status=1
"$luajit" - "${shared[@]}" "${jit_only[@]}" <<<"$check" || status=1
[ $status = 0 ] && echo "lua_load_check: ${#shared[@]} files load under $("$lua54" -v 2>&1 | cut -d' ' -f1-2) and LuaJIT; ${#jit_only[@]} LuaJIT-only"
exit $status
