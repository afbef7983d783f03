-- table.sort runs in C: 2 million elements (42 million comparisons) is work the count must
-- see before it starts.
return { parallelize = function()
  local t, x = {}, 12345
  for i = 1, 2e6 do x = (x * 1103515245 + 12345) % 2147483648 t[i] = x end
  table.sort(t)
end }
