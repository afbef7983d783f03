-- moonshard.plan: applies a policy to a module tree on a mesh and says what every rank
-- will hold and send.
--
-- The policy's parallelize(ctx) calls ctx:fully_shard(...) in the order PyTorch's
-- fully_shard would be called (children before parents), ctx:expert_parallel(...) for
-- what expert parallelism owns and ctx:checkpoint_wrap(...) for activation checkpointing.
-- The planner records those calls (FSDP2's rules, and Automodel's in the shipped policies), validates them, and computes per
-- unit: the parameters it owns with their shard layouts, its effective precision, and its
-- collectives; per rank: memory by category; per step: communication.  Parameters are
-- identified by object, so names stay right after checkpoint wrapping renames them.

local ms_module = require "moonshard.module"
local util = require "moonshard.util"

local M = {}

-- LuaJIT has no rawlen, but its # on a table never calls a metamethod.
local rawlen = rawlen or function(v) return #v end

local DTYPE_SIZE = { f32 = 4, f16 = 2, bf16 = 2, f8e4m3 = 1, f8e5m2 = 1, f64 = 8, i64 = 8, i32 = 4,
  i8 = 1, u8 = 1, bool = 1 }
local FLOAT = ms_module.FLOATING
M.DTYPE_SIZE = DTYPE_SIZE

-- Thresholds for warnings: a unit whose all-gather moves less than this per rank is
-- latency bound; padding above this fraction of a unit's gathered bytes is waste.
M.LATENCY_BOUND_BYTES = 1024 * 1024
M.PADDING_WASTE = 0.05
-- memory.per_rank (a table per rank) is built, when read, up to this many ranks.
M.PER_RANK_LIMIT = 1048576

-- The policy being planned (its path), while M.plan runs: a check after its call returned
-- names it, as one during the call names its line.
local planning

-- A plan error; raised while a policy call runs, it names the policy line that called
-- (unless the message names its call sites itself: `sited`).
local function fail(msg, sited)
  local at = not sited and require("moonshard.policy").position()
  if not at and not sited then at = planning end
  error("moonshard: plan: " .. msg .. (at and " (policy " .. at .. ")" or ""), 0)
end

