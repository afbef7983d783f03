-- The planner reads prefetch raw: no metamethod of it runs outside the policy's call.
local function spin() while true do end end
return { prefetch = setmetatable({}, { __index = spin, __pairs = spin }),
  parallelize = require("clean").parallelize }
