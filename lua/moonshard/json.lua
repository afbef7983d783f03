-- moonshard.json: a strict JSON (RFC 8259) decoder and a deterministic encoder.
--
-- Strict because config.json files, safetensors headers and plan files are contracts: a
-- trailing comma, a duplicate key or a stray byte is reported with its line and column
-- instead of being guessed around.  Deterministic because plan files are compared byte for
-- byte: the same value always encodes to the same text (keys sorted bytewise, or in the
-- order the caller gave with json.object).
--
-- Values: objects are plain tables; arrays carry json.array_mt so that an empty array stays
-- an array; JSON null is the sentinel json.null (a nil would end a Lua sequence).  Integers
-- without fraction or exponent decode to Lua integers where the runtime has them (5.4).
--
-- Written for both Lua 5.4 and LuaJIT: no integer division, bit operators or utf8 library.

local M = {}

local byte, char, sub, find, format = string.byte, string.char, string.sub, string.find, string.format
local floor, huge = math.floor, math.huge

M.MAX_DEPTH = 512

--- The metatable that marks a Lua table as a JSON array.
M.array_mt = { __name = "json.array" }

--- The JSON null sentinel.
M.null = setmetatable({}, { __name = "json.null", __tostring = function() return "null" end })

--- Marks t (default a new table) as a JSON array and returns it.
function M.array(t) return setmetatable(t or {}, M.array_mt) end

