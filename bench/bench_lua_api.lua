-- bench_lua_api.lua [TRIALS]: what the Lua API's checks cost per call.  The API (argument
-- checks, defaults, messages) is written once in Lua over each interpreter's raw binding
-- (moonshard.raw); this measures an API call against the raw call it makes, interleaved in
-- the same run (docs/performance.md), for a getter (t:numel), a view (t:narrow) and a
-- collective on one rank (g:all_reduce of 16 floats).  Prints ns per call, min / median / max
-- over the trials, and the median ratio API / raw.
--
--   build/moonshard bench/bench_lua_api.lua 7
--   build/moonshard-jit bench/bench_lua_api.lua 7
local ms = require "moonshard"
local R = require "moonshard.raw"

local trials = tonumber(arg and arg[1] or 7)
if not trials or trials < 1 or trials > 1000 or trials ~= math.floor(trials) then
  io.stderr:write("bench_lua_api.lua: TRIALS wants an integer 1..1000, got '", tostring(arg[1]), "'\n")
  os.exit(2)
end

local t = ms.tensor({ 4, 4 })
local g = ms.mesh({ { "dp", 1 } }):group("dp")
local K = R.const

-- { name, calls per timing, API call, raw call }
local CASES = {
  { "numel", 1000000, function() return t:numel() end, function() return R.tensor_numel(t) end },
  { "narrow", 100000, function() return t:narrow(0, 1, 2) end, function() return R.tensor_narrow(t, 0, 1, 2) end },
  { "all_reduce", 100000, function() return g:all_reduce(t) end, function() return R.all_reduce(g, t, K.OP_SUM) end },
}

-- ns per call of f, over n calls
local function time(f, n)
  local c = os.clock()
  for _ = 1, n do f() end
  return (os.clock() - c) * 1e9 / n
end

local function stats(v)
  local s = {}
  for i, x in ipairs(v) do s[i] = x end
  table.sort(s)
  local m = #s % 2 == 1 and s[(#s + 1) / 2] or (s[#s / 2] + s[#s / 2 + 1]) / 2
  return s[1], m, s[#s]
end

print(string.format("bench_lua_api: %s, %d trials (ns per call: min / median / max)",
  type(jit) == "table" and jit.version or _VERSION, trials))
for _, case in ipairs(CASES) do
  local name, n, api, raw = case[1], case[2], case[3], case[4]
  time(api, n / 10) -- warm up (and let LuaJIT compile)
  time(raw, n / 10)
  local a, r, ratio = {}, {}, {}
  for i = 1, trials do
    a[i] = time(api, n)
    r[i] = time(raw, n)
    ratio[i] = a[i] / r[i]
    collectgarbage()
  end
  local amin, amed, amax = stats(a)
  local rmin, rmed, rmax = stats(r)
  local _, qmed = stats(ratio)
  print(string.format("  %-10s API %7.0f / %7.0f / %7.0f   raw %7.0f / %7.0f / %7.0f   API / raw %.2f", name,
    amin, amed, amax, rmin, rmed, rmax, qmed))
end
