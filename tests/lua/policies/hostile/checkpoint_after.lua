-- Wrapping layers already sharded would leave their units named for the wrappers.
return { parallelize = function(ctx)
  for _, i in ipairs(ctx:module("model.layers").child_order) do ctx:fully_shard("model.layers." .. i) end
  ctx:checkpoint_wrap("model.layers")
  ctx:fully_shard(ctx.model)
end }
