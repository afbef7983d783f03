-- expert_parallel's label goes into the plan JSON: a name, not free text.
return { parallelize = function(ctx)
  ctx:expert_parallel("model.layers.0.mlp.experts", { by = "ep\", \"evil\": \"1" })
end }
