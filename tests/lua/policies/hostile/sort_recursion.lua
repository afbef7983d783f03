-- Recursion through table.sort's comparator.
local function again() table.sort({ 2, 1 }, function(a, b) again() return a < b end) end
return { parallelize = function() again() end }
