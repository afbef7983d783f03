-- table.concat's bounds given as strings, over a table whose __index is a C function.
return { parallelize = function()
  local t = setmetatable({}, { __index = rawlen })
  local _ = table.concat(t, "", "1", "1e12")
end }
