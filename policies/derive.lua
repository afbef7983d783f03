-- derive.lua: policies built on a shipped one without copying it.
--
--   return require("fsdp2_default").with{ reshard_after_forward = false }
--
-- is a whole policy: fsdp2_default with new defaults for its options; `--set` still applies
-- on top.  Every shipped policy has `with` (M.with = derive.with_of(M)).  with(overrides)
-- takes option names (dotted, "prefetch.forward" = 2, or nested, prefetch = {forward = 2})
-- and returns a new table: the base's fields (parallelize and its helpers, unchanged) with
-- `options` a copy of the base's declarations whose defaults are the overrides, and a `with`
-- of its own (so derived policies derive again).  An unknown name is an error listing the
-- known ones; a value of the wrong type is refused by the planner, naming the option.  The
-- string "none" stands for nil (a Lua table cannot hold one) where the option takes nil.

local M = {}

local function names_of(options)
  local names = {}
  for name in pairs(options) do names[#names + 1] = name end
  table.sort(names)
  return names
end

-- The type the planner gives an option declared without one: its default's.
local function type_of(v)
  local t = type(v)
  if t == "number" then return v == math.floor(v) and "integer" or "number" end
  if t == "table" then return "list" end
  if t == "nil" then return nil end
  return t
end

-- (errors name the line that called with: 3 levels up from here)
local function derive(base, overrides)
  if type(overrides) ~= "table" then
    error("with: expected a table of option values, e.g. with{ reshard_after_forward = false }, got a " ..
      type(overrides), 3)
  end
  local options = {}
  for name, decl in pairs(base.options or {}) do
    local copy = {}
    for k, v in pairs(decl) do copy[k] = v end
    -- a type the planner took from the base's default stays the option's type
    if copy.type == nil then copy.type = type_of(copy.default) end
    options[name] = copy
  end
  local unknown
  local function put(name, value)
    if not options[name] and type(value) == "table" then
      local nested = false
      for known in pairs(options) do nested = nested or known:sub(1, #name + 1) == name .. "." end
      if nested then
        for k, v in pairs(value) do put(name .. "." .. tostring(k), v) end
        return
      end
    end
    if options[name] then options[name].default = value else unknown = unknown or tostring(name) end
  end
  for name, value in pairs(overrides) do put(name, value) end
  if unknown then
    local known = names_of(options)
    error(string.format("with: unknown option '%s'; the options are: %s", unknown,
      #known > 0 and table.concat(known, ", ") or "none (the policy declares no options)"), 3)
  end
  local derived = {}
  for k, v in pairs(base) do derived[k] = v end
  derived.options = options
  derived.with = function(more) return (derive(derived, more)) end
  return derived
end

--- A policy like `base` whose options default to `overrides`.
function M.with(base, overrides) return (derive(base, overrides)) end

--- with(overrides) for a policy table M: M.with = derive.with_of(M).
function M.with_of(policy)
  return function(overrides) return (derive(policy, overrides)) end
end

return M
