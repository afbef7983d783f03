-- Functions and metamethods left behind in what the planner handed out never run after
-- the policy's call: the plan is the clean one.
local function spin() while true do end end
return { parallelize = function(ctx)
  require("clean").parallelize(ctx)
  ctx.model.named_modules, ctx.model.get = spin, spin
  setmetatable(ctx.model, { __index = spin, __tostring = spin, __len = spin, __eq = spin, __concat = spin })
  ctx.fully_shard, ctx.name_of = spin, spin
  ctx.config = setmetatable({}, { __index = spin, __pairs = spin })
  return setmetatable({}, { __index = spin, __tostring = spin })
end }
