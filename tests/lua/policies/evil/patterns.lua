-- patterns.lua: patterns whose backtracking would run in C for hours, and the ordinary ones
-- policies use, which must stay allowed.  Results go through a local so errors name the line.
local S = ("a"):rep(30)

return {
  star = function() local r = S:find(("a*"):rep(30) .. "b") return r end,
  optional = function() local r = string.match(S, ("a?"):rep(30) .. S) return r end,
  gmatch = function() local r = string.gmatch(S, ("a-"):rep(8) .. "b") return r end,
  balance = function() local r = ("("):rep(1000):gsub("%b()", "") return r end,
  -- each call is allowed; together they are more than the budget
  repeated = function() local s = ("a"):rep(100) while true do s:find("a*a*b") end end,
  -- three lazy captures: only the tries that land on a dot go on
  split = function(names)
    local out = {}
    for i, name in ipairs(names) do
      local head, kind, rest = name:match("^(.-)%.(.-)%.(.-)$")
      out[i] = head .. "|" .. kind .. "|" .. rest
    end
    return out
  end,
  ordinary = function(names)
    local out = {}
    for _, name in ipairs(names) do
      local layer = name:match("^model%.layers%.(%d+)%.") or name:match("^layers%.(%d+)%.mlp$")
      local parts = {}
      for part in name:gmatch("[^.]+") do parts[#parts + 1] = part end
      out[#out + 1] = table.concat({
        layer or "-", tostring(name:find("%.weight$") ~= nil), (name:gsub("%.", "/")),
        tostring(#parts), name:match("([^.]+)$"), tostring(name:find("mlp", 1, true)),
        (string.gsub(name, "%f[%w]%w+", string.upper)),
      }, " ")
    end
    return out
  end,
}
