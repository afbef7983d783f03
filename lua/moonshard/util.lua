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
--- The whole file at path: text, or nil, io's message and whether it opened (a directory
-- opens, then reads nothing).
function M.read_file(path)
  local f, err = io.open(path, "rb")
  if not f then return nil, err, false end
  local text, rerr = f:read("a")
  f:close()
  if not text then return nil, rerr, true end
  return text
end

--- A name as errors show it: at most max (default 80) bytes of it (cut before a UTF-8
-- continuation byte), then "..." and its length; bytes below 32 and 127 as \xHH (a NUL
-- would end the message in C).
function M.short_name(name, max)
  name = tostring(name)
  max = max or 80
  local s = name
  if #s > max then
    local cut = max
    while cut > 0 and s:byte(cut + 1) >= 128 and s:byte(cut + 1) < 192 do cut = cut - 1 end
    s = s:sub(1, cut) .. string.format("... (%d bytes)", #name)
  end
  return (s:gsub("[%z\1-\31\127]", function(c) return string.format("\\x%02X", c:byte()) end))
end

--- io.open's reason without the path it starts with ("x: No such file..." -> "No such file...").
function M.io_reason(path, err)
  err = tostring(err)
  if err:sub(1, #path + 2) == path .. ": " then return err:sub(#path + 3) end
  return err
end

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

--- string.format("%.1f", v) as C prints it (ties to even) under both interpreters: LuaJIT's
-- own formatter rounds exact binary ties (a multiple of 1/4 ending in .25 or .75) away from
-- zero, so "512.25" would print 512.3 there and 512.2 under Lua 5.4.
function M.fixed1(v)
  if v * 4 % 1 == 0 then -- only quarters can be ties at one decimal
    local t = v * 10     -- exact for them
    local r = math.floor(t)
    if t - r == 0.5 then v = (r % 2 == 0 and r or r + 1) / 10 end
  end
  return string.format("%.1f", v)
end

--- "1.5 GiB", "312 KiB", "17 B"
function M.bytes(n)
  local units = { "B", "KiB", "MiB", "GiB", "TiB", "PiB" }
  local u, v = 1, n
  while v >= 1024 and u < #units do v, u = v / 1024, u + 1 end
  if u == 1 then return string.format("%d B", n) end
  return M.fixed1(v) .. " " .. units[u]
end

--- "8,030,261,248"
function M.thousands(n)
  local s = string.format("%d", n)
  local out = s:reverse():gsub("(%d%d%d)", "%1,"):reverse()
  return (out:gsub("^(%-?),", "%1"))
end

return M
