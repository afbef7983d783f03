-- raises.lua: errors from policy code, on purpose and not.
return {
  fail = function(name) error("no unit for '" .. name .. "'") end,
  index_nil = function() local t = nil return t.x end,
  call = function(f, ...) return f(...) end,
  -- error objects that are not strings
  table = function() error({ code = 42, why = "no unit", unit = {} }) end,
  nothing = function() error() end,
  boolean = function() error(true) end,
  tostring = function() error(setmetatable({}, { __tostring = function() return "no unit for 'x'" end })) end,
  bad_tostring = function() error(setmetatable({}, { __tostring = function() error("no name") end })) end,
  table_tostring = function() error(setmetatable({}, { __tostring = function() return {} end })) end,
  caught = function() local ok, e = pcall(error, { code = 7 }) return ok, type(e), e.code end,
}