--- json.object(keys?, t?) -> t (default a new table), encoded with its keys in order: first
-- `keys` (a list of strings), then keys assigned later, in assignment order; keys that are
-- nil when encoding are skipped.
function M.object(keys, t)
  local order = {}
  for i, k in ipairs(keys or {}) do order[i] = k end
  return setmetatable(t or {}, {
    __order = order,
    __newindex = function(obj, k, v)
      order[#order + 1] = k
      rawset(obj, k, v)
    end,
  })
end

-- ---------------------------------------------------------------- UTF-8

-- Position of the first byte of s that does not start a well-formed UTF-8 sequence
-- (RFC 3629: no overlongs, no surrogates, nothing above U+10FFFF), or nil.
local function bad_utf8(s)
  local i = find(s, "[\128-\255]")
  while i do
    local c = byte(s, i)
    local n, lo, hi = 0, 128, 191
    if c >= 194 and c <= 223 then n = 1
    elseif c == 224 then n, lo = 2, 160
    elseif c == 237 then n, hi = 2, 159
    elseif c >= 225 and c <= 239 then n = 2
    elseif c == 240 then n, lo = 3, 144
    elseif c == 244 then n, hi = 3, 143
    elseif c >= 241 and c <= 243 then n = 3
    else return i end
    for k = 1, n do
      local d = byte(s, i + k)
      if not d or d < lo or d > hi then return i end
      lo, hi = 128, 191
    end
    i = find(s, "[\128-\255]", i + n + 1)
  end
  return nil
end

local function utf8_char(cp)
  if cp < 128 then return char(cp) end
  if cp < 2048 then return char(192 + floor(cp / 64), 128 + cp % 64) end
  if cp < 65536 then
    return char(224 + floor(cp / 4096), 128 + floor(cp / 64) % 64, 128 + cp % 64)
  end
  return char(240 + floor(cp / 262144), 128 + floor(cp / 4096) % 64,
    128 + floor(cp / 64) % 64, 128 + cp % 64)
end

-- ---------------------------------------------------------------- decoding

-- Input text quoted in an error (a key, a number): at most 64 bytes of it, then "..." and
-- its length, so that a message stays short whatever the input.
local function clip(s)
  if #s <= 64 then return s end
  return sub(s, 1, 64) .. format("... (%d bytes)", #s)
end

-- How a byte is shown in an error: 'x' when printable, else its code.
local function show(s, i)
  local c = byte(s, i)
  if not c then return "end of input" end
  if c >= 32 and c < 127 then return "'" .. char(c) .. "'" end
  return format("byte 0x%02X", c)
end

local Decoder = {}
Decoder.__index = Decoder

function Decoder:fail(i, what, expected)
  local line, last_nl = 1, 0
  local nl = find(self.s, "\n", 1, true)
  while nl and nl < i do
    line, last_nl = line + 1, nl
    nl = find(self.s, "\n", nl + 1, true)
  end
  error(format("moonshard: json: %s:%d:%d: %s (expected %s)", self.source, line, i - last_nl,
    what, expected), 0)
end

function Decoder:skip(i)
  return find(self.s, "[^ \t\n\r]", i) or #self.s + 1
end

local escapes = { [34] = '"', [92] = "\\", [47] = "/", [98] = "\b", [102] = "\f", [110] = "\n",
  [114] = "\r", [116] = "\t" }
local ESCAPES = [[one of \" \\ \/ \b \f \n \r \t \uXXXX]]

-- The string starting at the quote s[i]; returns it and the index after the closing quote.
function Decoder:string(i)
  local s = self.s
  local parts, j = {}, i + 1
  while true do
    local k = find(s, '[%z\1-\31"\\]', j)
    local c, e = byte(s, k or #s + 1, (k or #s) + 1)  -- the stop byte; the one after a '\\'
    if not c or (c == 92 and not e) then
      self:fail(i, "unterminated string", "'\"' before the end of input")
    end
    local raw = sub(s, j, k - 1)
    local bad = bad_utf8(raw)
    if bad then self:fail(j + bad - 1, "invalid UTF-8 in string", "UTF-8 text") end
    parts[#parts + 1] = raw
    if c == 34 then return table.concat(parts), k + 1 end
    if c < 32 then
      self:fail(k, format("control character U+%04X in string", c), "it escaped, e.g. \\n or \\u0000")
    end
    if escapes[e] then
      parts[#parts + 1] = escapes[e]
      j = k + 2
    elseif e == 117 then
      local cp, after = self:hex4(k)
      if cp >= 0xDC00 and cp <= 0xDFFF then
        self:fail(k, "lone low surrogate in \\u escape", "a high surrogate \\uD800-\\uDBFF first")
      elseif cp >= 0xD800 and cp <= 0xDBFF then
        local lo
        if sub(s, after, after + 1) == "\\u" then lo, after = self:hex4(after) end
        if not lo or lo < 0xDC00 or lo > 0xDFFF then
          self:fail(k, "lone high surrogate in \\u escape", "a low surrogate \\uDC00-\\uDFFF after it")
        end
        cp = 0x10000 + (cp - 0xD800) * 1024 + (lo - 0xDC00)
      end
      parts[#parts + 1] = utf8_char(cp)
      j = after
    else
      self:fail(k, "invalid escape '\\" .. (e and char(e) or "") .. "'", ESCAPES)
    end
  end
end

-- The code unit of the \uXXXX escape at s[k]; returns it and the index after it.
function Decoder:hex4(k)
  local h = self.s:match("^%x%x%x%x", k + 2)
  if not h then self:fail(k, "invalid \\u escape", "four hex digits after \\u") end
  return tonumber(h, 16), k + 6
end

-- Whether a count's digits (no sign, no leading zero) are above 2^53, compared as text:
-- LuaJIT's tonumber rounds 9007199254740993 to 2^53.
local TWO53 = "9007199254740992"
local function above_2_53(digits)
  if #digits ~= #TWO53 then return #digits > #TWO53 end
  for k = 1, #TWO53 do
    local a, b = byte(digits, k), byte(TWO53, k)
    if a ~= b then return a > b end
  end
  return false
end

-- The value of a number whose exponent has more than 4 digits, which LuaJIT's tonumber does
-- not read (nil from about 1e1000000 on, or a wrong value): its significant digits as 0.DDD
-- with the exponent that goes with them, so that what tonumber sees has a small exponent,
-- and no tonumber at all when the value is surely out of range (huge) or below the
-- smallest double (0).  Exact: only zeros are dropped.
local function big_exponent(negative, int, frac, exp_negative, exp)
  local all = int .. (frac or "")
  local zeros = #all:match("^0*")
  local sig = sub(all, zeros + 1):gsub("0+$", "")
  if sig == "" then return negative and -0.0 or 0.0 end
  local eff = #int - zeros + (exp_negative and -1 or 1) * tonumber(exp)  -- value = 0.sig * 10^eff
  if eff > 400 then return negative and -huge or huge end
  if eff < -400 then return negative and -0.0 or 0.0 end
  return tonumber(format("%s0.%se%d", negative and "-" or "", sig, eff))
end

function Decoder:number(i)
  local s = self.s
  local j = i
  if byte(s, j) == 45 then j = j + 1 end
  local digits = s:match("^%d+", j)
  if not digits then self:fail(j, "unexpected " .. show(s, j) .. " in number", "a digit") end
  if #digits > 1 and byte(digits) == 48 then
    self:fail(i, "leading zero in number", "a single 0 or a number starting with 1-9")
  end
  j = j + #digits
  local frac, exp, exp_negative
  if byte(s, j) == 46 then
    frac = s:match("^%d+", j + 1)
    if not frac then self:fail(j + 1, "unexpected " .. show(s, j + 1) .. " after '.'", "a digit") end
    j = j + 1 + #frac
  end
  local e = byte(s, j)
  if e == 101 or e == 69 then
    j = j + 1
    local sign = byte(s, j)
    if sign == 43 or sign == 45 then j = j + 1 end
    exp_negative = sign == 45
    exp = s:match("^%d+", j)
    if not exp then self:fail(j, "unexpected " .. show(s, j) .. " in exponent", "a digit") end
    j = j + #exp
  end
  local text = sub(s, i, j - 1)
  if self.counts and (j - i ~= #digits or above_2_53(digits)) then
    self:fail(i, "number " .. clip(text) .. " is not " .. (j - i ~= #digits and "an integer >= 0" or "at most 2^53"),
      "an integer count from 0 to 2^53")
  end
  -- Integer text that fits in 64 bits reads as a Lua 5.4 integer (tonumber does that; on
  -- LuaJIT every number is a double, exact below 2^53); fractions and exponents as floats.
  local x
  if exp and #exp > 4 then x = big_exponent(byte(s, i) == 45, digits, frac, exp_negative, exp)
  else x = tonumber(text) end
  if x == huge or x == -huge then self:fail(i, "number " .. clip(text) .. " is out of range", "a finite double") end
  return x, j
end

function Decoder:literal(i, word, value)
  if sub(self.s, i, i + #word - 1) ~= word then
    self:fail(i, "invalid literal", "true, false or null")
  end
  return value, i + #word
end

function Decoder:value(i, depth)
  local s = self.s
  i = self:skip(i)
  local c = byte(s, i)
  if c == 123 then return self:object(i, depth + 1) end
  if c == 91 then return self:array(i, depth + 1) end
  if c == 34 then return self:string(i) end
  if c == 45 or (c and c >= 48 and c <= 57) then return self:number(i) end
  if c == 116 then return self:literal(i, "true", true) end
  if c == 102 then return self:literal(i, "false", false) end
  if c == 110 then return self:literal(i, "null", M.null) end
  self:fail(i, "unexpected " .. show(s, i), "a value")
end

function Decoder:enter(i, depth)
  if depth > M.MAX_DEPTH then
    self:fail(i, "nesting deeper than " .. M.MAX_DEPTH .. " levels", "at most " .. M.MAX_DEPTH .. " nested arrays and objects")
  end
end

function Decoder:array(i, depth)
  self:enter(i, depth)
  local s, out = self.s, setmetatable({}, M.array_mt)
  i = self:skip(i + 1)
  if byte(s, i) == 93 then return out, i + 1 end
  while true do
    out[#out + 1], i = self:value(i, depth)
    i = self:skip(i)
    local c = byte(s, i)
    if c == 93 then return out, i + 1 end
    if c ~= 44 then self:fail(i, "unexpected " .. show(s, i) .. " in array", "',' or ']'") end
    i = self:skip(i + 1)
    if byte(s, i) == 93 then self:fail(i, "trailing comma in array", "a value after ','") end
  end
end

function Decoder:object(i, depth)
  self:enter(i, depth)
  local s, out = self.s, {}
  i = self:skip(i + 1)
  if byte(s, i) == 125 then return out, i + 1 end
  while true do
    if byte(s, i) ~= 34 then self:fail(i, "unexpected " .. show(s, i) .. " in object", "a key string") end
    local key, at = nil, i
    key, i = self:string(i)
    if out[key] ~= nil then
      self:fail(at, format("duplicate key %q in object", clip(key)), "each key once")
    end
    i = self:skip(i)
    if byte(s, i) ~= 58 then self:fail(i, "unexpected " .. show(s, i) .. " after key", "':'") end
    out[key], i = self:value(i + 1, depth)
    i = self:skip(i)
    local c = byte(s, i)
    if c == 125 then return out, i + 1 end
    if c ~= 44 then self:fail(i, "unexpected " .. show(s, i) .. " in object", "',' or '}'") end
    i = self:skip(i + 1)
    if byte(s, i) == 125 then self:fail(i, "trailing comma in object", "a key after ','") end
  end
end

--- decode(text, source_name?) -> value.  Errors name source_name (default "input"), the
-- line and the column (in bytes, 1-based).
--- decode(text, source_name?, opts?) -> value.  opts.counts: every number must be an
-- integer from 0 to 2^53 written without sign, fraction or exponent (safetensors headers).
function M.decode(text, source_name, opts)
  if type(text) ~= "string" then
    error("moonshard: json: decode needs a string, got " .. type(text), 2)
  end
  local d = setmetatable({ s = text, source = source_name or "input", counts = opts and opts.counts }, Decoder)
  local value, i = d:value(1, 0)
  i = d:skip(i)
  if i <= #text then d:fail(i, "unexpected " .. show(text, i) .. " after the value", "end of input") end
  return value
end

-- ---------------------------------------------------------------- encoding

local short_escapes = { ['"'] = '\\"', ["\\"] = "\\\\", ["\b"] = "\\b", ["\f"] = "\\f",
  ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t" }

local function escape_char(c)
  return short_escapes[c] or format("\\u%04x", byte(c))
end

-- Keys sort bytewise, so that the encoding does not depend on the locale.  Lua's < on
-- strings is strcoll, bytewise in the C locale (Lua's default, and far faster than
-- byte_less); a host that set another collation gets byte_less.
local function byte_less(a, b)
  local n = #a < #b and #a or #b
  for i = 1, n do
    local x, y = byte(a, i), byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end

local setlocale = os and os.setlocale

local function key_order()
  local collation = setlocale and setlocale(nil, "collate")
  if collation == "C" or collation == "POSIX" then return nil end
  return byte_less
end

local Encoder = {}
Encoder.__index = Encoder

-- The path of the value being encoded, JSONPath style with 0-based indices: $.units[2].name
function Encoder:where()
  local parts = { "$" }
  for _, k in ipairs(self.path) do
    if type(k) == "number" then parts[#parts + 1] = "[" .. (k - 1) .. "]"
    elseif k:match("^[%a_][%w_]*$") then parts[#parts + 1] = "." .. k
    else parts[#parts + 1] = format("[%q]", clip(k)) end
  end
  return table.concat(parts)
end

function Encoder:fail(what)
  error("moonshard: json: encode: " .. what .. " at " .. self:where(), 0)
end

function Encoder:put(s) self.buf[#self.buf + 1] = s end

function Encoder:number(x)
  if x ~= x then self:fail("cannot encode NaN") end
  if x == huge or x == -huge then self:fail("cannot encode an infinity") end
  if x == floor(x) and x >= -2 ^ 63 and x < 2 ^ 63 then return format("%d", x) end
  -- The shortest of 15, 16 or 17 significant digits that reads back as the same double.
  local s
  for digits = 15, 17 do
    s = format("%." .. digits .. "g", x)
    if tonumber(s) == x then break end
  end
  return s
end

function Encoder:string(s)
  if bad_utf8(s) then self:fail("string is not valid UTF-8") end
  return '"' .. s:gsub('[%z\1-\31"\\]', escape_char) .. '"'
end

-- n when t is a sequence 1..n and nothing else (n may be 0), else nil.
local function sequence_length(t)
  local n, count = #t, 0
  for k in pairs(t) do
    if type(k) ~= "number" or k ~= floor(k) or k < 1 or k > n then return nil end
    count = count + 1
  end
  if count ~= n then return nil end
  return n
end

function Encoder:newline(level)
  if self.indent then self:put("\n" .. string.rep(" ", self.indent * level)) end
end

function Encoder:table(t, level)
  if self.visiting[t] then self:fail("table contains itself") end
  self.visiting[t] = true
  local mt = getmetatable(t)
  local n = sequence_length(t)
  if mt == M.array_mt or (n and n > 0) then
    if not n then self:fail("array has keys other than 1..n") end
    self:items(t, n, level)
  else
    self:members(t, mt and mt.__order, level)
  end
  self.visiting[t] = nil
end

function Encoder:items(t, n, level)
  if n == 0 then return self:put("[]") end
  self:put("[")
  for i = 1, n do
    if i > 1 then self:put(",") end
    self:newline(level + 1)
    self.path[level + 1] = i
    self:value(t[i], level + 1)
  end
  self.path[level + 1] = nil
  self:newline(level)
  self:put("]")
end

function Encoder:members(t, order, level)
  local keys, seen = {}, {}
  for _, k in ipairs(order or {}) do
    if not seen[k] and rawget(t, k) ~= nil then keys[#keys + 1], seen[k] = k, true end
  end
  local rest = {}
  for k in pairs(t) do
    if type(k) ~= "string" then
      self:fail(format("object key %s is a %s; JSON keys are strings", tostring(k), type(k)))
    end
    if not seen[k] then rest[#rest + 1] = k end
  end
  table.sort(rest, self.key_less)
  for _, k in ipairs(rest) do keys[#keys + 1] = k end
  if #keys == 0 then return self:put("{}") end
  self:put("{")
  for i, k in ipairs(keys) do
    if i > 1 then self:put(",") end
    self:newline(level + 1)
    self.path[level + 1] = k
    self:put(self:string(k))
    self:put(self.indent and ": " or ":")
    self:value(t[k], level + 1)
  end
  self.path[level + 1] = nil
  self:newline(level)
  self:put("}")
end

function Encoder:value(v, level)
  local tv = type(v)
  if rawequal(v, M.null) then self:put("null")
  elseif tv == "boolean" then self:put(v and "true" or "false")
  elseif tv == "number" then self:put(self:number(v))
  elseif tv == "string" then self:put(self:string(v))
  elseif tv == "table" then self:table(v, level)
  else self:fail("cannot encode a " .. tv) end
end

--- encode(value, opts?) -> text.  opts.indent: spaces per level for a pretty layout (one
-- member or item a line); without it the text is compact.  Object keys come in json.object
-- order, else sorted bytewise.  Integral numbers print as integers; others as the shortest
-- of %.15g, %.16g, %.17g that reads back exactly.
function M.encode(value, opts)
  local indent = opts and opts.indent
  if indent ~= nil and (type(indent) ~= "number" or indent < 0 or indent ~= floor(indent)) then
    error("moonshard: json: encode: opts.indent must be an integer >= 0, got " .. tostring(indent), 2)
  end
  local e = setmetatable({ buf = {}, path = {}, visiting = {}, indent = indent,
    key_less = key_order() }, Encoder)
  e:value(value, 0)
  return table.concat(e.buf)
end

return M
