-- shard_placement_fn is policy code the planner calls: it runs in the policy's budget.
return { parallelize = function(ctx)
  ctx:fully_shard(ctx.model, { shard_placement_fn = function() while true do end end })
end }
