return { parallelize = function(ctx)
  for _, i in ipairs(ctx:module("model.layers").child_order) do ctx:fully_shard("model.layers." .. i) end
  ctx:fully_shard(ctx.model)
end }
