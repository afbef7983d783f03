-- same_bits.lua: reductions of inexact values, printed as bit-pattern hashes, so that two
-- backends can be compared bit for bit: the output of
--   moonshard -n 4 tests/mpi/same_bits.lua   and   mpirun -np 4 moonshard tests/mpi/same_bits.lua
-- must be the same lines (in any order).  With an argument PREFIX each rank writes its
-- lines to the file PREFIX.RANK instead (a launcher's output forwarding may cut long
-- output of several processes into interleaved pieces).  Sizes cover the MPI backend's small all_reduce
-- (gather everything), its chunked path (3001 elements: chunks of unequal length) and
-- counts that do not divide evenly.  Each line: "rank R GROUP COUNT DTYPE OP KIND HASH".
local ms = require "moonshard"

local rank, world = ms.rank(), ms.world_size()

-- A polynomial hash of the bit patterns modulo 2^32 (no bit operators, so that LuaJIT runs
-- it too; every step stays below 2^53): equal only when every bit is, but for collisions.
local function hash(t)
  local h = 0
  for _, b in ipairs(t:bits()) do h = (h * 65599 + b) % 4294967296 end
  return string.format("%08x", h)
end

-- Rank q's value at flat index i: inexact in every float dtype, of mixed signs and
-- magnitudes, so the order and width of the accumulation show in the low bits.
local function value(q, i) return math.sin(q * 12.9898 + i * 78.233) * (1 + (i % 7) * 3.5) end

local function input(q, n, dtype)
  local v = {}
  for i = 0, n - 1 do v[i + 1] = value(q, i) end
  return ms.from_table(v, "f64"):to(dtype)
end

local lines = {}
local function out(label, count, dtype, op, kind, t)
  lines[#lines + 1] = string.format("rank %d %s %d %s %s %s %s", rank, label, count, dtype, op, kind, hash(t))
end

local function run_group(label, g)
  local n = g:size()
  for _, count in ipairs({ 7, 3001 }) do
    for _, dtype in ipairs({ "f32", "bf16", "f16", "f8e4m3", "f8e5m2", "f64" }) do
      for _, op in ipairs({ "sum", "avg", "max" }) do
        local t = input(g:rank(), count, dtype)
        g:all_reduce(t, op)
        out(label, count, dtype, op, "all_reduce", t)
        local rs = ms.tensor({ count }, dtype)
        g:reduce_scatter(rs, input(g:rank() + 1, n * count, dtype), op)
        out(label, count, dtype, op, "reduce_scatter", rs)
      end
    end
  end
end

run_group("world", ms.mesh({ { "world", world } }):group("world"))
if world == 4 then
  local m = ms.mesh({ { "a", 2 }, { "b", 2 } })
  run_group("a", m:group("a"))
  run_group("b", m:group("b"))
end
if arg[1] then
  local f = assert(io.open(arg[1] .. "." .. rank, "w"))
  f:write(table.concat(lines, "\n"), "\n")
  f:close()
else
  print(table.concat(lines, "\n"))
end
