-- moonshard.util: small helpers the Lua library shares, in the subset of Lua that both
-- Lua 5.4 and LuaJIT accept (no // operator, no bit operators, no math.type).

local M = {}

--- true when x is a number with an integral value
function M.is_int(x) return type(x) == "number" and x == math.floor(x) end

--- floor(a / b) for integral a, b >= 1 (exact below 2^53; an integer in Lua 5.4)
function M.idiv(a, b) return math.floor(a / b) end

--- ceil(a / b) for integral a >= 0, b >= 1
function M.ceil_div(a, b) return math.floor((a + b - 1) / b) end

--- the keys of a table, sorted
function M.sorted_keys(t)
  local keys = {}
  for k in pairs(t) do keys[#keys + 1] = k end
  table.sort(keys)
  return keys
end

--- a shallow copy of a sequence
function M.copy(t)
  local c = {}
  for i = 1, #t do c[i] = t[i] end
  return c
end

--- "1.5 GiB", "312 KiB", "17 B"
function M.bytes(n)
  local units = { "B", "KiB", "MiB", "GiB", "TiB", "PiB" }
  local u, v = 1, n
  while v >= 1024 and u < #units do v, u = v / 1024, u + 1 end
  if u == 1 then return string.format("%d B", n) end
  return string.format("%.1f %s", v, units[u])
end

--- "8,030,261,248"
function M.thousands(n)
  local s = string.format("%d", n)
  local out = s:reverse():gsub("(%d%d%d)", "%1,"):reverse()
  return (out:gsub("^(%-?),", "%1"))
end

return M
