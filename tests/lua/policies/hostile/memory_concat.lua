-- Doubling a string: one instruction makes it twice as long.
return { parallelize = function()
  local s = "xxxxxxxx"
  for _ = 1, 40 do s = s .. s end
end }
