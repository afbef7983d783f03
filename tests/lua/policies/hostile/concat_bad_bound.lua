-- A bound that is no number goes to table.concat as the policy gave it, and it raises: it
-- must not turn into the default bound with the real one past the sandbox's count.
return { parallelize = function()
  local t = setmetatable({}, { __index = rawlen })
  local _ = table.concat(t, "", "x", "1e12")
end }
