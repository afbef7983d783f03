-- replicate_meta.lua: the options table ctx:replicate takes (and a table inside it) carry
-- metamethods that would loop forever: the planner reads them raw and runs none of them.
local spin = { __index = function() while true do end end, __pairs = function() while true do end end,
  __tostring = function() while true do end end, __len = function() while true do end end }
return { parallelize = function(ctx)
  ctx:replicate(ctx.model, setmetatable({ bucket_cap_mb = 1, mesh = setmetatable({ "dp_shard" }, spin) }, spin))
end }
