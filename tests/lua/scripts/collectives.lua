-- collectives.lua: every collective x dtype x op on every rank of the world and of mesh
-- groups, each rank checking its own result against values computed here in Lua.
-- Run as: moonshard -n N collectives.lua   (prints "rank R: N checks ok" per rank)
--
-- Floating sums and averages: the threads and MPI backends accumulate in f32 (f64 in f64)
-- and round once, so their results must be exactly that.  NCCL reduces in the dtype itself,
-- rounding every partial sum, in an order its ring or tree sets, and averages by
-- multiplying every rank's value by 1/n rounded to the dtype (PreMulSum); with 2 ranks that
-- is still one rounding, so the same exact check applies.  With 3 ranks or more on NCCL a
-- result must instead lie within the error those roundings can make at most (error_bound
-- below), and the largest difference from the once-rounded value is printed.
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

-- Bits of mantissa and the least normal exponent of each floating dtype.
local formats = { f64 = { 52, -1022 }, f32 = { 23, -126 }, bf16 = { 7, -126 }, f16 = { 10, -14 },
  f8e4m3 = { 3, -6 }, f8e5m2 = { 2, -14 } }

-- The distance between neighbouring values of dtype at magnitude x (and above it up to the
-- next power of two).
local function spacing(x, dtype)
  local mbits, emin = formats[dtype][1], formats[dtype][2]
  local e = emin
  while 2.0 ^ (e + 1) <= x do e = e + 1 end
  return 2.0 ^ (e - mbits)
end

-- NCCL with n >= 3 ranks: how far its sum or average of the values vs may lie from the
-- exact result.  Every partial sum is at most A = sum |v| (avg: A * s, s = 1/n rounded to
-- the dtype) in magnitude, so each of its n - 1 roundings is off by at most half a spacing
-- there; avg adds the n products' roundings and the scalar's own error, A * |s - 1/n|.
local backend = ms.backend()
local function error_bound(dtype, op, vs)
  local n, a = #vs, 0
  for _, v in ipairs(vs) do a = a + math.abs(v) end
  if op == "sum" then return (n - 1) * spacing(a, dtype) / 2 end
  local s = rounded(1 / n, dtype)
  local top = 2 * a * math.max(s, 1 / n) -- above any partial sum, with room for their roundings
  return a * math.abs(s - 1 / n) + (2 * n - 1) * spacing(top, dtype) / 2
end

-- The expected result: the value the threads and MPI backends give, and where NCCL may
-- differ from it (3 ranks or more, a floating sum or average) the exact value and the
-- bound on NCCL's error.
local function expect_reduce(dtype, op, n, value_of)
  local vs = {}
  for q = 0, n - 1 do vs[#vs + 1] = value_of(q) end
  local acc = vs[1]
  for q = 2, n do acc = (reducers[op] or reducers.sum)(acc, vs[q]) end
  local exact = op == "avg" and acc / n or acc
  if op == "avg" then acc = ms.from_table({ acc }, "f64"):to("f32"):totable()[1] / n end
  local want = { value = rounded(acc, dtype) }
  if backend == "nccl" and n >= 3 and float[dtype] and (op == "sum" or op == "avg") then
    want.exact, want.bound = exact, error_bound(dtype, op, vs)
  end
  return want
end

local nccl_rounding = 0 -- the largest difference accepted within a bound, from the once-rounded value

-- want[i]: a value, or what expect_reduce returns
local function compare(what, got, want)
  checks = checks + 1
  local bad, maxdiff = 0, 0
  for i = 1, #want do
    local w = type(want[i]) == "table" and want[i] or { value = want[i] }
    local d = math.abs((got[i] or math.huge) - w.value)
    if d > 0 and w.bound and math.abs(got[i] - w.exact) <= w.bound then
      nccl_rounding, d = math.max(nccl_rounding, d), 0
    end
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
if nccl_rounding > 0 then
  print(string.format("rank %d: %d checks ok (NCCL's rounding in the dtype: up to %g from the once-rounded values, "
    .. "within the bounds)", rank, checks, nccl_rounding))
else
  print(string.format("rank %d: %d checks ok", rank, checks))
end
