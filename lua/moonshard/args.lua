-- moonshard.args: argument checks and errors for the Lua API's classes (moonshard.tensor,
-- moonshard.mesh, moonshard.unit), written once for both interpreters.
--
-- The messages are the C API's (luaL_argerror, luaL_typeerror, luaL_checkinteger): "bad
-- argument #2 to 'narrow' (number expected, got string)", with the position of the caller
-- of the API function ("file.lua:12: ") when that caller is Lua code and none when it is C
-- (pcall), and argument numbers that skip self in method calls.  A failed core call is
-- "moonshard <status> error: <the core's message>", as the binding returns it.
--
-- The binding (moonshard.raw) gives the interpreter's own primitives: to_integer (int64
-- cdata under LuaJIT) and classof.

local R = require "moonshard.raw"

local format = string.format
local getinfo = debug.getinfo

local M = {}

-- ---------------------------------------------------------------- where an error points

local LIBRARY = {} -- the sources of the API's files: frames the position skips

--- Marks the calling file as part of the API: its frames are skipped by the position.
function M.library_file()
  LIBRARY[getinfo(2, "S").source] = true
end
M.library_file()

-- The outermost API frame running now (the function the user called) and the position of
-- its caller: "chunk:line: " when that caller is Lua code, else "" (luaL_where).
local function api_frame()
  local level, api = 2, nil
  while true do
    local info = getinfo(level, "Snlf")
    if not info then return api, "" end
    if not LIBRARY[info.source] then
      return api, info.currentline > 0 and format("%s:%d: ", info.short_src, info.currentline) or ""
    end
    api, level = info, level + 1
  end
end

--- luaL_error: the message, formatted, at the caller of the API function.
local function raise(fmt, ...)
  local _, where = api_frame()
  error(where .. format(fmt, ...), 0)
end
M.raise = raise

--- The result of a binding call: its values (exactly as many as it returned), or the
-- binding's error (nil, message) raised.
function M.ok(...)
  local v, err = ...
  if v == nil and err ~= nil then
    local _, where = api_frame()
    error(where .. err, 0)
  end
  return ...
end

-- The name luaL_argerror gives a function called without one: "module.field" of a loaded
-- module (the shortest, so the public module's name before a class module's).
local function global_name(fn)
  local best
  for modname, mod in pairs(package.loaded) do
    if type(modname) == "string" and type(mod) == "table" then
      for k, v in pairs(mod) do
        if rawequal(v, fn) and type(k) == "string" then
          local name = modname == "_G" and k or modname .. "." .. k
          if not best or #name < #best then best = name end
        end
      end
    end
  end
  return best or "?"
end

--- luaL_argerror: argument numbers skip self in method calls.
local function arg_error(arg, msg)
  local f = api_frame()
  if not f then raise("bad argument #%d (%s)", arg, msg) end
  if f.namewhat == "method" then
    arg = arg - 1
    if arg == 0 then raise("calling '%s' on bad self (%s)", f.name, msg) end
  end
  raise("bad argument #%d to '%s' (%s)", arg, f.name or global_name(f.func), msg)
end
M.arg_error = arg_error

-- ---------------------------------------------------------------- classes

local CLASS_NAME = { tensor = "moonshard.Tensor", mesh = "moonshard.Mesh", group = "moonshard.Group",
  unit = "moonshard.Unit" }
M.CLASS_NAME = CLASS_NAME

--- A value's type as luaL_typeerror names it: the class of a moonshard object.
local function typename(v)
  local class = R.classof(v)
  return class and CLASS_NAME[class] or type(v)
end
M.typename = typename

local function type_error(arg, expected, v)
  arg_error(arg, expected .. " expected, got " .. typename(v))
end
M.type_error = type_error

local state, CLASS_CODE = R.state, {}
for class in pairs(CLASS_NAME) do CLASS_CODE[class] = R.const["CLASS_" .. class:upper()] end

--- checker(class) -> check(v, arg): v when it is a live object of the class, else the
-- error naming argument arg (another value) or the release.
function M.checker(class)
  local code, name = CLASS_CODE[class], CLASS_NAME[class]
  return function(v, arg)
    local live = state(v, code)
    if live then return v end
    if live == nil then type_error(arg, name, v) end
    raise("moonshard state error: attempt to use a released %s", class)
  end
end

--- define(class, methods, tostring_live): the class's methods, with release() (the handle
-- now, once; the collector does it otherwise), and its format for live objects.
function M.define(class, methods, tostring_live)
  methods.release = function(self)
    if R.classof(self) ~= class then type_error(1, CLASS_NAME[class], self) end
    R.release(self)
  end
  R.define(class, methods, tostring_live)
end

-- ---------------------------------------------------------------- numbers and strings

local floor, raw_to_integer = math.floor, R.to_integer

