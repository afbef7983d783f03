-- ignored_params holds the model's parameters (or their names), not look-alikes.
return { parallelize = function(ctx)
  ctx:fully_shard(ctx.model, { ignored_params = { { shape = { 4 }, dtype = "f32", numel = 4, requires_grad = true } } })
end }
