-- Units on a size-1 axis reduce gradients over one rank: the 8 data-parallel replicas drift.
return { parallelize = function(ctx)
  for _, i in ipairs(ctx:module("model.layers").child_order) do
    ctx:fully_shard("model.layers." .. i, { mesh = { "cp" } })
  end
  ctx:fully_shard(ctx.model, { mesh = "pp" })
end }
