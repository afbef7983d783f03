-- memory.lua: memory bombs, direct and caught by the policy's own pcall.  Results go
-- through a local so the error names the line (a tail call leaves no frame).
local function grow()
  local t, i = {}, 0
  while true do i = i + 1 t[i] = { i } end
end

return {
  rep = function() local s = string.rep("x", 1e9) return s end,
  method_rep = function() local s = ("x"):rep(1e9) return s end,
  rep_sep = function() local s = string.rep("", 1e8, "sep") return s end,
  grow = grow,
  pcall_grow = function() pcall(grow) return "escaped" end,
  small = function() return #string.rep("x", 1000) + #("ab"):rep(10) end,
}