--- lua_tointegerx: an integral number in int64 range (numbers here; numeric strings and
-- int64 cdata by the binding), else nil.
local function to_integer(v)
  if type(v) == "number" then
    if v == floor(v) and v >= -2 ^ 63 and v < 2 ^ 63 then return v end
    return nil
  end
  return raw_to_integer(v)
end
M.to_integer = to_integer

--- luaL_checkinteger
local function check_integer(v, arg)
  local i = to_integer(v)
  if i then return i end
  if tonumber(v) then arg_error(arg, "number has no integer representation") end
  type_error(arg, "number", v)
end
M.check_integer = check_integer

--- luaL_checknumber
local function check_number(v, arg)
  local n = tonumber(v)
  if n then return n end
  type_error(arg, "number", v)
end
M.check_number = check_number

local INT_MIN, INT_MAX = -2 ^ 31, 2 ^ 31 - 1

--- An integer argument the core takes as a C int (a dim, a root): a value outside int's
-- range is refused by name instead of being cut down to another, valid-looking one.
local function check_int(v, arg, what)
  local i = check_integer(v, arg)
  if i < INT_MIN or i > INT_MAX then raise("moonshard invalid_argument error: %s %d is out of range", what, i) end
  return tonumber(i)
end
M.check_int = check_int

function M.opt_int(v, arg, what, def)
  if v == nil then return def end
  return check_int(v, arg, what)
end

--- luaL_checkstring
local function check_string(v, arg)
  local t = type(v)
  if t == "string" then return v end
  if t == "number" then return tostring(v) end
  type_error(arg, "string", v)
end
M.check_string = check_string

function M.check_table(v, arg)
  if type(v) ~= "table" then type_error(arg, "table", v) end
  return v
end

--- A Lua sequence of integers (a shape, a list of sizes), checked and copied.
function M.int_list(list, arg, what)
  M.check_table(list, arg)
  local n = #list
  if n > R.MAX_DIMS then
    raise("moonshard invalid_argument error: %s has %d entries, at most %d allowed", what, n, R.MAX_DIMS)
  end
  local out = {}
  for i = 1, n do
    local iv = to_integer(list[i])
    if not iv then
      raise("moonshard invalid_argument error: %s[%d] is %s, expected an integer", what, i, typename(list[i]))
    end
    out[i] = iv
  end
  return out
end

--- An optional dtype name -> the core's code (def when nil).
function M.opt_dtype(v, arg, def)
  if v == nil then return def end
  return M.ok(R.dtype_code(check_string(v, arg)))
end

-- ---------------------------------------------------------------- AdamW options

-- Field `name` of an options table: a number (required, or def when absent).
local function field_number(o, fn, name, required, def)
  local v = o[name]
  local n = tonumber(v)
  if n then return n end
  if v == nil and not required then return def end
  raise("moonshard invalid_argument error: %s: field '%s' is %s; expected a number", fn, name, M.typename(v))
end

local ADAMW_FIELDS = { lr = true, betas = true, eps = true, weight_decay = true, step = true }
local DEFAULT_B1, DEFAULT_B2, DEFAULT_EPS, DEFAULT_WD = R.adamw_defaults() -- torch's, from the core

--- adamw_options({lr=, betas={b1, b2}, eps=, weight_decay=, step=}, fn) -> lr, beta1, beta2,
-- eps, weight_decay, step (torch's defaults for what is left out; lr and step required), for
-- the adamw_step of units and Megatron-FSDP buckets (argument 2 of the method fn)
function M.adamw_options(o, fn)
  M.check_table(o, 2)
  -- a misspelt key would silently leave its default in place
  for k in pairs(o) do
    if not ADAMW_FIELDS[k] then
      raise("moonshard invalid_argument error: %s: unknown field '%s'; expected lr, betas, eps, weight_decay and step",
        fn, type(k) == "string" and k or M.typename(k))
    end
  end
  local lr = field_number(o, fn, "lr", true)
  local eps = field_number(o, fn, "eps", false, DEFAULT_EPS)
  local wd = field_number(o, fn, "weight_decay", false, DEFAULT_WD)
  local step = M.to_integer(o.step)
  if not step then
    raise("moonshard invalid_argument error: %s: field 'step' is %s; expected an integer (the step count, from 1)", fn,
      tonumber(o.step) and "not an integer" or M.typename(o.step))
  end
  local b1, b2 = DEFAULT_B1, DEFAULT_B2
  if o.betas ~= nil then
    if type(o.betas) ~= "table" then
      raise("moonshard invalid_argument error: %s: field 'betas' is %s; expected {beta1, beta2}", fn, M.typename(o.betas))
    end
    b1, b2 = tonumber(o.betas[1]), tonumber(o.betas[2])
    if not (b1 and b2) then raise("moonshard invalid_argument error: %s: field 'betas' must be two numbers {beta1, beta2}", fn) end
  end
  return lr, b1, b2, eps, wd, step
end

return M
