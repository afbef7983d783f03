-- What it returns must be a dim: a table whose metamethods loop is refused, not compared.
local function spin() while true do end end
local evil = setmetatable({}, { __eq = spin, __lt = spin, __le = spin, __tostring = spin, __concat = spin,
  __index = spin, __len = spin, __unm = spin, __add = spin, __mod = spin })
return { parallelize = function(ctx)
  ctx:fully_shard(ctx.model, { shard_placement_fn = function() return evil end })
end }
