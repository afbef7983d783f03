-- ep_alone.lua: the experts left to expert parallelism alone, in no unit: right only when
-- ep_shard = 1 (each expert on one rank); refused otherwise.
local M = {}
function M.parallelize(ctx)
  local layers = ctx:module("model.layers")
  local ignored = {}
  for _, i in ipairs(layers.child_order) do
    local e = ctx.model:get("model.layers." .. i .. ".mlp.experts")
    if e then for _, p in ipairs(ctx:expert_parallel(e)) do ignored[#ignored + 1] = p end end
  end
  for _, i in ipairs(layers.child_order) do ctx:fully_shard(layers.children[i], { ignored_params = ignored }) end
  ctx:fully_shard(ctx.model, { ignored_params = ignored })
end
return M
