-- A repeat count given as a string is a count too (Lua 5.4 converts it).
return { parallelize = function() local _ = string.rep("", "1e17") end }
