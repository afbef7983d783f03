-- dir_keep: files that each keep most of the memory cap: together they keep more.
return { parallelize = function(ctx) ctx:fully_shard(ctx.model) end }
