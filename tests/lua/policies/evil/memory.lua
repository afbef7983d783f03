-- memory.lua: memory bombs, direct and caught by the policy's own pcall.  Results go
-- through a local so the error names the line (a tail call leaves no frame).
local function grow()
  local t, i = {}, 0
  while true do i = i + 1 t[i] = { i } end
end

local MiB = ("x"):rep(2 ^ 20)

return {
  rep = function() local s = string.rep("x", 1e9) return s end,
  method_rep = function() local s = ("x"):rep(1e9) return s end,
  rep_sep = function() local s = string.rep("", 1e8, "sep") return s end,
  grow = grow,
  pcall_grow = function() pcall(grow) return "escaped" end,
  small = function() return #string.rep("x", 1000) + #("ab"):rep(10) end,
  empty_rep = function() local s = string.rep("", 1e15) return s end,
  -- `..` in C, between two checks of the hook
  double = function() local s = MiB for _ = 1, 12 do s = s .. s end return #s end,
  concat = function() local t = {} for i = 1, 64 do t[i] = MiB end local s = table.concat(t) return s end,
  concat_sep = function() local s = table.concat({ ("a"):rep(20):byte(1, -1) }, MiB) return s end,
  gsub = function() local s = ("x"):rep(1000):gsub("x", ("y"):rep(20000)) return s end,
  format = function() local s = ("%s"):rep(17):format(MiB, MiB, MiB, MiB, MiB, MiB, MiB, MiB, MiB,
                                                     MiB, MiB, MiB, MiB, MiB, MiB, MiB, MiB) return s end,
  pack = function() local s = string.pack("c1000000000", "") return s end,
  -- what a host function built, kept past the call: a tail call, so no policy instruction
  -- (and no hook) runs between the build and the return
  keep = function(f, ...) return f(...) end,
  builders = function()
    return #table.concat({ "a", 1, "b" }, "-") + #("x"):gsub("x", "yy") + #("%5s|%q"):format("a", "b\n")
  end,
}
