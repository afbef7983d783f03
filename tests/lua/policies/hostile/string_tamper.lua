-- The policy's `string` is its own: replacing its functions changes neither the methods of
-- strings in library code it calls (the planner's name:sub, name:gmatch) nor the plan.
return { parallelize = function(ctx)
  local function liar() return "" end
  for _, name in ipairs({ "sub", "find", "gmatch", "match", "gsub", "format", "rep", "len" }) do string[name] = liar end
  require("clean").parallelize(ctx)
end }
