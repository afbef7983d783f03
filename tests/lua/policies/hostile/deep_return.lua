-- A value nested 300,000 deep, walked after the call returned: no stack overflow there.
local t = {}
for _ = 1, 300000 do t = { t } end
return { deep = t, parallelize = function(ctx)
  require("clean").parallelize(ctx)
  return t
end }