-- Counts and bytes are exact integers up to 2^53 under both interpreters (LuaJIT's numbers
-- are doubles; Lua 5.4's integers would wrap at 2^63): a plan whose figures grow past it
-- is refused, naming what grew.  mul and add check before the figure can be wrong.
local MAX = ms_module.MAX_COUNT
local function too_big(fmt, ...)
  fail(string.format(fmt, ...) .. " would be more than 2^53 = 9007199254740992, where the planner's counts " ..
    "stop being exact")
end
local function mul(a, b, fmt, ...)
  if a ~= 0 and b > MAX / a then too_big(fmt, ...) end
  return a * b
end
local function add(a, b, fmt, ...)
  local sum = a + b
  if sum > MAX then too_big(fmt, ...) end
  return sum
end

-- A size as written: exact for Lua 5.4's integers and for LuaJIT's integral doubles.
local function count_str(n)
  if n == math.floor(n) and math.abs(n) < 2 ^ 63 then return string.format("%d", n) end
  return tostring(n)
end
local function shape_str(shape)
  local parts = {}
  for i, v in ipairs(shape) do parts[i] = count_str(v) end
  return "[" .. table.concat(parts, ", ") .. "]"
end

-- How a unit or module is named in messages: the root has the empty name.
local function display(name) return name == "" and "<root>" or name end
M.display = display

-- A value of the policy's in a message, running none of its metamethods: a scalar as it
-- is, anything else by its type.
local function shown(v)
  local t = type(v)
  if t == "string" or t == "number" or t == "boolean" or t == "nil" then return tostring(v) end
  return "a " .. t
end

local function check_dtype(d, what)
  if d ~= nil and not DTYPE_SIZE[d] then
    fail(string.format("%s is '%s', not a dtype (f32 f16 bf16 f8e4m3 f8e5m2 f64 i64 i32 i8 u8 bool)", what, tostring(d)))
  end
end

-- ---------------------------------------------------------------- options (a policy's knobs)

-- A policy declares its options (knobs) in its entry table, one entry per dotted name:
--   M.options = {
--     reshard_after_forward = { default = nil, type = "nil|boolean|integer", doc = "..." },
--     ["prefetch.forward"] = { default = 1, min = 0, doc = "..." },
--   }
-- An entry has `doc` (one line, required), `default`, and optionally `type` (alternatives
-- of M.OPTION_TYPES joined by "|"; else the default's type), `values` (the strings a string
-- option takes) and `min`/`max` (bounds of a number).  The planner merges the defaults with
-- the caller's values (plan opts.options, typed; opts.set, "name=value" strings as
-- `moonshard plan --set` gives them, parsed by the declared type), refuses unknown names and
-- wrong types, and hands the policy a copy as ctx.options, dotted names as nested tables
-- (ctx.options.prefetch.forward).  The declaration is read raw (rawget, next) before the
-- policy's call: no metamethod of the policy's runs outside its call.

-- The types an option may take, in the order a --set string is tried against them.
M.OPTION_TYPES = { "nil", "boolean", "integer", "number", "list", "string" }
local OPTION_TYPE = {}
for _, t in ipairs(M.OPTION_TYPES) do OPTION_TYPE[t] = true end
local OPTION_KEYS = { default = true, doc = true, type = true, values = true, min = true, max = true }
M.MAX_OPTIONS, M.MAX_OPTION_LIST = 256, 4096
local MAX_DOC = 300
local OPTION_NAME = "^[%a_][%w_]*$"

-- A policy's string in a message or the report: control characters escaped, at most `max` bytes.
local function clean(s, max)
  if #s > max then s = s:sub(1, max) .. "..." end
  return (s:gsub("[%z\1-\31\127]", function(c) return string.format("\\x%02X", c:byte()) end))
end

local function is_option_name(name)
  if type(name) ~= "string" or #name > 64 then return false end
  for part in (name .. "."):gmatch("([^.]*)%.") do
    if not part:find(OPTION_NAME) then return false end
  end
  return true
end

--- An option's value as --set takes it: none, true, 2, 0.5, 0,3,5 (a list), every:2.
function M.option_text(v)
  local t = type(v)
  if v == nil then return "none" end
  if t == "number" then return count_str(v) end
  if t == "table" then
    local parts = {}
    for i, x in ipairs(v) do parts[i] = count_str(x) end
    return #parts == 0 and "[]" or table.concat(parts, ",")
  end
  return clean(tostring(v), 80)
end

-- What an option takes, in words.
local function expected_of(e)
  local parts = {}
  for _, t in ipairs(M.OPTION_TYPES) do
    if e.types[t] then
      if t == "nil" then parts[#parts + 1] = "none"
      elseif t == "boolean" then parts[#parts + 1] = "true, false"
      elseif t == "integer" or t == "number" then
        local bound = (e.min and e.max) and string.format(" in %s..%s", count_str(e.min), count_str(e.max)) or
          e.min and " >= " .. count_str(e.min) or e.max and " <= " .. count_str(e.max) or ""
        parts[#parts + 1] = (t == "integer" and "an integer" or "a number") .. bound
      elseif t == "list" then parts[#parts + 1] = "a list of integers (0,3,5)"
      elseif e.values then
        local q = {}
        for i, s in ipairs(e.values) do q[i] = "'" .. s .. "'" end
        parts[#parts + 1] = table.concat(q, ", ")
      else parts[#parts + 1] = "a string" end
    end
  end
  if #parts == 1 then return parts[1] end
  return table.concat(parts, ", ", 1, #parts - 1) .. " or " .. parts[#parts]
end

-- A value in a message, as given: strings quoted, running no metamethod.
local function given(v)
  if type(v) == "string" then return "'" .. clean(v, 60) .. "'" end
  if type(v) == "table" then return "a table" end
  return shown(v)
end

-- The value checked against the option and copied (a list into a new table); `what` says
-- where it came from in the error.  The string "none" is nil for an option that takes nil
-- and no string (Lua tables cannot hold a nil).
local function option_value(e, v, what)
  local t = type(v)
  local function wrong(why)
    fail(string.format("option %s%s is %s; expected %s%s", e.name, what, given(v), expected_of(e), why or ""))
  end
  if v == nil then
    if not e.types["nil"] then wrong() end
    return nil
  elseif t == "string" and v == "none" and e.types["nil"] and not e.types.string then
    return nil
  elseif t == "boolean" then
    if not e.types.boolean then wrong() end
  elseif t == "number" then
    local int = util.is_int(v) and math.abs(v) < 2 ^ 53
    if not ((int and e.types.integer) or (e.types.number and v == v and math.abs(v) ~= math.huge)) then wrong() end
    if (e.min and v < e.min) or (e.max and v > e.max) then wrong() end
  elseif t == "string" then
    if not e.types.string then wrong() end
    if e.values then
      local ok = false
      for _, s in ipairs(e.values) do ok = ok or s == v end
      if not ok then wrong() end
    end
  elseif t == "table" then
    if not e.types.list then wrong() end
    local n, copy = rawlen(v), {}
    if n > M.MAX_OPTION_LIST then wrong(string.format(" (at most %d elements)", M.MAX_OPTION_LIST)) end
    for k in next, v do
      if not (util.is_int(k) and k >= 1 and k <= n) then wrong(" (a list: keys 1..n only)") end
    end
    for i = 1, n do
      local x = rawget(v, i)
      if not (util.is_int(x) and math.abs(x) < 2 ^ 53) then wrong(string.format(" (element %d is %s)", i, given(x))) end
      copy[i] = x
    end
    return copy
  else
    wrong()
  end
  return v
end

-- A --set string as the option's type reads it: tried against each type it takes, in
-- M.OPTION_TYPES's order.
local function parse_option(e, s)
  for _, t in ipairs(M.OPTION_TYPES) do
    if e.types[t] then
      if t == "nil" and (s == "none" or s == "nil") then return nil
      elseif t == "boolean" and (s == "true" or s == "false") then return s == "true"
      elseif t == "integer" and s:find("^[+-]?%d+$") and #s < 17 then return option_value(e, math.floor(tonumber(s)), "")
      elseif t == "number" and tonumber(s) and s:find("^[%d+%-.eE]+$") then return option_value(e, tonumber(s), "")
      elseif t == "list" and (s:find("^%[?%s*[+-]?%d+%s*[,%d%s+-]*%]?$") or s == "[]") then
        local list = {}
        local body = s:gsub("^%[", ""):gsub("%]$", "")
        local ok = true
        for item in (body .. ","):gmatch("%s*([^,]*),") do
          if item:find("^[+-]?%d+%s*$") and #item < 17 then list[#list + 1] = math.floor(tonumber((item:gsub("%s", ""))))
          elseif item ~= "" or body:find("%S") then ok = false end
        end
        if ok then return option_value(e, list, "") end
      elseif t == "string" then
        return option_value(e, s, "")
      end
    end
  end
  fail(string.format("option %s is '%s'; expected %s", e.name, clean(s, 60), expected_of(e)))
end

--- The options a policy declares (its entry table's `options`), read raw and checked: a
-- list of {name, doc, default, types, type (as declared), values, min, max}, by name.
function M.declared_options(policy)
  local decl = type(policy) == "table" and rawget(policy, "options") or nil
  if decl == nil then return {} end
  if type(decl) ~= "table" then
    fail("the policy's options are " .. shown(decl) .. "; expected a table {name = {default = ..., doc = \"...\"}}")
  end
  local list, by_name = {}, {}
  for name, d in next, decl do
    if #list == M.MAX_OPTIONS then fail(string.format("the policy declares more than %d options", M.MAX_OPTIONS)) end
    if not is_option_name(name) then
      fail(string.format("the policy's options: %s is not an option name (letters, digits and _, parts joined " ..
        "by dots, at most 64 bytes)", given(name)))
    end
    local where = "the policy's option " .. name
    if type(d) ~= "table" then fail(where .. " is " .. given(d) .. "; expected a table {default = ..., doc = \"...\"}") end
    for k in next, d do
      if not OPTION_KEYS[k] then
        fail(string.format("%s has the key %s; expected default, doc, type, values, min and max", where, given(k)))
      end
    end
    local doc, ty, default = rawget(d, "doc"), rawget(d, "type"), rawget(d, "default")
    if type(doc) ~= "string" or not doc:find("%S") then fail(where .. " has no doc (one line saying what it does)") end
    local e = { name = name, doc = clean(doc, MAX_DOC), types = {} }
    if ty == nil then
      local t = type(default)
      if t == "nil" then fail(where .. ": its default is none; declare its type (type = \"nil|boolean\", ...)") end
      e.type = t == "number" and (util.is_int(default) and "integer" or "number") or t == "table" and "list" or t
    elseif type(ty) == "string" and #ty <= 64 then
      e.type = ty
    else
      fail(where .. ": type is " .. given(ty) .. "; expected types joined by | (" .. table.concat(M.OPTION_TYPES, " ") .. ")")
    end
    for t in (e.type .. "|"):gmatch("([^|]*)|") do
      if not OPTION_TYPE[t] then
        fail(string.format("%s: type %s: '%s' is not a type (%s)", where, given(e.type), clean(t, 20),
          table.concat(M.OPTION_TYPES, " ")))
      end
      e.types[t] = true
    end
    local values = rawget(d, "values")
    if values ~= nil then
      if not e.types.string or type(values) ~= "table" or rawlen(values) == 0 or rawlen(values) > 64 then
        fail(where .. ": values is the list of the strings it takes (1 to 64), for an option of type string")
      end
      e.values = {}
      for i = 1, rawlen(values) do
        local s = rawget(values, i)
        if type(s) ~= "string" or #s > 64 then fail(string.format("%s: values[%d] is %s; expected a string", where, i, given(s))) end
        e.values[i] = s
      end
    end
    for _, k in ipairs({ "min", "max" }) do
      local b = rawget(d, k)
      if b ~= nil and (type(b) ~= "number" or b ~= b) then fail(string.format("%s: %s is %s; expected a number", where, k, given(b))) end
      e[k] = b
    end
    e.default = option_value(e, default, " (its default)")
    list[#list + 1], by_name[name] = e, e
  end
  table.sort(list, function(a, b) return a.name < b.name end)
  for _, e in ipairs(list) do
    local prefix = e.name
    for i in prefix:gmatch("()%.") do
      if by_name[prefix:sub(1, i - 1)] then
        fail(string.format("the policy's options %s and %s clash: a dotted name is a field of the other's table",
          prefix:sub(1, i - 1), prefix))
      end
    end
  end
  return list
end

--- The options as text: per option its name, default and what it takes, then its doc.
function M.options_text(decl)
  if #decl == 0 then return "  (the policy declares no options)\n" end
  local out = {}
  for _, e in ipairs(decl) do
    out[#out + 1] = string.format("  %s = %s  (%s)\n      %s", e.name, M.option_text(e.default), expected_of(e), e.doc)
  end
  return table.concat(out, "\n") .. "\n"
end

--- resolve_options(decl, values, sets) -> list of {name, value, set}, by name; nested
-- table for ctx.options.  values: name -> value (typed; a nested table for dotted names
-- works too); sets: a list of "name=value" strings (--set), applied after values.
function M.resolve_options(decl, values, sets)
  local by_name = {}
  for _, e in ipairs(decl) do by_name[e.name] = e end
  local value, set = {}, {}
  for _, e in ipairs(decl) do value[e.name] = e.default end
  local function entry(name)
    local e = by_name[name]
    if e then return e end
    local head = decl[1] and "the policy's options are:\n" .. M.options_text(decl) or "the policy declares no options"
    error(string.format("moonshard: plan: unknown option %s%s; %s", given(name),
      planning and " (policy " .. planning .. ")" or "", head:gsub("\n$", "")), 0)
  end
  local function put(name, v)
    local e = by_name[name]
    if not e and type(v) == "table" and type(name) == "string" then
      local nested = false
      for _, d in ipairs(decl) do nested = nested or d.name:sub(1, #name + 1) == name .. "." end
      if nested then
        for k, x in pairs(v) do put(name .. "." .. tostring(k), x) end
        return
      end
    end
    e = entry(name)
    value[e.name], set[e.name] = option_value(e, v, ""), true
  end
  if values ~= nil then
    if type(values) ~= "table" then fail("options is " .. given(values) .. "; expected a table {name = value}") end
    local names = {}
    for k in pairs(values) do names[#names + 1] = k end
    table.sort(names, function(a, b) return tostring(a) < tostring(b) end)
    for _, k in ipairs(names) do put(k, values[k]) end
  end
  for _, s in ipairs(sets or {}) do
    local name, v = tostring(s):match("^([^=]+)=(.*)$")
    if not name then fail(string.format("option setting '%s' is not name=value", clean(tostring(s), 60))) end
    local e = entry(name)
    value[e.name], set[e.name] = parse_option(e, v), true
  end
  local list, nested = {}, {}
  for _, e in ipairs(decl) do
    list[#list + 1] = { name = e.name, value = value[e.name], set = set[e.name] or false }
    local t, parts = nested, {}
    for part in e.name:gmatch("[^.]+") do parts[#parts + 1] = part end
    for i = 1, #parts - 1 do
      t[parts[i]] = t[parts[i]] or {}
      t = t[parts[i]]
    end
    t[parts[#parts]] = value[e.name]
  end
  return list, nested
end

-- ---------------------------------------------------------------- the context policies see

local Ctx = {}
Ctx.__index = Ctx

--- A planning context over `model` (a module tree) and `mesh` (a MeshContext).
function M.context(model, mesh, opts)
  opts = opts or {}
  return setmetatable({
    model = model,
    mesh = mesh,
    config = opts.config,
    units = {},        -- in fully_shard order
    owner = {},        -- param -> unit
    ep = {},           -- param -> {placements, local_shape}
    ep_order = {},     -- params in the order expert_parallel saw them
    tp = {},           -- param -> {dim (nil: replicated), style, module, local_shapes per tp coordinate} (plan_tp)
    tp_order = {},     -- params in the order tensor_parallel placed them
    tp_plan = {},      -- {pattern, style, spec, modules} of every tensor_parallel call
    tp_uneven = {},    -- {fqn, dim, size} of the tensor-parallel splits that leave tp ranks unequal
    tp_modules = {},   -- {module, style, spec, object} of every module a tensor_parallel plan matched, in order
    pp = nil,          -- the pipeline ctx:pipeline made (plan_pp): stages, stage_of module, schedule
    stage_units = {},  -- stage -> {module -> unit} for the units of modules that span stages
    tp_variant = nil,  -- while laying out another tp coordinate's pieces: that coordinate
    warnings = {},
    -- FSDP2's implicit prefetch (no explicit chain set): the next unit's all-gather is
    -- issued while one computes, and backward prefetches one unit ahead
    prefetch = { forward = 1, backward = 1 },
    names = nil,       -- module -> name cache, rebuilt after checkpoint wrapping
    unit_of = {},      -- module -> its unit
    checkpointed = {}, -- the wrappers checkpoint_wrap made, in order
    warnings_out = type(opts.warnings) == "table" and opts.warnings or nil,
    log_sink = type(opts.log) == "function" and opts.log or nil,
    policy_name = type(opts.policy_name) == "string" and clean(opts.policy_name, 200) or nil,
    options = {},      -- the options, nested (ctx.options is a copy)
  }, Ctx)
end

-- ctx:log's sink: the host's opts.log(line), else stderr; every line prefixed with the
-- policy's name.  A plan prints at most LOG_TOTAL_BYTES.
function Ctx:log(line)
  local used = self.log_bytes or 0
  if used >= M.LOG_TOTAL_BYTES then return end
  if used + #line > M.LOG_TOTAL_BYTES then line = line:sub(1, M.LOG_TOTAL_BYTES - used) .. "..." end
  self.log_bytes = used + #line
  local prefix = self.policy_name and "policy " .. self.policy_name .. ": " or "policy: "
  local sink = self.log_sink or function(s)
    if io and io.stderr then io.stderr:write(s, "\n") end
  end
  sink(prefix .. line)
  if self.log_bytes >= M.LOG_TOTAL_BYTES then
    sink(prefix .. string.format("(ctx:log: the %d bytes a plan may print are spent; later lines are dropped)",
      M.LOG_TOTAL_BYTES))
  end
end

-- A warning is kept for the plan and, as it is added, in the host's opts.warnings (so a
-- plan that fails later still has it to show).
function Ctx:warn(msg)
  self.warnings[#self.warnings + 1] = msg
  if self.warnings_out then self.warnings_out[#self.warnings_out + 1] = msg end
end

local function rebuild_names(ctx)
  local names, order = {}, {}
  for i, nm in ipairs(ctx.model:named_modules()) do
    names[nm[2]] = nm[1]
    order[nm[2]] = i
  end
  ctx.names, ctx.preorder = names, order
end

--- The dotted name of a module of the tree ("" for the root).
function Ctx:name_of(module)
  if not self.names then rebuild_names(self) end
  local n = self.names[module]
  if not n then fail("a module passed to the planner is not part of the model tree") end
  return n
end

--- A module given as a module or a dotted name.
function Ctx:module(m)
  if type(m) == "string" then
    local found = self.model:get(m)
    if not found then fail("no module named '" .. m .. "' in the model") end
    return found
  end
  if getmetatable(m) ~= ms_module.Module then fail("expected a module or a module name, got " .. tostring(m)) end
  return m
end

--- {fqn, param} of every parameter under a module, with full names.
function Ctx:params_of(m)
  m = self:module(m)
  local out = {}
  for _, np in ipairs(m:named_parameters(self:name_of(m))) do out[#out + 1] = { np[1], np[2] } end
  return out
end

--- true when a unit or expert parallelism already owns the parameter.
function Ctx:is_owned(p) return self.owner[p] ~= nil or self.ep[p] ~= nil end

--- The dtype a parameter is gathered (computed) in under a mixed-precision policy.
function Ctx:compute_dtype(p, mp_policy)
  local gather = M.effective_dtypes(p.dtype, mp_policy or {})
  return gather
end

-- Which layers of a list of n checkpoint_wrap wraps: nil or true, all of them; false, none;
-- "every:K" or {every = K}, every K-th (positions K-1, 2K-1, ...: the K-th, 2K-th, ... layer,
-- as torchtitan counts its selective layer checkpointing); a list of positions {0, 3, 5} or
-- {only = {0, 3, 5}}, those (0-based, as ModuleList names its layers).  Returns a set of
-- positions, or nil for all.  A table of the policy's is read raw, and the loops over it
-- stop at the first key that does not belong.
local function wrap_positions(which, n, where)
  if which == nil or which == true then return nil end
  local set = {}
  if which == false then return set end
  local every, only
  if type(which) == "string" then
    local k = which:match("^every:%s*([+-]?%d+)$")
    if not k then
      fail(string.format("%s: '%s' is not a choice of layers (true, false, \"every:K\", {every = K}, a list " ..
        "of positions or {only = {...}})", where, clean(which, 40)))
    end
    every = tonumber(k)
  elseif type(which) == "table" then
    every, only = rawget(which, "every"), rawget(which, "only")
    local list = false
    if every == nil and only == nil then only, list = which, true end
    for k in next, which do
      if not list and k ~= "every" and k ~= "only" then
        fail(string.format("%s: unknown key %s (every = K or only = {positions})", where, given(k)))
      end
    end
    if every ~= nil and only ~= nil then fail(where .. ": every and only together; give one") end
  else
    fail(string.format("%s: the layers to wrap are %s; expected true, false, \"every:K\", {every = K}, a list of " ..
      "positions or {only = {...}}", where, given(which)))
  end
  if every ~= nil then
    if not util.is_int(every) or every < 1 or every > 2147483647 then
      fail(string.format("%s: every is %s; expected an integer K >= 1 (every K-th layer)", where, given(every)))
    end
    for i = every - 1, n - 1, every do set[i] = true end
    return set
  end
  if type(only) ~= "table" then fail(string.format("%s: only is %s; expected a list of positions", where, given(only))) end
  local count = rawlen(only)
  for k in next, only do
    if not (util.is_int(k) and k >= 1 and k <= count) then
      fail(string.format("%s: the positions are a list (keys 1..n), not a table with the key %s", where, given(k)))
    end
  end
  for i = 1, count do
    local p = rawget(only, i)
    if not util.is_int(p) or p < 0 or p >= n then
      fail(string.format("%s: position %s is out of range: the list has %d layers, positions 0..%d", where,
        given(p), n, n - 1))
    end
    if set[p] then fail(string.format("%s: position %s is given twice", where, count_str(p))) end
    set[p] = true
  end
  return set
end

--- Wraps children of a layer list (a ModuleList, given as module or name) in activation-
-- checkpoint wrappers: every child, or those `which` chooses (wrap_positions).  Children
-- already wrapped stay as they are.  Returns the names of the wrappers made.
function Ctx:checkpoint_wrap(list, which)
  list = self:module(list)
  -- wrapping renames the modules under the list: a unit made before would keep a name that
  -- no longer is its module's (Automodel wraps before it shards)
  local prefix = self:name_of(list)
  local positions = wrap_positions(which, #list.child_order, "checkpoint_wrap(" .. display(prefix) .. ")")
  for _, u in ipairs(self.units) do
    local n = self:name_of(u.module)
    if prefix == "" or n == prefix or n:sub(1, #prefix + 1) == prefix .. "." then
      fail(string.format("checkpoint_wrap(%s) after fully_shard(%s): wrap the layers before sharding them",
        display(prefix), display(n)))
    end
  end
  local made = {}
  for i, name in ipairs(list.child_order) do
    if (not positions or positions[i - 1]) and list.children[name].type ~= "CheckpointWrapper" then
      local wrapper = list:checkpoint_wrap(name)
      self.checkpointed[#self.checkpointed + 1] = wrapper
      made[#made + 1] = prefix == "" and name or prefix .. "." .. name
    end
  end
  self.names = nil
  return made
end

local function is_ancestor(ctx, a, b) -- module a is b or an ancestor of b
  local na, nb = ctx:name_of(a), ctx:name_of(b)
  return na == "" or na == nb or nb:sub(1, #na + 1) == na .. "."
end

--- Expert parallelism owns every parameter of `module`: Shard(0) over the ep axis.
-- Returns the list of those parameters (pass it as ignored_params to the block's unit).
function Ctx:expert_parallel(module, opts)
  opts = opts or {}
  local ep = self.mesh:size("ep")
  module = self:module(module)
  -- Automodel's expert parallelism shards a MoE block's GroupedExperts ([experts, ...]
  -- tensors) on dim 0; any other module split on dim 0 would never be gathered
  if type(module.type) ~= "string" or not module.type:find("^GroupedExperts") then
    fail(string.format("expert_parallel(%s): the module is a %s, not grouped experts (GroupedExperts: tensors of " ..
      "[experts, ...] that expert parallelism splits on dim 0)", display(self:name_of(module)), tostring(module.type)))
  end
  local owned = {}
  for _, np in ipairs(self:params_of(module)) do
    local fqn, p = np[1], np[2]
    if self.ep[p] then fail("parameter " .. fqn .. " is given to expert parallelism twice") end
    if self.tp[p] then
      fail(string.format("expert_parallel(%s): parameter %s is placed by tensor parallelism (%s through %s); a " ..
        "parameter takes one of them", display(self:name_of(module)), fqn, self.tp[p].style, display(self.tp[p].module)))
    end
    if #p.shape == 0 then fail("expert parameter " .. fqn .. " is a scalar; experts are split on dim 0") end
    if p.shape[1] % ep ~= 0 then
      fail(string.format("expert parameter %s has %d experts (dim 0), not divisible by ep = %d", fqn, p.shape[1], ep))
    end
    local local_shape = util.copy(p.shape)
    local_shape[1] = util.idiv(p.shape[1], ep)
    self.ep[p] = { placements = { "Shard(0)" }, local_shape = local_shape, by = opts.by or "ep", module = module }
    self.ep_order[#self.ep_order + 1] = p
    owned[#owned + 1] = p
  end
  return owned
end

local function as_param_set(ctx, list)
  local set = {}
  if list == nil then return set end
  local byname
  for k, v in pairs(list) do
    local item = (type(k) ~= "number") and k or v
    if type(item) == "string" then
      if not byname then
        byname = {}
        for _, np in ipairs(ctx.model:named_parameters()) do byname[np[1]] = np[2] end
      end
      if not byname[item] then fail("ignored_params names '" .. item .. "', which is not a parameter of the model") end
      set[byname[item]] = true
    elseif getmetatable(item) == ms_module.Param then
      set[item] = true
    elseif type(item) == "table" and getmetatable(item[2]) == ms_module.Param then -- {fqn, param}
      set[item[2]] = true
    end
  end
  return set
end

local check_shard_dim -- (below, with the layouts)
local check_mp, islands_of -- (below, with fully_shard)
local RESHARD_OK = { [true] = true, [false] = true }
local UNIT_KINDS = { fp32_island = true, module = true, root = true }

--- Makes `module` a shard unit, like torch's fully_shard(module, mesh=..., mp_policy=...,
-- reshard_after_forward=..., ignored_params=..., shard_placement_fn=...).
-- opts: mesh (list of axis names; default the FSDP mesh), mp_policy {param_dtype,
-- reduce_dtype, output_dtype, cast_forward_inputs}, reshard_after_forward (true, false,
-- an integer, or nil for the default), ignored_params (params or fqns), shard_placement_fn
-- (fqn, param) -> dim or nil, kind ("fp32_island", "module" or "root"; default "root" for
-- the model's root, else "module"), offload_policy ("cpu": the shards, gradient shards and
-- optimizer state live in host memory; "none" or nil: on the device), islands (a list of
-- modules strictly below `module`, or their dotted names: packed FP32 islands, see below)
-- and islands_mp_policy (their policy; default M.ISLAND_MP, the FP32 policy).
-- Where the policy called: "file:line" of the innermost frame outside the library, and of
-- up to two of its callers ("a.lua:80 (from a.lua:120)": a helper's line alone would be the
-- same for every call); nil when no policy frame is on the stack.
local LIB = (debug.getinfo(1, "S").source:match("^@(.*[/\\])[^/\\]+$"))
local function call_site()
  local frames, level = {}, 3
  while #frames < 3 do
    local info = debug.getinfo(level, "Sl")
    if not info or info.what == "C" then break end
    local src = info.source
    if LIB and src:sub(1, 1) == "@" and src:sub(2, #LIB + 1) == LIB then
      if #frames > 0 then break end
    elseif info.currentline and info.currentline > 0 then
      frames[#frames + 1] = (src:sub(1, 1) == "@" and src:sub(2) or info.short_src) .. ":" .. info.currentline
    end
    level = level + 1
  end
  if #frames == 0 then return nil end
  return frames[1] .. (#frames > 1 and " (from " .. table.concat(frames, ", from ", 2) .. ")" or "")
end

-- The keys fully_shard takes, and those of its mp_policy (FSDP2's MixedPrecisionPolicy).
local SHARD_OPTIONS = { "mesh", "mp_policy", "reshard_after_forward", "ignored_params", "shard_placement_fn",
  "offload_policy", "kind", "stage", "islands", "islands_mp_policy" }
local MP_OPTIONS = { "param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs" }

-- A misspelt key would silently fall back to its default: refused, with the keys there are.
local function check_keys(t, known, where, what, label)
  if type(t) ~= "table" then fail(string.format("%s: %s %s; expected a table", where, label, tostring(t))) end
  for k in pairs(t) do
    local ok = false
    for _, name in ipairs(known) do ok = ok or k == name end
    if not ok then
      fail(string.format("%s: unknown %s %s (%ss: %s)", where, what,
        type(k) == "string" and "'" .. k .. "'" or tostring(k), what, table.concat(known, ", ")))
    end
  end
end

-- {fqn, param} of the parameters fully_shard(module) manages, in FSDP2's order
-- (_get_managed_modules, _get_managed_states): the modules under `module` in post-order
-- (children before their parent), not descending into a module that is already a unit (its
-- ignored parameters included), each module's own parameters in order, shared ones once.
local function managed_params(ctx, module, stage)
  local out, seen = {}, {}
  local stage_of = ctx.pp and ctx.pp.stage_of
  local function visit(m, name)
    if m ~= module and ctx.unit_of[m] then return end
    -- under a pipeline, a unit holds its stage's part: other stages' modules are not there
    if stage_of and stage_of[m] ~= nil and stage_of[m] ~= stage then return end
    for _, c in ipairs(m.child_order) do visit(m.children[c], name == "" and c or name .. "." .. c) end
    for _, pname in ipairs(m.param_order) do
      local p = m.params[pname]
      if not seen[p] then
        seen[p] = true
        out[#out + 1] = { name == "" and pname or name .. "." .. pname, p }
      end
    end
  end
  visit(module, ctx:name_of(module))
  return out
end

-- FSDP2's MixedPrecisionPolicy of a unit (`what`: "mp_policy" or "islands_mp_policy"),
-- checked and copied: dtypes floating, cast_forward_inputs a boolean (default true).
function check_mp(mp, what, name)
  if type(mp) ~= "table" then
    fail(string.format("%s of unit %s is a %s; expected a table", what, display(name), type(mp)))
  end
  for _, k in ipairs({ "param_dtype", "reduce_dtype", "output_dtype" }) do
    check_dtype(mp[k], what .. "." .. k .. " of unit " .. (display(name)))
    if mp[k] ~= nil and not FLOAT[mp[k]] then
      fail(string.format("%s.%s of unit %s is '%s'; mixed precision takes a floating dtype " ..
        "(f32 f16 bf16 f8e4m3 f8e5m2 f64)", what, k, display(name), mp[k]))
    end
  end
  if mp.cast_forward_inputs ~= nil and type(mp.cast_forward_inputs) ~= "boolean" then
    fail(string.format("%s.cast_forward_inputs of unit %s is a %s; expected true or false", what, display(name),
      type(mp.cast_forward_inputs)))
  end
  return { param_dtype = mp.param_dtype, reduce_dtype = mp.reduce_dtype, output_dtype = mp.output_dtype,
    cast_forward_inputs = mp.cast_forward_inputs ~= false }
end

--- The policy of a packed unit's islands when the policy gives none: the FP32 islands' (gather,
-- reduce and output in f32, no input cast: the island owns its casts).
M.ISLAND_MP = { param_dtype = "f32", reduce_dtype = "f32", output_dtype = "f32", cast_forward_inputs = false }

-- Packed FP32 islands (fully_shard's islands option): the modules of opts.islands, each
-- strictly below the unit's module, no unit of its own, not inside another island of the
-- list, and holding parameters the unit takes (managed, not ignored, not owned, not placed by
-- expert parallelism).  Their parameters join the unit in FSDP2's managed order, each with
-- the islands' policy: unit.packed, unit.islands = {{name, module, mp, params}} in the order
-- given (params: the island's parameters the unit holds), unit.param_mp[p] (M.param_mp reads
-- it).  Returns param -> its island.
-- An island given as a module, or as a dotted name: the model's own name, or the name with
-- activation checkpointing's wrapper segments left out (fp32_modules.lua's names match the
-- same way), when exactly one module has it.
local CHECKPOINT_SEGMENT = "%._checkpoint_wrapped_module"
local function island_module(ctx, x, what)
  if type(x) ~= "string" then return ctx:module(x) end
  local found = ctx.model:get(x)
  if found then return found end
  local hits = {}
  for _, nm in ipairs(ctx.model:named_modules("")) do
    if nm[1]:gsub(CHECKPOINT_SEGMENT, "") == x then hits[#hits + 1] = nm[2] end
  end
  if #hits == 1 then return hits[1] end
  fail(string.format("%s: no module named '%s' in the model%s", what, x, #hits > 1 and
    string.format(" (%d modules have that name without activation checkpointing's wrappers)", #hits) or
    " (nor without activation checkpointing's _checkpoint_wrapped_module segments)"))
end

function islands_of(ctx, unit, opts, managed, ignored)
  local name, module = unit.name, unit.module
  local where = string.format("fully_shard(%s): islands", display(name))
  local list = opts.islands
  if type(list) ~= "table" then
    fail(string.format("%s is a %s; expected a list of modules (or their dotted names) below %s", where, type(list),
      display(name)))
  end
  local n = rawlen(list)
  for k in pairs(list) do
    if not util.is_int(k) or k < 1 or k > n then
      fail(string.format("%s has the key %s; expected a list (1, 2, ...) of modules below %s", where, shown(k),
        display(name)))
    end
  end
  if n == 0 then
    fail(string.format("%s is empty; give the modules below %s to pack into its unit, or leave islands out", where,
      display(name)))
  end
  local imp = check_mp(opts.islands_mp_policy == nil and M.ISLAND_MP or opts.islands_mp_policy, "islands_mp_policy",
    name)
  local takes = {}
  for _, np in ipairs(managed) do
    local p = np[2]
    if not ignored[p] and not ctx.owner[p] and not ctx.ep[p] then takes[p] = true end
  end
  local seen, island_of = {}, {}
  unit.packed, unit.islands, unit.param_mp = true, {}, {}
  for i = 1, n do
    local m = island_module(ctx, list[i], string.format("%s[%d]", where, i))
    local iname = ctx:name_of(m)
    local what = string.format("%s[%d] (%s)", where, i, display(iname))
    if m == module then
      fail(string.format("%s is the unit's module itself; an island is a module strictly below %s", what,
        display(name)))
    end
    if not is_ancestor(ctx, module, m) then
      fail(string.format("%s is not below %s; an island is a module strictly below the unit's module", what,
        display(name)))
    end
    if seen[m] then fail(string.format("%s is given twice (also islands[%d])", what, seen[m])) end
    local prev = ctx.unit_of[m]
    if prev then
      fail(string.format("%s is a unit already (fully_shard at %s); an island is packed instead of being a unit of " ..
        "its own", what, prev.site or "?"))
    end
    for j = 1, i - 1 do
      local other = unit.islands[j].module
      if is_ancestor(ctx, other, m) or is_ancestor(ctx, m, other) then
        fail(string.format("%s and islands[%d] (%s) are nested; give the outer one only", what, j,
          display(unit.islands[j].name)))
      end
    end
    seen[m] = i
    local entry, count = { name = iname, module = m, mp = imp, params = {} }, 0
    for _, np in ipairs(ctx:params_of(m)) do
      local p = np[2]
      if takes[p] and not island_of[p] then
        count = count + 1
        island_of[p] = entry
      end
    end
    if count == 0 then
      fail(string.format("%s holds no parameter the unit %s takes (its parameters are ignored, owned by another " ..
        "unit, placed by expert parallelism%s, or it has none); pack only modules with parameters of their own",
        what, display(name), ctx.pp and ", or in another pipeline stage" or ""))
    end
    unit.islands[i] = entry
  end
  return island_of
end

--- The mixed-precision policy of parameter p in `unit`: its island's in a packed unit, else
-- the unit's.  Every dtype the planner derives for a parameter goes through it.
function M.param_mp(unit, p)
  return unit.param_mp and unit.param_mp[p] or unit.mp
end

function Ctx:fully_shard(module, opts)
  opts = opts or {}
  module = self:module(module)
  local name = self:name_of(module)
  local where = "fully_shard(" .. display(name) .. ")"
  check_keys(opts, SHARD_OPTIONS, where, "option", "the options are")
  if opts.mp_policy ~= nil then check_keys(opts.mp_policy, MP_OPTIONS, where, "mp_policy key", "mp_policy is") end
  if opts.islands_mp_policy ~= nil then
    check_keys(opts.islands_mp_policy, MP_OPTIONS, where, "islands_mp_policy key", "islands_mp_policy is")
    if opts.islands == nil then
      fail(string.format("%s: islands_mp_policy is the policy of the islands packed into the unit, and no islands " ..
        "are given; give islands = {...}, or leave islands_mp_policy out", where))
    end
  end
  local site = call_site()
  local stage
  if self.pp then
    stage = self.pp.stage_of[module]
    if opts.stage ~= nil then
      if not util.is_int(opts.stage) or opts.stage < 0 or opts.stage >= self.pp.count then
        fail(string.format("fully_shard(%s): stage %s; the pipeline has stages 0 to %d", display(name), shown(opts.stage),
          self.pp.count - 1))
      end
      if stage ~= nil and stage ~= opts.stage then
        fail(string.format("fully_shard(%s): the module is in stage %d, not %d", display(name), stage, opts.stage))
      end
      stage = opts.stage
    end
    if stage == nil then
      fail(string.format("fully_shard(%s): the module spans the pipeline's stages; give {stage = i} to shard stage " ..
        "i's part of it (Automodel shards each stage's part of the model, its root included)", display(name)))
    end
  elseif opts.stage ~= nil then
    fail(string.format("fully_shard(%s): stage is for a model ctx:pipeline split into stages", display(name)))
  end
  local spanning = self.pp and self.pp.spanning[module]
  local prev_unit
  if spanning then
    self.stage_units[stage] = self.stage_units[stage] or {}
    prev_unit = self.stage_units[stage][module]
  else
    prev_unit = self.unit_of[module]
  end
  if prev_unit and prev_unit.kind == "replicate" then
    -- FSDP2's _get_managed_modules stops at a replicated module (_is_composable_with_fsdp)
    fail(string.format("fully_shard(%s): the module is a replicate unit (at %s); a module is one unit at most",
      display(name), prev_unit.site or "?"), true)
  end
  if prev_unit then
    -- FSDP2 refuses it too: the module is already an FSDPModule
    fail(string.format("fully_shard(%s) is applied twice to the same module: first at %s, then at %s; a module " ..
      "is one shard unit at most", display(name), prev_unit.site or "?", site or "?"), true)
  end
  local axes = opts.mesh or self.mesh.fsdp_axes
  if type(axes) == "string" then axes = { axes } end
  if #axes < 1 or #axes > 2 then
    fail(string.format("fully_shard(%s): FSDP takes a 1-D (shard) or 2-D (replicate, shard) mesh, got %d axes",
      display(name), #axes))
  end
  for _, a in ipairs(axes) do self.mesh:size(a) end
  if #axes == 2 and not self.mesh:outside(axes[1], axes[2]) then
    fail(string.format("fully_shard(%s): mesh {%s, %s}: a 2-D FSDP mesh is (replicate, shard), the replicate axis " ..
      "wholly outside the shard axis in the mesh's order (pp, dp_replicate, dp_shard, cp, tp; or ep_shard, ep)",
      display(name), axes[1], axes[2]))
  end
  local mp = check_mp(opts.mp_policy or {}, "mp_policy", name)
  local raf = opts.reshard_after_forward
  if raf ~= nil and not RESHARD_OK[raf] and not util.is_int(raf) then
    fail(string.format("reshard_after_forward of unit %s is %s; expected true, false or an integer",
      display(name), shown(raf)))
  end
  -- "cpu" is FSDP2's CPUOffloadPolicy; "none" (or nil) its default OffloadPolicy, which
  -- keeps everything on the device
  local offload = opts.offload_policy
  if offload ~= nil and offload ~= "cpu" and offload ~= "none" then
    fail(string.format("offload_policy of unit %s is %s; expected \"cpu\" (CPUOffloadPolicy), \"none\" or nil",
      display(name), type(offload) == "string" and "'" .. offload .. "'" or shown(offload)))
  end
  if opts.kind ~= nil and not UNIT_KINDS[opts.kind] then
    fail(string.format("fully_shard(%s): kind is %s; expected \"fp32_island\", \"module\" or \"root\"",
      display(name), type(opts.kind) == "string" and "'" .. opts.kind .. "'" or "a " .. type(opts.kind)))
  end
  local ignored = as_param_set(self, opts.ignored_params)
  local unit = {
    name = name, module = module, mesh_axes = axes,
    kind = opts.kind or (module == self.model and "root" or "module"),
    mp = mp,
    reshard_after_forward = raf, raf_explicit = raf ~= nil,
    offload = offload == "cpu" and "cpu" or nil,
    params = {}, ignored = {}, index = #self.units + 1, site = site, stage = stage,
  }
  -- FSDP2 calls shard_placement_fn as fully_shard builds the unit (FSDPParam's init): so does
  -- the planner, inside the policy's call, and keeps only the dims it returned.
  local placement_fn = opts.shard_placement_fn
  if placement_fn ~= nil and type(placement_fn) ~= "function" then
    fail(string.format("fully_shard(%s): shard_placement_fn is a %s; expected a function (fqn, param) -> dim",
      display(name), type(placement_fn)))
  end
  unit.dims = {}
  local managed = managed_params(self, module, stage)
  local island_of = opts.islands ~= nil and islands_of(self, unit, opts, managed, ignored) or nil
  for _, np in ipairs(managed) do
    local fqn, p = np[1], np[2]
    local prev = self.owner[p]
    if ignored[p] then
      unit.ignored[#unit.ignored + 1] = p
    elseif prev then
      if not is_ancestor(self, module, prev.module) then
        fail(string.format("parameter %s is already owned by unit %s, which is not nested in %s " ..
          "(shard a child before its parent)", fqn, display(prev.name), display(name)))
      end
    elseif self.ep[p] and axes[#axes] ~= "ep_shard" then
      fail(string.format("parameter %s is placed by expert parallelism but unit %s would shard it too: " ..
        "pass the expert parameters as ignored_params (as Automodel does) or shard them on ep_shard",
        fqn, display(name)))
    else
      unit.params[#unit.params + 1] = p
      self.owner[p] = unit
      if island_of and island_of[p] then
        local isl = island_of[p]
        unit.param_mp[p] = isl.mp
        isl.params[#isl.params + 1] = p
      end
      if placement_fn then
        local d = placement_fn(fqn, self.present and self.present(p) or p)
        if d ~= nil and not util.is_int(d) then
          fail(string.format("fully_shard(%s): shard_placement_fn returned %s for parameter %s; expected a dim " ..
            "(an integer) or nil", display(name), type(d) == "number" and tostring(d) or "a " .. type(d), fqn))
        end
        unit.dims[p] = d
        check_shard_dim(self, unit, fqn, p, d)
      end
    end
  end
  self.units[#self.units + 1] = unit
  if spanning then self.stage_units[stage][module] = unit else self.unit_of[module] = unit end
  return unit
end

-- ---------------------------------------------------------------- precision (FSDP2's rules)

--- Effective dtypes of a parameter in a unit: the dtype it is gathered (computed) in and
-- the dtype its gradient is reduced in (nil for a non-float parameter), as PyTorch 2.15's
-- FSDP2 resolves them (FSDPParam.init_dtype_attrs, unsharded_grad_dtype): param_dtype
-- unset when it is the stored dtype; a gradient reduced in reduce_dtype, else in the
-- stored dtype (2.15's grad_dtype rule; before 2.15, in param_dtype).
function M.effective_dtypes(stored, mp)
  local pd, rd = mp.param_dtype, mp.reduce_dtype
  if not FLOAT[stored] then return stored, nil end -- no casts and no gradients
  if pd == stored then pd = nil end
  return pd or stored, rd or stored
end

-- ---------------------------------------------------------------- unit layouts and memory

-- moonshard.plan_layout lays out the units (FSDP2's padded shards), moonshard.plan_memory
-- sums what every rank holds; both with the planner's errors and checked sums.
local helpers = { plan = M, fail = fail, add = add, mul = mul, too_big = too_big, display = display, shown = shown,
  count_str = count_str, call_site = call_site, is_ancestor = is_ancestor, DTYPE_SIZE = DTYPE_SIZE, FLOAT = FLOAT, MAX = MAX }
local layout = require("moonshard.plan_layout").bind(helpers)
local memory = require("moonshard.plan_memory").bind(helpers)
local tensor_parallel = require("moonshard.plan_tp").bind(helpers)
local pipeline = require("moonshard.plan_pp").bind(helpers)
local activations = require("moonshard.plan_activations").bind(helpers)

local replicate = require("moonshard.plan_replicate").bind(helpers)
M.ddp_buckets = replicate.buckets

--- Makes `module` a replicate unit, like DistributedDataParallel(module, bucket_cap_mb=...)
-- (moonshard.plan_replicate): its parameters whole on every rank of one axis (default: the
-- whole data-parallel group), their gradients averaged by one all_reduce per bucket.  opts:
-- mesh (an axis name, or a list of one), bucket_cap_mb (nil: 25 MiB, the first bucket 1 MiB),
-- find_unused_parameters, gradient_as_bucket_view, static_graph, broadcast_buffers (booleans,
-- DDPConfig's, default false).  A fully_shard on an ancestor made later leaves its
-- parameters to it, as FSDP2 does with a replicated module.
function Ctx:replicate(module, opts) return replicate.replicate(self, module, opts) end

local megatron = require("moonshard.plan_megatron").bind(helpers)
--- Makes `module` a Megatron-FSDP unit (moonshard.plan_megatron): its parameters in flat,
-- padded buffers per bucket, each rank holding one contiguous slice of every bucket for the
-- sharded states of opts.zero_dp_strategy (0..3 or no_shard, optim, optim_grads,
-- optim_grads_params; default 3).  opts: mesh, unit_modules (class names), grad_reduce_in_fp32,
-- preserve_fp32_weights, overlap_param_gather, bucket_size.
function Ctx:megatron_fsdp(module, opts) return megatron.megatron_fsdp(self, module, opts) end

--- Splits the model into pipeline stages (moonshard.plan_pp) before any unit is made.
function Ctx:pipeline(opts) return pipeline.apply(self, opts) end
local traffic = require("moonshard.plan_comm").bind(helpers)
M.tokens = traffic.tokens
check_shard_dim = layout.check_shard_dim
M.placements = tensor_parallel.placements

--- Applies a tensor-parallel plan (module pattern -> style; moonshard.plan_tp) before any
-- unit is made; returns the number of modules it placed.
function Ctx:tensor_parallel(plan) return tensor_parallel.apply(self, plan) end

-- ---------------------------------------------------------------- what the policy sees

-- A policy is untrusted code, and the planner's own data must be out of its reach: it
-- sees a copy of the module tree (its own classes, so replacing a method changes only its
-- copy), a copy of the mesh and the config, and a context whose methods take its copies,
-- check and copy what it hands them (strings are strings, dtypes are dtypes, modules and
-- parameters are the copy's), and work on the planner's tree.  The planner keeps nothing of
-- the policy's: no table and no function of it is read after parallelize returns, so no
-- policy code runs outside the sandbox's budget, and the plan is made and validated from
-- data the policy cannot reach.

-- Plain data (strings, numbers, booleans, tables of them), copied; the rest left out.
local function copy_data(v, depth)
  local t = type(v)
  if t == "string" or t == "number" or t == "boolean" then return v end
  if t ~= "table" or depth > 32 then return nil end
  local c = {}
  for k, x in next, v do
    local tk = type(k)
    if tk == "string" or tk == "number" or tk == "boolean" then c[k] = copy_data(x, depth + 1) end
  end
  return c
end

local function copy_class(class, names)
  local c = {}
  for _, n in ipairs(names) do c[n] = class[n] end
  c.__index = c
  return c
end

-- The policy's view of the model and the mesh, and the maps between its copies and the
-- planner's objects.
local function new_view()
  local VModule = copy_class(ms_module.Module,
    { "get", "named_modules", "named_parameters", "named_buffers", "param_count", "param_bytes", "__tostring" })
  local VParam = copy_class(ms_module.Param, { "meta", "nbytes", "__tostring" })
  local view = { of = {}, orig = {} } -- of: planner object -> copy; orig: copy -> planner object
  function view.param(p)
    local v = view.of[p]
    if not v then
      v = setmetatable({ shape = util.copy(p.shape), dtype = p.dtype, numel = p.numel,
        requires_grad = p.requires_grad, checkpoint_dtype = p.checkpoint_dtype }, VParam)
      view.of[p], view.orig[v] = v, p
    end
    return v
  end
  function view.module(m)
    local v = view.of[m]
    if v then return v end
    v = setmetatable({ type = m.type, children = {}, child_order = util.copy(m.child_order), params = {},
      param_order = util.copy(m.param_order), buffers = copy_data(m.buffers, 0) or {},
      buffer_order = util.copy(m.buffer_order or {}), attrs = copy_data(m.attrs, 0) or {} }, VModule)
    view.of[m], view.orig[v] = v, m
    for _, c in ipairs(m.child_order) do v.children[c] = view.module(m.children[c]) end
    for _, n in ipairs(m.param_order) do v.params[n] = view.param(m.params[n]) end
    return v
  end
  -- after the planner changed m's children (checkpoint wrapping): the copy's follow
  function view.refresh(m)
    local v = view.of[m]
    v.children, v.child_order = {}, util.copy(m.child_order)
    for _, c in ipairs(m.child_order) do v.children[c] = view.module(m.children[c]) end
  end
  return view
end

-- The planner's object (of `class`) behind one of the policy's copies; the error names what
-- was given instead.
local function planner_object(view, x, class, what, expected, plural)
  local o = type(x) == "table" and view.orig[x]
  if not o or getmetatable(o) ~= class then
    fail(string.format("%s: expected %s, got %s", what, expected,
      type(x) == "table" and "a table that is not one of ctx.model's " .. plural or "a " .. type(x)))
  end
  return o
end

-- A module of the policy's (its copy, or a dotted name) as the planner's.
local function module_arg(view, m, what)
  if type(m) == "string" then return m end
  return planner_object(view, m, ms_module.Module, what, "a module of ctx.model or a module's dotted name", "modules")
end

local function param_arg(view, p, what)
  return planner_object(view, p, ms_module.Param, what, "a parameter of ctx.model", "parameters")
end

local function string_arg(v, what, optional)
  if v == nil and optional then return nil end
  if type(v) ~= "string" then fail(string.format("%s is a %s; expected a string", what, type(v))) end
  return v
end

-- The options of ctx:fully_shard, copied: the mesh's axes and the dtypes checked to be
-- strings, policy parameters replaced by the planner's.  Ctx:fully_shard checks the rest
-- (its messages run no metamethod) and refuses unknown keys by name.
local function shard_options(view, opts, where)
  if opts == nil then return nil end
  if type(opts) ~= "table" then fail(string.format("%s: the options are a %s; expected a table", where, type(opts))) end
  local o = {}
  for k, v in pairs(opts) do o[k] = v end
  if o.mesh ~= nil then
    local axes = o.mesh
    if type(axes) == "string" then axes = { axes } end
    if type(axes) ~= "table" then
      fail(string.format("%s: mesh is a %s; expected an axis name or a list of them", where, type(axes)))
    end
    o.mesh = {}
    for i = 1, #axes do o.mesh[i] = string_arg(axes[i], where .. ": mesh[" .. i .. "]") end
  end
  for _, key in ipairs({ "mp_policy", "islands_mp_policy" }) do
    if type(o[key]) == "table" then
      local mp = {}
      for k, v in pairs(o[key]) do mp[k] = v end
      for _, k in ipairs({ "param_dtype", "reduce_dtype", "output_dtype" }) do
        mp[k] = string_arg(mp[k], where .. ": " .. key .. "." .. k, true)
      end
      o[key] = mp
    end
  end
  if type(o.islands) == "table" then
    -- modules of ctx.model (the policy's copies) or dotted names; fully_shard checks the list
    local list = {}
    for k, v in pairs(o.islands) do
      list[k] = module_arg(view, v, where .. ": islands[" .. shown(k) .. "]")
    end
    o.islands = list
  end
  if o.ignored_params ~= nil then
    if type(o.ignored_params) ~= "table" then
      fail(string.format("%s: ignored_params is a %s; expected a list of parameters or their names", where,
        type(o.ignored_params)))
    end
    local list = {}
    for k, v in pairs(o.ignored_params) do
      local item = (type(k) ~= "number") and k or v
      -- a {fqn, param} pair, as ctx:params_of gives them
      if type(item) == "table" and not view.orig[item] and type(item[2]) == "table" then item = item[2] end
      if type(item) ~= "string" then item = param_arg(view, item, where .. ": ignored_params") end
      list[#list + 1] = item
    end
    o.ignored_params = list
  end
  return o
end

local function mp_arg(mp, what)
  if mp == nil then return nil end
  if type(mp) ~= "table" then fail(string.format("%s: mp_policy is a %s; expected a table", what, type(mp))) end
  return { param_dtype = string_arg(mp.param_dtype, what .. ": mp_policy.param_dtype", true),
    reduce_dtype = string_arg(mp.reduce_dtype, what .. ": mp_policy.reduce_dtype", true) }
end

-- The mesh as the policy sees it: its sizes and axes, copied; its methods answer from the
-- planner's mesh.
local function mesh_view(mesh)
  local v = { world = mesh.world, fsdp_axes = util.copy(mesh.fsdp_axes), sizes = copy_data(mesh.sizes, 0) }
  for _, name in ipairs({ "size", "group_size", "stride", "outside", "coord", "describe", "root_axes" }) do
    v[name] = function(_, ...) return mesh[name](mesh, ...) end
  end
  local group_size = v.group_size
  function v.group_size(self, axes)
    if type(axes) ~= "table" then fail("mesh:group_size takes a list of axis names, got a " .. type(axes)) end
    local copy = {}
    for i = 1, #axes do copy[i] = string_arg(axes[i], "mesh:group_size: axes[" .. i .. "]") end
    return group_size(self, copy)
  end
  local root_axes = v.root_axes
  function v.root_axes(self) return copy_data(root_axes(self), 0) end
  return v
end

local prefetch_value -- (below, with the policy's prefetch)

-- ctx:log: each call prints one line of at most LOG_CALL_BYTES, a plan at most
-- LOG_TOTAL_BYTES; later lines are dropped (one line says so).
M.LOG_CALL_BYTES, M.LOG_TOTAL_BYTES = 2000, 65536

-- ctx:log's values as one line, running no metamethod of the policy's and bounded whatever
-- they hold: strings with control characters escaped, tables read raw (next) three levels
-- deep and 16 entries wide, modules and parameters of ctx.model by what they are.
local function log_line(ctx, view, ...)
  local parts, left = {}, M.LOG_CALL_BYTES
  local function emit(s)
    if left <= 0 then return false end
    if #s > left then s = s:sub(1, left) .. "..." end
    parts[#parts + 1] = s
    left = left - #s
    return left > 0
  end
  local function value(v, depth, quoted)
    local t = type(v)
    if t == "string" then return emit(quoted and '"' .. clean(v, 200) .. '"' or clean(v, math.max(left, 1))) end
    if t == "number" then return emit(count_str(v)) end
    if t == "boolean" or t == "nil" then return emit(tostring(v)) end
    if t ~= "table" then return emit("<" .. t .. ">") end
    local o = view.orig[v]
    if o and getmetatable(o) == ms_module.Module then
      if not ctx.names then rebuild_names(ctx) end
      return emit(string.format("<module %s (%s)>", display(ctx.names[o] or "?"), clean(tostring(o.type), 60)))
    elseif o and getmetatable(o) == ms_module.Param then
      return emit(string.format("<param %s %s>", shape_str(o.shape), tostring(o.dtype)))
    end
    if depth >= 3 then return emit("{...}") end
    if not emit("{") then return false end
    -- up to 256 keys, sorted (numbers first, then strings, then the rest), the first 16 shown
    local keys, more = {}, false
    for k in next, v do
      if #keys == 256 then more = true break end
      keys[#keys + 1] = k
    end
    local rank = { number = 1, string = 2 }
    table.sort(keys, function(a, b)
      local ra, rb = rank[type(a)] or 3, rank[type(b)] or 3
      if ra ~= rb or ra == 3 then return ra < rb end
      return a < b
    end)
    for i, k in ipairs(keys) do
      local x = rawget(v, k)
      if i > 16 then more = true break end
      if i > 1 and not emit(", ") then return false end
      if k ~= i then
        local key = type(k) == "string" and k:find("^[%a_][%w_]*$") and #k <= 60 and k
        if key then
          if not emit(key .. " = ") then return false end
        else
          if not emit("[") or not value(k, depth + 1, true) or not emit("] = ") then return false end
        end
      end
      if not value(x, depth + 1, true) then return false end
    end
    if more and not emit(", ...") then return false end
    return emit("}")
  end
  for i = 1, select("#", ...) do
    if (i > 1 and not emit(" ")) or not value((select(i, ...)), 0, false) then break end
  end
  return table.concat(parts)
end

-- The context parallelize(ctx) receives: its own table of methods (closures), so that
-- replacing one changes nothing but this table.
local function policy_context(ctx, opts)
  local view = new_view()
  ctx.present = view.param
  local pub = { model = view.module(ctx.model), mesh = mesh_view(ctx.mesh), config = copy_data(opts.config, 0) }
  function pub.module(_, m) return view.module(ctx:module(module_arg(view, m, "ctx:module"))) end
  function pub.name_of(_, m) return ctx:name_of(ctx:module(module_arg(view, m, "ctx:name_of"))) end
  function pub.params_of(_, m)
    local out = {}
    for i, np in ipairs(ctx:params_of(module_arg(view, m, "ctx:params_of"))) do
      out[i] = { np[1], view.param(np[2]) }
    end
    return out
  end
  function pub.is_owned(_, p) return ctx:is_owned(param_arg(view, p, "ctx:is_owned")) end
  function pub.compute_dtype(_, p, mp)
    return ctx:compute_dtype(param_arg(view, p, "ctx:compute_dtype"), mp_arg(mp, "ctx:compute_dtype"))
  end
  function pub.warn(_, msg)
    if type(msg) ~= "string" then
      if type(msg) ~= "number" then fail("ctx:warn takes a string, got a " .. type(msg)) end
      msg = tostring(msg)
    end
    -- printed with the plan: no control characters (a newline or an escape sequence could
    -- forge lines of the report), at most 2000 bytes
    if #msg > 2000 then msg = msg:sub(1, 2000) .. string.format("... (%d bytes)", #msg) end
    ctx:warn((msg:gsub("[%z\1-\31\127]", function(c) return string.format("\\x%02X", c:byte()) end)))
  end
  function pub.checkpoint_wrap(_, list, which)
    local m = ctx:module(module_arg(view, list, "ctx:checkpoint_wrap"))
    -- the choice is read raw (rawget, next, rawlen) by wrap_positions, during the policy's call
    local made = ctx:checkpoint_wrap(m, which)
    view.refresh(m)
    return made
  end
  -- the options, a copy (the policy may change it; the plan records the planner's)
  pub.options = copy_data(ctx.options, 0) or {}
  function pub.set_prefetch(_, pf)
    ctx.prefetch = prefetch_value(pf, "ctx:set_prefetch: prefetch", ctx.prefetch)
  end
  function pub.log(_, ...)
    -- once the plan's lines are spent, nothing more is formatted
    if (ctx.log_bytes or 0) < M.LOG_TOTAL_BYTES then ctx:log(log_line(ctx, view, ...)) end
  end
  function pub.expert_parallel(_, m, eopts)
    local o
    if eopts ~= nil then
      if type(eopts) ~= "table" then
        fail("ctx:expert_parallel: the options are a " .. type(eopts) .. "; expected a table")
      end
      o = { by = string_arg(eopts.by, "ctx:expert_parallel: by", true) }
      if o.by and not (o.by:find("^[%a_][%w_]*$") and #o.by <= 32) then
        fail("ctx:expert_parallel: by is a label for the plan (letters, digits and _, at most 32), got " ..
          string.format("%q", o.by:sub(1, 40)))
      end
    end
    local out = {}
    for i, p in ipairs(ctx:expert_parallel(module_arg(view, m, "ctx:expert_parallel"), o)) do out[i] = view.param(p) end
    return out
  end
  function pub.pipeline(_, popts)
    if popts ~= nil and type(popts) ~= "table" then
      fail("ctx:pipeline: the options are a " .. type(popts) .. "; expected a table")
    end
    local stages = ctx:pipeline(copy_data(popts or {}, 0))
    local out = {}
    for i, s in ipairs(stages) do
      out[i] = { index = s.index, rank = s.rank, layers = { first = s.layers.first, count = s.layers.count },
        modules = util.copy(s.modules) }
    end
    return out
  end
  function pub.tensor_parallel(self, plan)
    if plan == nil and type(self) == "table" and self ~= pub then
      fail("ctx:tensor_parallel: the plan is missing; call it with a colon, ctx:tensor_parallel{...}")
    end
    if type(plan) ~= "table" then
      fail("ctx:tensor_parallel: the plan is a " .. type(plan) .. "; expected a table of module pattern = style")
    end
    return ctx:tensor_parallel(copy_data(plan, 0))
  end
  function pub.replicate(_, m, ropts)
    local module = ctx:module(module_arg(view, m, "ctx:replicate"))
    local o
    if ropts ~= nil then
      if type(ropts) ~= "table" then
        fail(string.format("replicate(%s): the options are a %s; expected a table", display(ctx:name_of(module)),
          type(ropts)))
      end
      o = {}
      for k, v in next, ropts do o[k] = type(v) == "table" and (copy_data(v, 0) or {}) or v end
    end
    local unit = ctx:replicate(module, o)
    local params, buckets = {}, {}
    for i, p in ipairs(unit.params) do params[i] = view.param(p) end
    for i, b in ipairs(unit.buckets) do
      buckets[i] = { index = b.index, params = util.copy(b.fqns), bytes = b.bytes, dtype = b.dtype }
    end
    return { name = unit.name, kind = unit.kind, mesh_axes = util.copy(unit.mesh_axes), params = params,
      buckets = buckets }
  end
  function pub.megatron_fsdp(_, m, mopts)
    local module = ctx:module(module_arg(view, m, "ctx:megatron_fsdp"))
    local o
    if mopts ~= nil then
      if type(mopts) ~= "table" then
        fail(string.format("megatron_fsdp(%s): the options are a %s; expected a table", display(ctx:name_of(module)),
          type(mopts)))
      end
      o = {}
      for k, v in next, mopts do o[k] = type(v) == "table" and (copy_data(v, 0) or {}) or v end
    end
    local unit = ctx:megatron_fsdp(module, o)
    local params = {}
    for i, p in ipairs(unit.params) do params[i] = view.param(p) end
    return { name = unit.name, kind = unit.kind, mesh_axes = util.copy(unit.mesh_axes), params = params,
      strategy = unit.megatron.strategy, buckets = #unit.megatron.buckets }
  end
  function pub.fully_shard(_, m, sopts)
    local module = ctx:module(module_arg(view, m, "ctx:fully_shard"))
    local where = "fully_shard(" .. display(ctx:name_of(module)) .. ")"
    local unit = ctx:fully_shard(module, shard_options(view, sopts, where))
    -- what the policy may want of it, copied
    local params = {}
    for i, p in ipairs(unit.params) do params[i] = view.param(p) end
    return { name = unit.name, kind = unit.kind, mesh_axes = util.copy(unit.mesh_axes), params = params }
  end
  return pub
end

-- A prefetch table {forward = n, backward = n} checked and copied (read raw: no metamethod
-- of the policy's runs); keys it does not give keep their value in `base`.  `what` names it.
function prefetch_value(pf, what, base)
  if type(pf) ~= "table" then
    fail(what .. " is " .. shown(pf) .. "; expected a table {forward = n, backward = n}")
  end
  local out = {}
  for k, v in next, pf do
    if k ~= "forward" and k ~= "backward" then
      fail(what .. " has the key " .. (type(k) == "string" and clean(k, 40) or "of a " .. type(k)) ..
        "; expected forward and backward only")
    end
    -- units fetched ahead; the embedding API hands them to C as ints
    if not util.is_int(v) or v < 0 or v > 2147483647 then
      fail(string.format("%s.%s is %s; expected an integer >= 0 (units fetched ahead)", what, k,
        type(v) == "string" and "'" .. clean(v, 40) .. "'" or shown(v)))
    end
    out[k] = v
  end
  return { forward = out.forward or base.forward, backward = out.backward or base.backward }
end

-- The policy's static prefetch (its entry table's), read raw; a missing depth is FSDP2's
-- implicit one.
local function prefetch_of(policy)
  local pf = rawget(policy, "prefetch")
  if pf == nil then return nil end
  return prefetch_value(pf, "the policy's prefetch", { forward = 1, backward = 1 })
end

-- ---------------------------------------------------------------- the plan

-- Every trainable parameter belongs to exactly one unit or to expert parallelism (units
-- cannot claim a parameter twice and cannot claim expert parameters: fully_shard checks
-- both as it goes), so what is left to check is that nothing was forgotten.
local function validate_ownership(ctx, params)
  local unowned, fqn_of = {}, {}
  for _, np in ipairs(params) do fqn_of[np[2]] = np[1] end
  for _, np in ipairs(params) do
    local fqn, p = np[1], np[2]
    if p.requires_grad and not ctx.owner[p] and not ctx.ep[p] then unowned[#unowned + 1] = fqn end
  end
  if #unowned > 0 then
    -- FSDP2 leaves them replicated with gradients no one reduces: say why they were missed
    local why = ""
    for _, u in ipairs(ctx.units) do
      for _, p in ipairs(u.ignored) do
        if p.requires_grad and not ctx.owner[p] and not ctx.ep[p] and why == "" then
          why = string.format(" (%s is in the ignored_params of unit %s, and FSDP2's units around a unit skip its " ..
            "module, ignored parameters included)", fqn_of[p], display(u.name))
        end
      end
    end
    fail(string.format("%d trainable parameter%s left unowned: %s%s%s; every trainable parameter must belong to " ..
      "exactly one shard unit or to expert parallelism", #unowned, #unowned == 1 and " is" or "s are",
      table.concat(unowned, ", ", 1, math.min(#unowned, 8)), #unowned > 8 and string.format(" (and %d more)", #unowned - 8) or "",
      why))
  end
end

-- With ep_shard > 1 every expert lives on ep_shard ranks, and its gradients must be reduced
-- across them: a unit on ep_shard does that (NeMo Automodel's MoE parallelizer shards the
-- experts with fully_shard on the ep_shard mesh when it has more than one rank).  Trainable
-- expert parameters in no unit would be replicas whose gradients no one reduces, which the
-- runtime cannot run as planned: refused, saying what to add.
local function validate_expert_replicas(ctx, fqn_of)
  local replicas = ctx.mesh:size("ep_shard")
  if replicas == 1 then return end
  local bare = {}
  for _, p in ipairs(ctx.ep_order) do
    if p.requires_grad and FLOAT[p.dtype] and not ctx.owner[p] then bare[#bare + 1] = fqn_of[p] end
  end
  if #bare == 0 then return end
  fail(string.format("expert parallelism places %d trainable parameter%s that no unit shards (%s%s), but ep_shard = " ..
    "%d: each expert is replicated on %d ranks and its gradients must be reduced across them, which a unit on " ..
    "ep_shard does; shard the experts with ctx:fully_shard(experts, {mesh = {\"ep_shard\"}, ...}) before their " ..
    "layer (as NeMo Automodel's MoE parallelizer does), or choose ep so that ep_shard = 1",
    #bare, #bare == 1 and "" or "s", table.concat(bare, ", ", 1, math.min(#bare, 4)),
    #bare > 4 and string.format(" and %d more", #bare - 4) or "", replicas, replicas))
end

-- A unit's trainable parameters live on every data-parallel rank (pp = 1 here; a tp rank holds
-- its own slice of each, reduced over the data-parallel ranks like the rest): the
-- dense ones on all dp_replicate x dp_shard x cp ranks, an expert's on the ep_shard ranks
-- that hold it.  Their gradients are reduced over the unit's mesh only, so a mesh of fewer
-- ranks (a size-1 axis, dp_shard alone under HSDP, ep_shard for dense layers) leaves
-- replicas that drift apart: FSDP2 would run it, and train wrong.  Refused, naming the mesh
-- that covers them.
local function validate_unit_meshes(ctx, fqn_of)
  local mesh = ctx.mesh
  local dense = mesh:group_size(mesh.fsdp_axes)
  for _, u in ipairs(ctx.units) do
    local covered = mesh:group_size(u.mesh_axes)
    for _, p in ipairs(u.params) do
      if p.requires_grad and FLOAT[p.dtype] then
        local expert = ctx.ep[p] ~= nil
        local need = expert and mesh:size("ep_shard") or dense
        if covered ~= need then
          fail(string.format("unit %s reduces the gradient of %s over %d rank%s (mesh {%s}), but the %s lives on %d " ..
            "data-parallel ranks: the other replicas would never see it and drift apart; shard it on %s",
            display(u.name), fqn_of[p], covered, covered == 1 and "" or "s", table.concat(u.mesh_axes, ", "),
            expert and "expert parameter" or "parameter", need,
            expert and "{ep_shard} (the ranks holding the same experts)" or
              "the FSDP mesh {" .. table.concat(mesh.fsdp_axes, ", ") .. "} (the default)"))
        end
      end
    end
  end
end

-- Every parameter's dtype is known and its elements and bytes, and the model's, are exact
-- counts (at most 2^53): what every figure of the plan is made of.
local function check_params(model)
  local n, bytes = 0, 0
  for _, np in ipairs(model:named_parameters()) do
    local fqn, p = np[1], np[2]
    check_dtype(p.dtype, "the dtype of parameter " .. fqn)
    if p.numel > MAX then
      fail(string.format("parameter %s of shape %s has more than 2^53 = 9007199254740992 elements, where the " ..
        "planner's counts stop being exact", fqn, shape_str(p.shape)))
    end
    if p.numel * DTYPE_SIZE[p.dtype] > MAX then
      too_big("the bytes of parameter %s of shape %s in %s", fqn, shape_str(p.shape), p.dtype)
    end
    local b = p.numel * DTYPE_SIZE[p.dtype]
    n, bytes = add(n, p.numel, "the model's parameter count"), add(bytes, b, "the model's parameter bytes")
  end
end

-- The optimizers a plan counts the state of: adamw (fp32 moments, and fp32 master weights
-- for parameters stored in another dtype: TE FusedAdam's and moonshard's default),
-- torch_adamw (torch.optim.AdamW on the stored parameters: two moments of the stored dtype,
-- no master weights), none.
M.OPTIMIZERS = { adamw = true, torch_adamw = true, none = true }

-- What plan() is asked: the optimizer known, a mesh it plans (pp = 1), a policy with
-- parallelize.  Returns the optimizer and parallelize.
local function check_request(mesh, policy, opts)
  local optimizer = opts.optimizer or "adamw"
  if not M.OPTIMIZERS[optimizer] then
    fail(string.format("optimizer %s: expected adamw, torch_adamw or none",
      type(optimizer) == "string" and "'" .. optimizer .. "'" or tostring(optimizer)))
  end
  -- the mesh's fault, not the policy's: no policy position in these
  local parallelize = type(policy) == "table" and rawget(policy, "parallelize")
  if type(parallelize) ~= "function" then fail("the policy has no parallelize(ctx) function") end
  return optimizer, parallelize
end

-- Runs the policy's parallelize on a fresh context; returns the context, and the names of
-- the modules checkpoint_wrap wrapped.
local function run_policy(model, mesh, policy, parallelize, options, opts)
  local ctx = M.context(model, mesh, opts)
  ctx.prefetch = prefetch_of(policy) or ctx.prefetch
  ctx.options = options
  parallelize(policy_context(ctx, opts))
  ctx.present = nil
  rebuild_names(ctx)
  local checkpointed = {}
  for i, w in ipairs(ctx.checkpointed) do checkpointed[i] = ctx.names[w] end
  return ctx, checkpointed
end

-- What expert parallelism placed, in the order it saw the parameters: the plan's `owned`.
local function expert_owned(ctx, fqn_of)
  local owned = {}
  for _, p in ipairs(ctx.ep_order) do
    local e = ctx.ep[p]
    owned[#owned + 1] = { fqn = fqn_of[p], by = e.by, shape = p.shape, dtype = p.dtype, placements = e.placements,
      local_shape = e.local_shape, requires_grad = p.requires_grad, unit = ctx.owner[p] and ctx.owner[p].name or nil }
  end
  return owned
end

local function listing(names)
  return table.concat(names, ", ", 1, math.min(#names, 6)) ..
    (#names > 6 and string.format(" (and %d more)", #names - 6) or "")
end

-- Warnings: latency-bound units and padding waste, grouped so a reader sees them once.
local function unit_warnings(ctx, warnings)
  local small, padded, unset_reduce, unset_islands = {}, {}, {}, 0
  for _, u in ipairs(ctx.units) do
    if u.shard_size > 1 and #u.params > 0 and u.gather_bytes_per_rank < M.LATENCY_BOUND_BYTES then
      small[#small + 1] = display(u.name)
    end
    -- gradients whose reduce dtype comes from a rule that changed between PyTorch versions:
    -- reduce_dtype unset beside a param_dtype other than the stored one
    if u.mp.param_dtype and not u.mp.reduce_dtype and u.grad_shard_bytes > 0 and u.mp.param_dtype ~= u.stored_dtype then
      unset_reduce[#unset_reduce + 1] = string.format("%s (%s)", display(u.name), u.reduce_dtype_eff)
    end
    -- (and a packed unit's islands, by their own policy)
    for _, isl in ipairs(u.islands or {}) do
      if isl.mp.param_dtype and not isl.mp.reduce_dtype then
        for _, p in ipairs(isl.params) do
          if p.requires_grad and FLOAT[p.dtype] and p.dtype ~= isl.mp.param_dtype then
            unset_reduce[#unset_reduce + 1] = string.format("%s (island of %s, %s)", display(isl.name), display(u.name),
              select(2, M.effective_dtypes(p.dtype, isl.mp)))
            unset_islands = unset_islands + 1
            break
          end
        end
      end
    end
    if u.padding_fraction > M.PADDING_WASTE then
      padded[#padded + 1] = string.format("%s (%.0f%%)", display(u.name), 100 * u.padding_fraction)
    end
  end
  if #unset_reduce > 0 then
    local n, isl = #unset_reduce, unset_islands
    local what = isl == 0 and (n == 1 and "unit" or "units") or isl == n and (n == 1 and "packed island" or
      "packed islands") or "units and packed islands"
    warnings[#warnings + 1] = string.format("%d %s set param_dtype but not reduce_dtype: planned as PyTorch " ..
      "2.15's FSDP2 runs %s, reducing gradients in the stored dtype; FSDP2 before 2.15 reduced them in " ..
      "param_dtype: set reduce_dtype to pin it: %s", n, what, n == 1 and "it" or "them", listing(unset_reduce))
  end
  if #small > 0 then
    warnings[#warnings + 1] = string.format("%d unit%s move%s less than %s per all-gather and will be latency " ..
      "bound: %s", #small, #small == 1 and "" or "s", #small == 1 and "s" or "", util.bytes(M.LATENCY_BOUND_BYTES),
      listing(small))
  end
  if #padded > 0 then
    warnings[#warnings + 1] = string.format("%d unit%s more than %d%% of %s gathered elements: %s",
      #padded, #padded == 1 and " pads" or "s pad", math.floor(100 * M.PADDING_WASTE + 0.5),
      #padded == 1 and "its" or "their", listing(padded))
  end
end

-- A builder that follows Automodel's model where transformers 5 stores some parameters in
-- f32 (attrs.transformers_fp32: name substrings, _keep_in_fp32_modules_strict): a unit that
-- holds such a parameter beside trainable parameters of another dtype is planned here, and
-- FSDP2 would refuse it on the transformers model ("FSDP expects uniform original
-- parameter dtype").
local function transformers_fp32_warning(ctx, model, warnings)
  local tf32 = model.attrs.transformers_fp32
  if type(tf32) == "table" and #tf32 > 0 then
    local refused, example = {}, nil
    for _, u in ipairs(ctx.units) do
      local hit, other
      for _, e in ipairs(u.entries) do
        local matches = false
        for _, token in ipairs(tf32) do matches = matches or e.fqn:find(token, 1, true) ~= nil end
        if e.param.requires_grad then
          if matches and e.param.dtype ~= "f32" then hit = hit or e.fqn
          elseif not matches and e.param.dtype ~= "f32" then other = true end
        end
      end
      if hit and other then
        refused[#refused + 1] = display(u.name)
        example = example or hit
      end
    end
    if #refused > 0 then
      warnings[#warnings + 1] = string.format("%s is built as %s builds it (%s in %s); transformers 5 " ..
        "keeps it in f32 (_keep_in_fp32_modules_strict), and FSDP2 on the transformers model would refuse the %d " ..
        "unit%s holding it beside %s weights (\"FSDP expects uniform original parameter dtype\"): %s; a " ..
        "transformers checkpoint (--safetensors) planned with fully_shard_by_dtype (policies/by_dtype.lua, or " ..
        "fsdp2_default with ep > 1) gives it a unit of its own",
        tostring(model.attrs.architecture or model.type), tostring(model.attrs.convention or "this builder"), example,
        tostring(model.attrs.dtype or "the model's dtype"), #refused, #refused == 1 and "" or "s",
        tostring(model.attrs.dtype or "other"), listing(refused))
    end
  end
end

-- Expert parallelism's own traffic: the routed tokens go to their experts' ranks and back
-- (all_to_all on the ep group, in every MoE layer's forward and backward).  Without a batch
-- the count leaves it out, and says so rather than letting 0 stand for it.
local function expert_warnings(model, mesh, owned, warnings, tokens)
  local ep = mesh:size("ep")
  if ep > 1 and #owned == 0 then
    local why = "the policy called no expert_parallel, or the model has no grouped experts"
    for _, nm in ipairs(model:named_modules()) do
      local name, m = nm[1], nm[2]
      if m.type == "ModuleList" and (name == "experts" or name:match("%.experts$")) then
        why = string.format("%s holds %d per-expert modules, the Hugging Face checkpoint layout; Automodel " ..
          "groups experts into [experts, in, out] tensors when it loads them: plan with --config for that layout",
          name, #m.child_order)
        break
      end
    end
    warnings[#warnings + 1] = string.format("ep = %d but expert parallelism places no parameter (%s): " ..
      "the ep axis only divides the ranks", ep, why)
  end
  if ep > 1 and #owned > 0 and not tokens then
    warnings[#warnings + 1] = string.format("all_to_all counts none of expert parallelism's token traffic " ..
      "(ep = %d): every MoE layer sends its routed tokens to the experts' ranks and back, forward and backward; " ..
      "give the batch (--seq-len, --micro-batch, --global-batch) to count it", ep)
  end

end

-- torch.optim.AdamW on 16-bit parameters keeps its moments in 16 bits and no master
-- weights: NeMo Automodel's documented trap for long full-parameter runs.
local function optimizer_warnings(optimizer, params, warnings)
  if optimizer == "torch_adamw" then
    local low = {}
    for _, np in ipairs(params) do
      local p = np[2]
      if p.requires_grad and (p.dtype == "bf16" or p.dtype == "f16") then
        local t = low[p.dtype] or { count = 0, numel = 0 }
        low[p.dtype], t.count, t.numel = t, t.count + 1, t.numel + p.numel
      end
    end
    for _, dt in ipairs({ "bf16", "f16" }) do
      local t = low[dt]
      if t then
        warnings[#warnings + 1] = string.format("torch_adamw keeps the AdamW moments of %d trainable %s parameters " ..
          "(%s elements) in %s, with no fp32 master weights: small updates round away in long full-parameter " ..
          "runs; store them in f32, or plan --optimizer adamw (fp32 master weights and moments)", t.count, dt,
          util.thousands(t.numel), dt)
      end
    end
  end

end


--- plan(model, mesh, policy, opts) -> plan
-- policy: a table with parallelize(ctx) (and optionally prefetch = {forward, backward} and
-- options, its declared knobs: see M.declared_options).
-- opts: config (the model config), name, architecture, optimizer (M.OPTIMIZERS; default
-- "adamw"), policy_name (the policy's path, named by errors found after its call and
-- prefixed to ctx:log's lines), options (name -> value, over the declared defaults), set (a
-- list of "name=value" strings, as --set gives them, applied after options), warnings (a
-- table: ctx:warn's messages are appended to it as they come, so a plan that fails still
-- has them), log (function(line): where ctx:log's lines go; default stderr).
-- The plan records options (a list of {name, value, set}) and checkpointed (the names of
-- the modules checkpoint_wrap wrapped).
-- What tensor parallelism placed: nil without it, else {size, sequence_parallel (a style
-- of the plan is one), plan = {pattern, style, modules}, params = map param -> placement}.
local function tp_summary(ctx)
  if #ctx.tp_plan == 0 or ctx.mesh:size("tp") == 1 then return nil end
  local sp, plan = false, {}
  for i, r in ipairs(ctx.tp_plan) do
    sp = sp or r.style:find("^sequence_parallel") ~= nil
    plan[i] = { pattern = r.pattern, style = r.style, modules = r.modules }
  end
  return { size = ctx.mesh:size("tp"), sequence_parallel = sp, plan = plan, params = ctx.tp, count = #ctx.tp_order,
    modules = ctx.tp_modules }
end

local function plan(model, mesh, policy, opts)
  local optimizer, parallelize = check_request(mesh, policy, opts)
  -- a recipe (moonshard.recipe): its steps run on a copy of the model, in Automodel's order,
  -- before the policy shards it; its distributed, pipeline and moe fields set policy options
  local recipe, steps, values, recipe_notes = opts.recipe, nil, opts.options, nil
  if recipe ~= nil then
    local R = require "moonshard.recipe"
    if type(recipe) ~= "table" or type(recipe.file) ~= "string" then recipe = R.check(recipe, "recipe") end
    R.check_mesh(recipe, mesh)
    model, steps, recipe_notes = R.apply(recipe, model)
    local option_notes
    values, option_notes = R.policy_options(recipe, M.declared_options(policy), opts.policy_name, mesh:size("ep"),
      mesh:size("pp"))
    for _, x in ipairs(option_notes) do recipe_notes[#recipe_notes + 1] = x end
    table.sort(recipe_notes)
    for k, v in pairs(opts.options or {}) do values[k] = v end
  end
  check_params(model)
  -- the options: declared defaults, then opts.options (after the recipe's), then opts.set
  local option_list, options = M.resolve_options(M.declared_options(policy), values, opts.set)
  local tokens = M.tokens(mesh, opts.tokens)
  local ctx, checkpointed = run_policy(model, mesh, policy, parallelize, options, opts)
  local params = model:named_parameters()
  local fqn_of = {}
  for _, np in ipairs(params) do fqn_of[np[2]] = np[1] end
  validate_ownership(ctx, params)
  validate_expert_replicas(ctx, fqn_of)
  validate_unit_meshes(ctx, fqn_of)
  layout.lay_out(ctx, fqn_of)
  -- What a rank holds depends on its pp coordinate (the units of its stages) and, where
  -- tensor parallelism splits a dim unevenly, on its tp coordinate (its pieces): memory is
  -- made for each pair, and every rank takes its own; the units keep tp coordinate 0's
  -- figures (the largest pieces).
  local pps = ctx.pp and mesh:size("pp") or 1
  local tps = #ctx.tp_uneven > 0 and mesh:size("tp") or 1
  local all_units, all_ep = ctx.units, ctx.ep_order
  local by_pair = {}
  for t = 0, tps - 1 do
    if t > 0 then -- the units are laid out for tp coordinate 0 already
      ctx.tp_variant = t
      layout.lay_out(ctx, fqn_of)
    end
    for p = 0, pps - 1 do
      if ctx.pp then ctx.units, ctx.ep_order = pipeline.on_rank(ctx, all_units, all_ep, p) end
      by_pair[p * tps + t] = memory.per_rank(ctx, model, mesh, optimizer, fqn_of, ctx.pp and pipeline.buffer_filter(ctx, p))
      ctx.units, ctx.ep_order = all_units, all_ep
    end
  end
  if tps > 1 then
    ctx.tp_variant = nil
    layout.lay_out(ctx, fqn_of)
  end
  local mem = by_pair[0]
  local pipeline_view = ctx.pp and pipeline.summary(ctx, mesh, tokens, function(p) return by_pair[p * tps].total end)
  -- with a batch, the activations each pp coordinate keeps (plan_activations)
  local acts = tokens and activations.plan(ctx, model, mesh, tokens, pipeline_view and pipeline_view.in_flight)
  if acts then
    for k, m in pairs(by_pair) do
      local a = acts.by_pp[util.idiv(k, tps)]
      m.activations, m.transient = a.activations, a.transient
    end
  end
  if pps * tps > 1 then
    mem = memory.combine(function(r) return by_pair[mesh:coord("pp", r) * tps + mesh:coord("tp", r) % tps] end, mesh)
  end
  local owned = expert_owned(ctx, fqn_of)
  -- communication per step: rank 0's, the units of its stages under a pipeline
  if ctx.pp then ctx.units, ctx.ep_order = pipeline.on_rank(ctx, all_units, all_ep, 0) end
  local comm = traffic.per_step(ctx, mesh, owned, tokens)
  ctx.units, ctx.ep_order = all_units, all_ep
  if pipeline_view and pipeline_view.send_recv then comm.send_recv = pipeline_view.send_recv[1] end
  local warnings = util.copy(ctx.warnings)
  unit_warnings(ctx, warnings)
  transformers_fp32_warning(ctx, model, warnings)
  if tokens and tokens.cp_rotate and mesh:size("cp") == 1 then
    warnings[#warnings + 1] = string.format("cp_rotate %s has no effect: cp = 1, so no keys or values are exchanged",
      tokens.cp_rotate)
  end
  -- a recipe's 4-bit weights: FSDP2's mixed precision would cast their packed codes
  local packed, storage = {}, nil
  for _, u in ipairs(ctx.units) do
    for _, e in ipairs(u.entries or {}) do
      local pmp = u.mp and M.param_mp(u, e.param)
      if e.param.quant and pmp and pmp.param_dtype and pmp.param_dtype ~= e.param.dtype then
        packed[#packed + 1] = string.format("%s (unit %s, param_dtype %s)", e.fqn, display(u.name), pmp.param_dtype)
        storage = storage or e.param.dtype
      end
    end
  end
  if #packed > 0 then
    warnings[#warnings + 1] = string.format("%d 4-bit weight%s stored as packed codes in %s sit in units whose " ..
      "mixed precision casts parameters to another dtype (%s%s): FSDP2 would cast the packed codes; the plan " ..
      "gathers them in their storage dtype. Set bnb_4bit_quant_storage to the units' param_dtype",
      #packed, #packed == 1 and "" or "s", storage, packed[1], #packed > 1 and
      string.format(", and %d more", #packed - 1) or "")
  end
  if mesh:size("pp") > 1 and not ctx.pp then
    warnings[#warnings + 1] = string.format("pp = %d but the policy split the model into no pipeline stages " ..
      "(ctx:pipeline): every pp rank holds the whole model as planned, and the pp axis only divides the ranks",
      mesh:size("pp"))
  end
  if mesh:size("tp") > 1 and #ctx.tp_order == 0 then
    warnings[#warnings + 1] = string.format("tp = %d but the policy placed no parameter by tensor parallelism " ..
      "(ctx:tensor_parallel): every tp rank holds the same shards as its peers, and the tp axis only divides the " ..
      "ranks", mesh:size("tp"))
  end
  if #ctx.tp_uneven > 0 then
    local tpn, parts = mesh:size("tp"), {}
    for i = 1, math.min(#ctx.tp_uneven, 4) do
      local x = ctx.tp_uneven[i]
      parts[i] = string.format("%s dim %d: %d over %d", x.fqn, x.dim, x.size, tpn)
    end
    warnings[#warnings + 1] = string.format("tensor parallelism splits %d parameter%s unevenly (%s%s): PyTorch " ..
      "accepts it (torch.chunk: ceil(n / tp) rows, the last tp ranks fewer or none), so tp ranks hold unequal " ..
      "pieces; memory per rank follows each rank's own, the units' figures are tp rank 0's (the largest)",
      #ctx.tp_uneven, #ctx.tp_uneven == 1 and "" or "s", table.concat(parts, "; "),
      #ctx.tp_uneven > 4 and string.format("; and %d more", #ctx.tp_uneven - 4) or "")
  end
  expert_warnings(model, mesh, owned, warnings, tokens)
  optimizer_warnings(optimizer, params, warnings)
  local result = {
    manager = M.manager_of(ctx.units),
    optimizer = optimizer,
    model = { name = opts.name or "model", architecture = opts.architecture or model.type,
      params = model:param_count(), trainable_params = model:trainable_param_count(), bytes = model:param_bytes(),
      convention = type(model.attrs.convention) == "string" and model.attrs.convention or nil },
    mesh = mesh,
    units = ctx.units,
    owned = owned,
    memory = mem,
    activations = acts and acts.breakdown,
    comm = comm,
    warnings = warnings,
    prefetch = ctx.prefetch,
    options = option_list,
    checkpointed = checkpointed,
    fqn_of = fqn_of,
    params = params,
    tensor_parallel = tp_summary(ctx),
    tokens = tokens,
    pipeline = pipeline_view,
    model_tree = model,
  }
  if recipe ~= nil then
    result.recipe = { file = recipe.file, manager = recipe.manager, steps = steps, notes = recipe_notes }
    if recipe.manager ~= result.manager and #ctx.units > 0 then
      fail(string.format("the recipe %s asks for the %s manager, but the policy %s made %s units (give the " ..
        "manager's policy, or leave --policy out to take the shipped one)", recipe.file, recipe.manager,
        opts.policy_name or "", result.manager))
    end
  end
  -- with a device profile: its memory figures and the step's time (moonshard.plan_time)
  if opts.device ~= nil then require("moonshard.plan_time").attach(result, ctx, opts) end
  -- FP32 island units whose collectives are latency bound: packing them would save calls
  local islands = require("moonshard.plan_time").island_warning(ctx, result, result.device)
  if islands then warnings[#warnings + 1] = islands end
  -- with a batch, each rank's peak; with a device too, whether it fits (plan_memory)
  memory.peaks(result.memory)
  return result
end

--- The distributed manager a plan's units stand for: "megatron_fsdp" with a Megatron-FSDP
-- unit, "ddp" with a replicate unit, else "fsdp2".
function M.manager_of(units)
  local m = "fsdp2"
  for _, u in ipairs(units) do
    if u.kind == "megatron_fsdp" then return "megatron_fsdp" end
    if u.kind == "replicate" then m = "ddp" end
  end
  return m
end

function M.plan(model, mesh, policy, opts)
  opts = opts or {}
  planning = type(opts.policy_name) == "string" and opts.policy_name or nil
  local ok, result = pcall(plan, model, mesh, policy, opts)
  planning = nil
  if not ok then error(result, 0) end
  return result
end

--- The dtype audit: for every parameter, where it lives and its stored, gathered and
-- reduced dtypes.  A list of {fqn, unit, kind, stored, gathered, reduced, island (the
-- island of a packed unit the parameter belongs to, else nil), steps}.
function M.audit(plan)
  local unit_of, island_of = {}, {}
  for _, u in ipairs(plan.units) do
    for _, e in ipairs(u.entries) do unit_of[e.param] = { u, e } end
    for _, isl in ipairs(u.islands or {}) do
      for _, p in ipairs(isl.params) do island_of[p] = isl.name end
    end
  end
  local ep = {}
  for _, o in ipairs(plan.owned) do ep[o.fqn] = o end
  local out = {}
  for _, np in ipairs(plan.params) do
    local fqn, p = np[1], np[2]
    local ue = unit_of[p]
    local steps = M.recipe_tags(plan, np)
    if ue then
      out[#out + 1] = { fqn = fqn, unit = ue[1].name, kind = ue[1].kind, stored = p.dtype, gathered = ue[2].gather,
        reduced = (p.requires_grad and FLOAT[p.dtype]) and ue[2].reduce or nil, island = island_of[p] }
    elseif ep[fqn] then
      -- Expert parallelism moves no parameters, and an expert parameter in no unit is one the
      -- plan accepted because ep_shard = 1 (or it is frozen): each expert lives on one rank
      -- and nothing is reduced.
      out[#out + 1] = { fqn = fqn, unit = nil, kind = "ep", stored = p.dtype, gathered = p.dtype, reduced = nil }
    else
      out[#out + 1] = { fqn = fqn, unit = nil, kind = "frozen", stored = p.dtype, gathered = p.dtype, reduced = nil }
    end
    out[#out].steps = steps
  end
  return out
end

--- What a recipe's steps made of a parameter (moonshard.recipe), a list of tags: "4-bit nf4"
-- (a quantized weight), "lora adapter", "lora base" (a frozen weight under an adapter), "fp8"
-- (a Float8Linear's weight; "fp8 gather" when gathered as e4m3), "qat <quantizer>".
function M.recipe_tags(plan, np)
  local tags = {}
  if not plan.recipe then return tags end
  local fqn, p, owner = np[1], np[2], np[3]
  local m = plan.model_tree and plan.model_tree:get(owner)
  local attrs = m and m.attrs or {}
  local pname = fqn:match("([^.]+)$")
  if p.quant then tags[#tags + 1] = "4-bit " .. p.quant.type end
  if fqn:find("lora_", 1, true) then
    tags[#tags + 1] = "lora adapter"
  elseif attrs.lora then
    tags[#tags + 1] = "lora base"
  end
  if attrs.fp8 and pname == "weight" then tags[#tags + 1] = p.fp8_gather and "fp8 gather" or "fp8" end
  if attrs.qat and pname == "weight" then tags[#tags + 1] = "qat " .. attrs.qat.quantizer end
  return tags
end

return M
