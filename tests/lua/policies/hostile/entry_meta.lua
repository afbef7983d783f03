-- The planner looks for parallelize raw: an __index is not called to find it.
return setmetatable({}, { __index = function() while true do end end })
