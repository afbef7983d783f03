-- collectives.lua: every collective x dtype x op on every rank of the world and of mesh
-- groups, each rank checking its own result against values computed here in Lua.
-- Run as: moonshard -n N collectives.lua   (prints "rank R: N checks ok" per rank)
local ms = require "moonshard"

local rank, world = ms.rank(), ms.world_size()
local checks, wrong = 0, {}

-- The value that rank q holds at flat index i: small integers, exact in every dtype.
local function f(q, i, dtype)
  if dtype == "bool" then return ((q + i) % 3 == 0) and 1 or 0 end
  if dtype == "u8" then return (q * 7 + i * 3) % 11 end
  return (q * 7 + i * 3) % 11 - 5
end

-- What the core must produce for an exact value v in dtype: floats reduce in f32 (f64
-- in f64) and round once.
local float = { f32 = true, f64 = true, f16 = true, bf16 = true, f8e4m3 = true, f8e5m2 = true }
local function rounded(v, dtype)
  if dtype == "bool" then return v ~= 0 and 1 or 0 end
  if dtype == "f64" or not float[dtype] then return v end
  return ms.from_table({ v }, "f64"):to("f32"):to(dtype):totable()[1]
end

local reducers = {
  sum = function(a, b) return a + b end,
  max = math.max,
  min = math.min,
}

local function expect_reduce(dtype, op, n, value_of)
  local acc = value_of(0)
  for q = 1, n - 1 do acc = (reducers[op] or reducers.sum)(acc, value_of(q)) end
  if op == "avg" then acc = ms.from_table({ acc }, "f64"):to("f32"):totable()[1] / n end
  return rounded(acc, dtype)
end

local function compare(what, got, want)
  checks = checks + 1
  local bad, maxdiff = 0, 0
  for i = 1, #want do
    local d = math.abs((got[i] or math.huge) - want[i])
    if d > 0 or got[i] == nil then bad, maxdiff = bad + 1, math.max(maxdiff, d) end
  end
  if #got ~= #want then bad = bad + 1 end
  if bad > 0 then
    wrong[#wrong + 1] = string.format("%s: %d wrong of %d (max diff %g)", what, bad, #want, maxdiff)
  end
end

local function input(g, n, dtype)
  local vals = {}
  for i = 0, n - 1 do vals[#vals + 1] = f(g:rank(), i, dtype) end
  return ms.from_table(vals, dtype)
end

local function ops_for(dtype)
  if float[dtype] then return { "sum", "avg", "max", "min" } end
  if dtype == "bool" then return { "max", "min" } end
  return { "sum", "max", "min" }
end

local function run_group(label, g)
  local n, r = g:size(), g:rank()
  for _, cnt in ipairs({ 5, 0 }) do
    for _, dtype in ipairs(ms.dtypes) do
      local tag = string.format("%s cnt=%d %s", label, cnt, dtype)
      -- all_gather, out of place and in place
      local want = {}
      for q = 0, n - 1 do for i = 0, cnt - 1 do want[#want + 1] = f(q, i, dtype) end end
      local out = ms.tensor({ n * cnt }, dtype)
      g:all_gather(out, input(g, cnt, dtype))
      compare(tag .. " all_gather", out:totable(), want)
      local inplace = ms.tensor({ n * cnt }, dtype)
      inplace:narrow(0, r * cnt, cnt):copy_(input(g, cnt, dtype))
      g:all_gather(inplace, inplace:narrow(0, r * cnt, cnt))
      compare(tag .. " all_gather in place", inplace:totable(), want)
      -- broadcast from the last group rank
      local b = input(g, cnt, dtype)
      g:broadcast(b, n - 1)
      want = {}
      for i = 0, cnt - 1 do want[#want + 1] = f(n - 1, i, dtype) end
      compare(tag .. " broadcast", b:totable(), want)
      -- all_to_all: out chunk j = chunk r of rank j's input
      local a2a = ms.tensor({ n * cnt }, dtype)
      g:all_to_all(a2a, input(g, n * cnt, dtype))
      want = {}
      for j = 0, n - 1 do for i = 0, cnt - 1 do want[#want + 1] = f(j, r * cnt + i, dtype) end end
      compare(tag .. " all_to_all", a2a:totable(), want)
      for _, op in ipairs(ops_for(dtype)) do
        local otag = tag .. " " .. op
        -- reduce_scatter: out[i] = op over q of rank q's element r*cnt+i
        local rs = ms.tensor({ cnt }, dtype)
        g:reduce_scatter(rs, input(g, n * cnt, dtype), op)
        want = {}
        for i = 0, cnt - 1 do
          want[#want + 1] = expect_reduce(dtype, op, n, function(q) return f(q, r * cnt + i, dtype) end)
        end
        compare(otag .. " reduce_scatter", rs:totable(), want)
        local rsi = input(g, n * cnt, dtype)
        g:reduce_scatter(rsi:narrow(0, r * cnt, cnt), rsi, op)
        compare(otag .. " reduce_scatter in place", rsi:narrow(0, r * cnt, cnt):totable(), want)
        -- all_reduce
        local ar = input(g, cnt, dtype)
        g:all_reduce(ar, op)
        want = {}
        for i = 0, cnt - 1 do
          want[#want + 1] = expect_reduce(dtype, op, n, function(q) return f(q, i, dtype) end)
        end
        compare(otag .. " all_reduce", ar:totable(), want)
      end
    end
  end
  g:barrier()
end

local m = ms.mesh({ { "world", world } })
run_group("world", m:group("world"))
if world % 2 == 0 and world > 2 then
  local m2 = ms.mesh({ { "a", 2 }, { "b", math.floor(world / 2) } })
  run_group("a", m2:group("a"))
  run_group("b", m2:group("b"))
  run_group("ab", m2:group({ "a", "b" }))
end

if #wrong > 0 then
  error(string.format("rank %d: %d of %d checks failed:\n  %s", rank, #wrong, checks,
    table.concat(wrong, "\n  ")), 0)
end
print(string.format("rank %d: %d checks ok", rank, checks))
