-- A mesh axis is a string.
local function spin() while true do end end
return { parallelize = function(ctx)
  ctx:fully_shard(ctx.model, { mesh = { setmetatable({}, { __eq = spin, __tostring = spin, __index = spin }) } })
end }
