-- Expert parallelism splits a MoE block's grouped experts, not the whole model.
return { parallelize = function(ctx) ctx:expert_parallel(ctx.model) end }
