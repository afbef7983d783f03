-- The same long string built again and again (LuaJIT interns it: no memory grows).
return { parallelize = function()
  local s = string.rep("x", 2 ^ 20)
  local t = {}
  for i = 1, 1e6 do t[i] = s .. s .. s .. s .. s .. s .. s .. s .. s .. s .. s .. s .. s .. s .. s .. s end
end }
