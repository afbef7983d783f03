-- The classes of the policy's copies are its own: replacing their methods leaves the
-- planner's alone, also methods that would loop if the planner called them.
local function spin() while true do end end
return { parallelize = function(ctx)
  require("clean").parallelize(ctx)
  local module_class = getmetatable(ctx.model)
  module_class.named_parameters, module_class.named_modules, module_class.get = spin, spin, spin
  module_class.__index = spin
  local _, p = next(ctx.model.children.model.children.embed_tokens.params)
  local param_class = getmetatable(p)
  param_class.nbytes, param_class.__index = spin, spin
end }
