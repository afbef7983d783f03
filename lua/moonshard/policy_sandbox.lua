-- moonshard.policy_sandbox: the globals every file of a policy sees (see moonshard.policy):
-- safe builtins and copies of math, string and table, without io, os, package, debug, load
-- or collectgarbage.  Their functions that loop or allocate in C charge the budget
-- (moonshard.policy_budget) before they run, and pcall cannot catch the budget's end.

local S = {}

-- LuaJIT's compiled traces never call the hook: the sandbox's own functions (the loops of
-- table.concat's wrapper) stay interpreted, so their work is counted.
if rawget(_G, "jit") then rawget(_G, "jit").off(true, true) end

local budget = require "moonshard.policy_budget"
local reserve, charge, charge_pattern = budget.reserve, budget.charge, budget.charge_pattern
local len, sandbox_error, rethrow_budget = budget.len, budget.policy_error, budget.rethrow

local SANDBOX = "policies run in a sandbox without io, os, package, debug, load"
S.SANDBOX = SANDBOX

-- Captured now: the sandbox swaps the string metatable's __index during policy calls.
local format, rep = string.format, string.rep
local concat = table.concat
local unpack = table.unpack or unpack
-- LuaJIT has no rawlen, but its # on a table or string never calls a metamethod.
local rawlen = rawlen or function(v) return #v end
local jit = rawget(_G, "jit")

local function pack(...) return { n = select("#", ...), ... } end

local function copy(t)
  local c = {}
  for k, v in pairs(t) do c[k] = v end
  return c
end

local function sandbox_string(cfg)
  local s = copy(string)
  s.dump, s.pack = nil, nil
  local real = string
  -- Lua 5.4 copies n times, even an empty string
  function s.rep(str, n, sep)
    local count = tonumber(n) -- "1e17" is a count too
    if count and count > 0 then
      reserve(cfg, len(str) * count + len(sep) * (count - 1), "string.rep")
      charge(cfg, count, "string.rep of %.0f copies", count)
    end
    return rep(str, n, sep)
  end
  function s.find(str, p, init, plain)
    charge_pattern(cfg, "find", str, p, true, plain)
    return real.find(str, p, init, plain)
  end
  function s.match(str, p, ...)
    charge_pattern(cfg, "match", str, p, true)
    return real.match(str, p, ...)
  end
  function s.gmatch(str, p, ...)
    charge_pattern(cfg, "gmatch", str, p, false)
    return real.gmatch(str, p, ...)
  end
  function s.gsub(str, p, repl, max_n)
    charge_pattern(cfg, "gsub", str, p, true)
    local bytes = budget.gsub_bytes(len(str), repl, max_n)
    if bytes then reserve(cfg, bytes, "string.gsub") end
    local t = type(repl)
    if t ~= "function" and t ~= "table" then return real.gsub(str, p, repl, max_n) end
    budget.enter_c()
    return budget.leave_c(real.gsub(str, p, repl, max_n))
  end
  function s.format(fmt, ...)
    reserve(cfg, budget.format_bytes(fmt, ...), "string.format")
    return format(fmt, ...)
  end
  local mt = { __metatable = false, __index = function(_, name)
    if name == "dump" then sandbox_error("string.dump is not available (%s)", SANDBOX) end
    if name == "pack" then
      sandbox_error("string.pack is not available (one call can build gigabytes the memory cap cannot see)")
    end
  end }
  -- Two tables of the same functions: the policy's global `string`, which it may change,
  -- and the methods of strings during its calls ("x":rep(n)), which it cannot reach:
  -- library code the policy calls (the planner's name:sub(...)) gets the sandbox's own.
  return setmetatable(s, mt), setmetatable(copy(s), mt)
end

-- table.concat, its result reserved first.  It reads t[i] as the interpreter's does (5.4
-- through __index, LuaJIT raw), once: the values go to a plain table for the real concat.
local raw_concat = jit ~= nil
local function sandbox_concat(cfg)
  return function(t, sep, i0, j0)
    if type(t) ~= "table" then return concat(t, sep, i0, j0) end
    local i = i0 == nil and 1 or tonumber(i0) -- "1e12" is a bound too
    local j = j0 == nil and (raw_concat and rawlen(t) or #t) or tonumber(j0)
    if type(i) ~= "number" or type(j) ~= "number" then return concat(t, sep, i0, j0) end -- it raises
    local values, bytes = {}, 0
    for k = i, j do
      local v = raw_concat and rawget(t, k) or t[k]
      local tv = type(v)
      if tv ~= "string" and tv ~= "number" then return concat(t, sep, i, j) end -- it raises
      values[k], bytes = v, bytes + len(v)
    end
    if j > i then bytes = bytes + len(sep) * (j - i) end
    reserve(cfg, bytes, "table.concat")
    return concat(values, sep, i, j)
  end
end

-- table.sort, insert, remove and move loop in C, where the hook never runs: each is charged
-- what it will do before it runs (a sort n log2 n comparisons, insert and remove the
-- elements they shift, move the elements it copies).  A table's length is its raw length
-- there: a __len (Lua 5.4) could make C loop over 2^40 elements of nothing, so a table with
-- one is refused (LuaJIT's table library ignores __len).
local sort, insert, remove, move = table.sort, table.insert, table.remove, table.move
local function table_length(cfg, what, t)
  if type(t) ~= "table" then return 0 end
  if not jit then
    local mt = debug.getmetatable(t)
    if type(mt) == "table" and rawget(mt, "__len") ~= nil then
      sandbox_error("%s: a table whose metatable has __len is refused here (its length would let C loop " ..
                    "without a bound the budget sees)", what)
    end
  end
  return rawlen(t)
end
local function sandbox_table_fns(cfg, tbl)
  function tbl.sort(t, comp)
    local n = table_length(cfg, "table.sort", t)
    if n > 1 then
      local steps = n * math.log(n) / math.log(2)
      charge(cfg, steps, "table.sort of %d elements: about %.3g comparisons", n, steps)
    end
    return sort(t, comp)
  end
  function tbl.insert(t, ...)
    local n = table_length(cfg, "table.insert", t)
    if select("#", ...) >= 2 then charge(cfg, n, "table.insert shifting up to %d elements", n) end
    return insert(t, ...)
  end
  function tbl.remove(t, ...)
    local n = table_length(cfg, "table.remove", t)
    charge(cfg, n, "table.remove shifting up to %d elements", n)
    return remove(t, ...)
  end
  if move then
    function tbl.move(a1, f, e, t, a2)
      local first, last = tonumber(f), tonumber(e)
      if first and last and last >= first then
        charge(cfg, last - first + 1, "table.move of %.0f elements", last - first + 1)
      end
      return move(a1, f, e, t, a2)
    end
  end
end

-- The globals every file of one load sees.  The libraries are copies, so a policy that
-- replaces string.format changes only its own view.
local function sandbox_env(cfg, require)
  local tbl = copy(table)
  tbl.unpack = unpack
  tbl.concat = sandbox_concat(cfg)
  tbl.pack = tbl.pack or pack
  sandbox_table_fns(cfg, tbl)
  local env = {
    assert = assert, error = error, ipairs = ipairs, next = next, pairs = pairs,
    select = select, tonumber = tonumber, tostring = tostring, type = type, unpack = unpack,
    rawequal = rawequal, rawget = rawget, rawlen = rawlen, rawset = rawset,
    math = copy(math), string = cfg.string, table = tbl, require = require,
  }
  function env.pcall(f, ...) return rethrow_budget(budget.c_depth(), pcall(f, ...)) end
  function env.xpcall(f, handler, ...)
    if type(handler) ~= "function" then return xpcall(f, handler, ...) end
    return rethrow_budget(budget.c_depth(), xpcall(f, function(e)
      if budget.tripped() then return e end
      return handler(e)
    end, ...))
  end
  -- Only tables show a metatable: the string one would give back the host's string
  -- library, a userdata one the host's methods.
  function env.getmetatable(v)
    if type(v) == "table" then return getmetatable(v) end
  end
  function env.setmetatable(t, mt)
    if type(mt) == "table" and rawget(mt, "__gc") ~= nil then
      sandbox_error("setmetatable: __gc is not allowed (a finalizer would run outside the policy's budget)")
    end
    return setmetatable(t, mt)
  end
  return setmetatable(env, {
    __metatable = false,
    __index = function(_, name)
      sandbox_error("unknown global '%s' (%s)", tostring(name), SANDBOX)
    end,
    __newindex = function(_, name)
      sandbox_error("cannot set global '%s' (keep state in locals; a policy file returns its values)",
                    tostring(name))
    end,
  })
end

S.string, S.env = sandbox_string, sandbox_env

return S
