-- A __len (Lua 5.4) would make table.insert shift 2^40 elements of nothing in C.
return { parallelize = function()
  local t = setmetatable({}, { __len = function() return 2 ^ 40 end })
  table.insert(t, 1, "x")
end }
