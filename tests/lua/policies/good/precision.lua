-- precision.lua: dtypes per unit.  Requires shard_units at load time; shard_units requires
-- this file back when it is called, so the two files require each other.
local units = require "shard_units"

local P = {
  default = { param_dtype = "bf16", reduce_dtype = "f32", output_dtype = "bf16" },
  fp32_island = { param_dtype = "f32", reduce_dtype = "f32", output_dtype = "f32" },
}

function P.for_module(name)
  return units.is_fp32(name) and P.fp32_island or P.default
end

return P
