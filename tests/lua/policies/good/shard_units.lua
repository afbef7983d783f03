-- shard_units.lua: one unit per module name, FP32 islands marked; uses a sibling file and
-- an allowed host module.
local fp32 = require "fp32_modules"
local module = require "moonshard.module"

local leaf = {}
for _, name in ipairs(fp32) do leaf[name] = true end

local U = { fp32 = fp32 }

function U.is_fp32(name)
  return leaf[name:match("([^.]+)$")] == true
end

function U.build(names)
  local precision = require "precision" -- at call time: precision requires this file
  local units = {}
  for _, name in ipairs(names) do
    units[#units + 1] = { name = name, kind = U.is_fp32(name) and "fp32_island" or "module",
                          precision = precision.for_module(name) }
  end
  return units
end

function U.numel(shape)
  return module.param(shape, "bf16").numel
end

-- deep in a nested table, and returns a closure: both must run under the budget
U.nested = { deeper = { sum = function(n)
  local s = 0
  for i = 1, n do s = s + i end
  return s
end } }

function U.counter()
  local n = 0
  return function() n = n + 1 return n end
end

return U
