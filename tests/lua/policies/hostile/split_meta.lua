-- split_meta.lua: the tables ctx:pipeline and ctx:tensor_parallel take carry metamethods that
-- would loop forever, and the stages handed back are changed after use: the planner reads the
-- tables raw, runs none of their metamethods, and keeps its own stages.
local spin = { __index = function() while true do end end, __pairs = function() while true do end end,
  __tostring = function() while true do end end, __len = function() while true do end end }
return { parallelize = function(ctx)
  local stages = ctx:pipeline(setmetatable({ schedule = "1F1B" }, spin))
  ctx:tensor_parallel(setmetatable({ ["model.layers.*.self_attn.q_proj"] = setmetatable({ "colwise" }, spin),
    ["model.layers.*.self_attn.o_proj"] = "rowwise" }, spin))
  for _, s in ipairs(stages) do
    for i = s.layers.first, s.layers.first + s.layers.count - 1 do ctx:fully_shard("model.layers." .. i) end
    ctx:fully_shard(ctx.model, { stage = s.index })
  end
  stages[1].index, stages[1].modules[1], stages[2].layers.count = 7, "lm_head", 0
end }
