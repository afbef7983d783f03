-- The mesh the policy sees is a copy too.
local function spin() while true do end end
return { parallelize = function(ctx)
  ctx.mesh.sizes.dp_shard, ctx.mesh.fsdp_axes[1], ctx.mesh.world = 1, "ep", 1
  ctx.mesh.size = spin
  require("clean").parallelize(ctx)
end }
