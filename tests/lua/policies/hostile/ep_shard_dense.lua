-- Dense layers sharded on the expert mesh's ep_shard (2 of 8 ranks): their gradients would
-- never be reduced across ep.
return { parallelize = function(ctx)
  local ignored = {}
  for _, i in ipairs(ctx:module("model.layers").child_order) do
    local experts = ctx:module("model.layers." .. i .. ".mlp.experts")
    for _, p in ipairs(ctx:expert_parallel(experts)) do ignored[#ignored + 1] = p end
    ctx:fully_shard(experts, { mesh = { "ep_shard" }, shard_placement_fn = function() return 1 end })
    ctx:fully_shard("model.layers." .. i, { mesh = { "ep_shard" }, ignored_params = ignored })
  end
  ctx:fully_shard(ctx.model, { ignored_params = ignored })
end }
