-- log_flood.lua: ctx:log called a million times with long strings and wide tables: the plan
-- prints at most planner.LOG_TOTAL_BYTES of it, each line at most LOG_CALL_BYTES.
local clean = require "clean"
return { parallelize = function(ctx)
  local wide = {}
  for i = 1, 100000 do wide[i] = string.rep("w", 100) end
  local long = string.rep("x", 1000000)
  for _ = 1, 1000000 do ctx:log(long, wide) end
  clean.parallelize(ctx)
end }
