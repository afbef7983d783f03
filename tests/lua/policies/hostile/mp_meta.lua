-- A dtype is a string.
local function spin() while true do end end
return { parallelize = function(ctx)
  ctx:fully_shard(ctx.model, { mp_policy = { param_dtype = setmetatable({}, { __tostring = spin, __eq = spin,
    __concat = spin, __index = spin }) } })
end }
