-- The module tree the policy sees is its own copy: changing it changes nothing planned.
return { parallelize = function(ctx)
  for _, np in ipairs(ctx.model:named_parameters()) do
    local p = np[2]
    p.dtype, p.shape, p.numel, p.requires_grad = "bogus", {}, -1, false
  end
  require("clean").parallelize(ctx)
  ctx.model.children, ctx.model.child_order = {}, {}
end }
