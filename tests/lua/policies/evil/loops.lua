-- loops.lua: functions that never return, some trying to catch their own budget error.
-- callback keeps its frame (no tail call) so the budget error can name its line.
local function spin() while true do end end

return {
  spin = spin,
  nested = { deeper = { spin = function() local t = {} while true do t[1] = 1 end end } },
  pcall_spin = function() pcall(spin) return "escaped" end,
  retry_spin = function() for _ = 1, 1000 do pcall(spin) end return "escaped" end,
  xpcall_spin = function() xpcall(spin, function(e) return e end) return "escaped" end,
  handler_spin = function() xpcall(error, function() spin() end) return "escaped" end,
  closure = function() return function() spin() end end,
  error_object = function() error(setmetatable({}, { __tostring = function() spin() end })) end,
  callback = function(f) local r = f() return r end,
  tail_callback = function(f) return f() end,
}
