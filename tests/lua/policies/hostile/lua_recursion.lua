-- Plain deep recursion.
local function deeper(n) return deeper(n + 1) + 1 end
return { parallelize = function() deeper(1) end }
