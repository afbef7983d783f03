-- ... and under its memory cap.
return { parallelize = function(ctx)
  ctx:fully_shard(ctx.model, { shard_placement_fn = function()
    local t = {}
    for i = 1, 1e9 do t[i] = { i } end
  end })
end }
