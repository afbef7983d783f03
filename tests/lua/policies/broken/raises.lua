-- raises.lua: errors from policy code, on purpose and not.
return {
  fail = function(name) error("no unit for '" .. name .. "'") end,
  index_nil = function() local t = nil return t.x end,
  call = function(f, ...) return f(...) end,
}
