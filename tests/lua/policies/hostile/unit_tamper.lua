-- What fully_shard returns is a copy: changing it changes no unit.
return { parallelize = function(ctx)
  for _, i in ipairs(ctx:module("model.layers").child_order) do
    local u = ctx:fully_shard("model.layers." .. i)
    u.mp = { param_dtype = "i8", reduce_dtype = "bool" }
    u.params, u.kind, u.mesh_axes = {}, "bogus", { "nope" }
  end
  ctx:fully_shard(ctx.model).params = {}
end }
