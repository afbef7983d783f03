-- moonshard.util: small helpers the Lua library shares, in the subset of Lua that both
-- Lua 5.4 and LuaJIT accept (no // operator, no bit operators, no math.type).

local M = {}

--- true when x is a number with an integral value
function M.is_int(x) return type(x) == "number" and x == math.floor(x) end

--- floor(a / b) for integral a, b >= 1 (exact below 2^53; an integer in Lua 5.4)
function M.idiv(a, b) return math.floor(a / b) end

--- ceil(a / b) for integral a >= 0, b >= 1
function M.ceil_div(a, b) return math.floor((a + b - 1) / b) end

--- What moonshard reads whole, at most (bytes), by kind; a larger file is refused by name
-- before it is read.  "json": a config.json or a model.safetensors.index.json (real ones
-- are far smaller: a config is a few KiB, DeepSeek-V3's index, some 90,000 tensors, under
-- 10 MiB); "policy": a policy file or any other Lua source, the default.  Safetensors
-- headers have their own limit (moonshard.safetensors.MAX_HEADER).
M.READ_LIMITS = { json = 64 * 1024 * 1024, policy = 16 * 1024 * 1024 }
local READ_WHAT = { json = "a JSON file", policy = "a policy file" }

-- The API's file_stat (path -> kind, size | nil, reason), or false when no binding can be
-- loaded (a stock interpreter without core.so or libmoonshard): then read_file has its size
-- limit alone.
local file_stat_fn
function M.file_stat_fn()
  if file_stat_fn == nil then
    local ok, core = pcall(require, "moonshard")
    file_stat_fn = ok and type(core) == "table" and type(core.file_stat) == "function" and core.file_stat or false
  end
  return file_stat_fn
end

--- check_regular(path, limit?, what?) -> true, size | nil, reason: whether path names a
-- regular file (of at most limit bytes, when given), asked without opening it, since
-- opening a FIFO waits for a writer and reading /dev/zero never ends.  reason leaves out the
-- path: "is a FIFO (named pipe), not a regular file", "is 80.0 MiB (83886080 bytes), more
-- than the 64.0 MiB limit for a JSON file".  A path that cannot be stat'ed (missing, no
-- permission) passes, for io.open to report in its own words, as does every path when the
-- core is not loaded (size nil).
function M.check_regular(path, limit, what)
  -- io.open would open the path up to the NUL, which may be anything
  if string.find(path, "\0", 1, true) then return nil, "the path holds a NUL byte" end
  local stat = M.file_stat_fn()
  if not stat then return true end
  local kind, size = stat(path)
  if not kind then return true end
  if kind ~= "regular file" then return nil, "is a " .. kind .. ", not a regular file" end
  if limit and size > limit then
    return nil, string.format("is %s (%d bytes), more than the %s limit for %s", M.bytes(size), size,
      M.bytes(limit), what or "this kind of file")
  end
  return true, size
end

--- Whether something exists at path, asked without opening it when the core is loaded (an
-- open of a FIFO would block); without the core, whether io.open can open it.
function M.exists(path)
  if string.find(path, "\0", 1, true) then return false end
  local stat = M.file_stat_fn()
  if stat then return stat(path) ~= nil end
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
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

local CHUNK = 1024 * 1024

--- read_file(path, kind?) -> text, or nil, message, opened.  The whole file at path, which
-- must be a regular file of at most READ_LIMITS[kind] bytes (kind "json" or "policy", the
-- default).  On failure opened is false when io.open failed (its message starts with the
-- path, "x: No such file or directory") and true otherwise: then the message is the reason
-- alone ("is a directory, not a regular file", "is a FIFO (named pipe), not a regular file",
-- "is 80.0 MiB (...), more than the 64.0 MiB limit for a JSON file", a read error).  Without
-- the core (check_regular) the file is read in chunks up to the limit, and a FIFO blocks.
function M.read_file(path, kind)
  kind = kind or "policy"
  local limit = M.READ_LIMITS[kind]
  if not limit then error("moonshard: read_file: unknown kind '" .. tostring(kind) .. "' (json or policy)", 2) end
  local ok, why = M.check_regular(path, limit, READ_WHAT[kind])
  if not ok then return nil, why, true end
  local f, err = io.open(path, "rb")
  if not f then return nil, err, false end
  local parts, n = {}, 0
  while true do
    local chunk, rerr = f:read(CHUNK)
    if not chunk then
      f:close()
      if rerr then return nil, rerr, true end -- a directory opens, then cannot be read
      break
    end
    n = n + #chunk
    if n > limit then
      f:close()
      return nil, string.format("is more than the %s limit for %s", M.bytes(limit), READ_WHAT[kind]), true
    end
    parts[#parts + 1] = chunk
  end
  return table.concat(parts)
end

--- io.open's reason without the path it starts with ("x: No such file..." -> "No such file...").
function M.io_reason(path, err)
  err = tostring(err)
  if err:sub(1, #path + 2) == path .. ": " then return err:sub(#path + 3) end
  return err
end

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

--- The helpers that touch no file (no read_file, file_stat_fn, check_regular, exists): what
-- the planner hands policies as "moonshard.util", since they run in a sandbox without io.
function M.pure()
  local t = {}
  for _, k in ipairs({ "is_int", "idiv", "ceil_div", "sorted_keys", "copy", "fixed1", "bytes", "thousands",
                       "short_name", "io_reason" }) do
    t[k] = M[k]
  end
  return t
end

return M
