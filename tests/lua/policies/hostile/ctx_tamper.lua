-- Writing the planner's bookkeeping into ctx changes nothing: the plan is the clean one.
local function spin() while true do end end
return { parallelize = function(ctx)
  require("clean").parallelize(ctx)
  ctx.owner, ctx.units, ctx.ep, ctx.unit_of = {}, {}, {}, {}
  ctx.warnings = setmetatable({}, { __index = spin, __len = spin })
  ctx.prefetch = { forward = -1 }
  setmetatable(ctx, { __index = spin, __newindex = spin })
end }
