-- moonshard.core_ffi: the LuaJIT binding of libmoonshard, through the FFI.
--
-- The same module table as the Lua 5.4 C binding (lua/ms_lua*.c, `moonshard.core`): the
-- same functions and methods, the same results and the same error messages, so that
-- `require "moonshard"` (init.lua picks this file under LuaJIT) behaves alike in both.
-- Tensors, meshes, groups and units are small FFI boxes around the core's handles: the
-- garbage collector releases them (the boxes' __gc), :release() does it at once, and a
-- released box refuses further use.  Sizes are int64 in the core: a result is a Lua number
-- when it is exact as one (|v| <= 2^53) and an int64_t cdata otherwise; arguments accept
-- numbers and int64 cdata alike.
--
-- The declarations come from moonshard/cdef.lua, generated at build time from
-- moonshard.h.  The library: ffi.C when this process has the ms_* symbols already (the
-- moonshard-jit executable and hosts that link libmoonshard), else $MOONSHARD_LIB, else a
-- libmoonshard.so beside the cdef.lua found on package.path (the build tree, or an install
-- prefix's lib, lib64 or multiarch lib dir), else ffi.load("moonshard").
--
-- The world: the rank's ms_comm * is a light userdata at registry["moonshard.world"], set
-- by the executable before the script runs; without one this Lua state is rank 0 of a
-- one-rank threads world, made on first use and kept for the state's life.
--
-- Loaded once per Lua state (kept in the registry): FFI declarations and metatypes
-- cannot be made twice, and busted reloads modules for every spec file.

local REGISTRY = debug.getregistry()
local CACHE_KEY = "moonshard.core_ffi"
if REGISTRY[CACHE_KEY] then return REGISTRY[CACHE_KEY] end

local ffi = require "ffi"

local format, floor, istype = string.format, math.floor, ffi.istype
local WORLD_KEY = "moonshard.world" -- light userdata: ms_comm * of this rank
local EXACT = 2 ^ 53                -- the largest magnitude a number holds exactly
local TWO63 = 2 ^ 63

-- ---------------------------------------------------------------- declarations and library

if not pcall(ffi.typeof, "ms_tensor") then ffi.cdef(require "moonshard.cdef") end
ffi.cdef [[
typedef struct ms_ffi_tensor { ms_tensor *h; } ms_ffi_tensor;
typedef struct ms_ffi_mesh { ms_mesh *h; } ms_ffi_mesh;
typedef struct ms_ffi_group { ms_comm *h; } ms_ffi_group;
typedef struct ms_ffi_unit { ms_unit *h; } ms_ffi_unit;
]]

local MULTIARCH = { x64 = "x86_64-linux-gnu", arm64 = "aarch64-linux-gnu", x86 = "i386-linux-gnu",
  ppc64le = "powerpc64le-linux-gnu" }

-- Where libmoonshard may lie relative to the cdef.lua that package.path finds.
local function library_candidates()
  local cdef = package.searchpath("moonshard.cdef", package.path)
  if not cdef then return {} end
  local dirs = {}
  local prefix = cdef:match("^(.*)/share/lua/[^/]+/moonshard/cdef%.lua$")
  if prefix then -- an install: PREFIX/share/lua/5.x/moonshard/cdef.lua
    dirs = { prefix .. "/lib", prefix .. "/lib64" }
    if MULTIARCH[jit.arch] then dirs[3] = prefix .. "/lib/" .. MULTIARCH[jit.arch] end
  else -- the build tree: BUILD/lua/moonshard/cdef.lua beside BUILD/libmoonshard.so
    dirs = { (cdef:match("^(.*)/[^/]+/[^/]+/[^/]+$") or ".") }
  end
  local paths = {}
  for _, d in ipairs(dirs) do
    paths[#paths + 1] = d .. "/libmoonshard.so"
    paths[#paths + 1] = d .. "/libmoonshard.so.0"
  end
  return paths
end

local function readable(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

local function load_library()
  if pcall(function() return ffi.C.ms_version end) then return ffi.C end
  local env = os.getenv("MOONSHARD_LIB")
  if env and env ~= "" then
    local ok, lib = pcall(ffi.load, env)
    if ok then return lib end
    error("moonshard: cannot load MOONSHARD_LIB=" .. env .. ": " .. tostring(lib), 0)
  end
  local tried = { "ffi.C (no ms_* symbols in this process)", "$MOONSHARD_LIB (not set)" }
  for _, path in ipairs(library_candidates()) do
    if readable(path) then return ffi.load(path) end
    tried[#tried + 1] = path
  end
  local ok, lib = pcall(ffi.load, "moonshard")
  if ok then return lib end
  tried[#tried + 1] = "ffi.load(\"moonshard\") (" .. tostring(lib) .. ")"
  error("moonshard: cannot find libmoonshard; looked in " .. table.concat(tried, ", ") ..
    "; set MOONSHARD_LIB to its path", 0)
end

local C = load_library()

local MAX_DIMS = C.MS_MAX_DIMS
local F32, F64, I64 = C.MS_F32, C.MS_F64, C.MS_I64
local CPU, META = C.MS_DEVICE_CPU, C.MS_DEVICE_META

local Tensor = ffi.typeof("ms_ffi_tensor")
local Mesh = ffi.typeof("ms_ffi_mesh")
local Group = ffi.typeof("ms_ffi_group")
local Unit = ffi.typeof("ms_ffi_unit")
local Int64s = ffi.typeof("int64_t[?]")
local Ints = ffi.typeof("int[?]")
local f64_ptr, i64_ptr = ffi.typeof("double *"), ffi.typeof("int64_t *")
local uint_ptr = { [1] = ffi.typeof("uint8_t *"), [2] = ffi.typeof("uint16_t *"), [4] = ffi.typeof("uint32_t *"),
  [8] = i64_ptr }

-- Scratch arrays for arguments and results (one Lua state runs one call at a time).
local shape_a, shape_b, shape_c, shape_d, shape_e = Int64s(MAX_DIMS), Int64s(MAX_DIMS), Int64s(MAX_DIMS),
    Int64s(MAX_DIMS), Int64s(MAX_DIMS)
local ints_a, ints_b = Ints(MAX_DIMS), Ints(MAX_DIMS)
local names_a = ffi.new("const char *[?]", MAX_DIMS)
local tensor_out, mesh_out, comm_out = ffi.new("ms_tensor *[1]"), ffi.new("ms_mesh *[1]"), ffi.new("ms_comm *[1]")
local unit_out, world_out = ffi.new("ms_unit *[1]"), ffi.new("ms_world *[1]")
local int64_out, int64_out2, double_out = Int64s(1), Int64s(1), ffi.new("double[1]")
local dtype_out, op_out = ffi.new("ms_dtype[1]"), ffi.new("ms_op[1]")
local device_out, int_out, int_out2 = ffi.new("ms_device_type[1]"), Ints(1), Ints(1)

local new_table = (function()
  local ok, tnew = pcall(require, "table.new")
  return ok and tnew or function() return {} end
end)()

-- Enum results come back as cdata: numbers for table keys and plain comparisons.
local function dtype_of(t) return tonumber(C.ms_tensor_dtype(t)) end
local function device_of(t) return tonumber(C.ms_tensor_device(t)) end

local DTYPE_NAME = {}
for d = 0, C.MS_DTYPE_COUNT - 1 do DTYPE_NAME[d] = ffi.string(C.ms_dtype_name(d)) end

-- ---------------------------------------------------------------- errors

local SOURCE = debug.getinfo(1, "S").source

-- The binding function running now (the outermost frame of this file) and luaL_where of
-- its caller: "chunk:line: " when the caller is Lua code, else "" (as the C binding's
-- luaL_error gives it).
local function binding_frame()
  local level, binding = 2, nil
  while true do
    local info = debug.getinfo(level, "Snlf")
    if not info then return binding, "" end
    if info.source ~= SOURCE then
      return binding, info.currentline > 0 and format("%s:%d: ", info.short_src, info.currentline) or ""
    end
    binding, level = info, level + 1
  end
end

-- luaL_error
local function raise(fmt, ...)
  local _, where = binding_frame()
  error(where .. format(fmt, ...), 0)
end

-- A failed core call: "moonshard <status> error: <message>", as ms_lua_fail raises it.
local function fail(st)
  raise("moonshard %s error: %s", ffi.string(C.ms_status_name(st)), ffi.string(C.ms_last_error()))
end

local function check(st)
  if st ~= 0 then fail(st) end
end

-- The name luaL_argerror gives a function called without one: "module.field" of a loaded
-- module (the shortest, so the public module's name before the binding's).
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

-- luaL_argerror: argument numbers skip self in method calls.
local function arg_error(arg, msg)
  local f = binding_frame()
  if not f then raise("bad argument #%d (%s)", arg, msg) end
  if f.namewhat == "method" then
    arg = arg - 1
    if arg == 0 then raise("calling '%s' on bad self (%s)", f.name, msg) end
  end
  raise("bad argument #%d to '%s' (%s)", arg, f.name or global_name(f.func), msg)
end

local CLASSES = {} -- {ctype, "moonshard.Tensor"} pairs, filled by class() below

-- A value's type as luaL_typeerror names it: the class of a moonshard object.
local function typename(v)
  if type(v) == "cdata" then
    for _, c in ipairs(CLASSES) do
      if istype(c[1], v) then return c[2] end
    end
  end
  return type(v)
end

local function type_error(arg, expected, v)
  arg_error(arg, expected .. " expected, got " .. typename(v))
end

-- ---------------------------------------------------------------- argument helpers

local int64_t, uint64_t = ffi.typeof("int64_t"), ffi.typeof("uint64_t")
local function is_int64_cdata(v) return istype(int64_t, v) or istype(uint64_t, v) end

-- a number with an integral value in int64 range
local function is_int64(n) return n == floor(n) and n >= -TWO63 and n < TWO63 end

-- An integral number in int64 range, a numeric string or an int64 cdata (lua_tointegerx).
local function to_integer(v)
  local t = type(v)
  if t == "cdata" then
    if is_int64_cdata(v) then return v end
    v = tonumber(v)
  elseif t == "string" then
    v = tonumber(v)
  elseif t ~= "number" then
    return nil
  end
  if v and is_int64(v) then return v end
  return nil
end

-- luaL_checkinteger
local function check_integer(v, arg)
  local i = to_integer(v)
  if i then return i end
  if tonumber(v) then arg_error(arg, "number has no integer representation") end
  type_error(arg, "number", v)
end

-- luaL_checknumber
local function check_number(v, arg)
  local n = tonumber(v)
  if n then return n end
  type_error(arg, "number", v)
end

-- luaL_opt: check(v, arg) unless v is nil, then def
local function optional(check_value)
  return function(v, arg, def)
    if v == nil then return def end
    return check_value(v, arg)
  end
end
local opt_integer, opt_number = optional(check_integer), optional(check_number)

local INT_MIN, INT_MAX = -2 ^ 31, 2 ^ 31 - 1

-- An integer argument the core takes as a C int (a dim, a root): a value outside int's range
-- is refused by name instead of being cut down to another, valid-looking one.
local function check_int(v, arg, what)
  local i = check_integer(v, arg)
  if i < INT_MIN or i > INT_MAX then raise("moonshard invalid_argument error: %s %d is out of range", what, i) end
  return tonumber(i)
end

local function opt_int(v, arg, what, def)
  if v == nil then return def end
  return check_int(v, arg, what)
end

-- luaL_checkstring
local function check_string(v, arg)
  local t = type(v)
  if t == "string" then return v end
  if t == "number" then return tostring(v) end
  type_error(arg, "string", v)
end

local function check_table(v, arg)
  if type(v) ~= "table" then type_error(arg, "table", v) end
  return v
end

-- An int64 result: a number when exact, else the int64_t cdata.
local function num(v)
  if v >= -EXACT and v <= EXACT then return tonumber(v) end
  return v
end

-- A Lua sequence of integers (a shape, a list of sizes) into buf; returns its length.
local function check_int_list(list, arg, what, buf)
  check_table(list, arg)
  local n = #list
  if n > MAX_DIMS then raise("moonshard invalid_argument error: %s has %d entries, at most %d allowed", what, n, MAX_DIMS) end
  for i = 1, n do
    local v = list[i]
    local iv = to_integer(v)
    if not iv then raise("moonshard invalid_argument error: %s[%d] is %s, expected an integer", what, i, type(v)) end
    buf[i - 1] = iv
  end
  return n
end

-- The first n entries of an int64 buffer as a Lua list.
local function int_list(buf, n)
  local t = new_table(n, 0)
  for i = 0, n - 1 do t[i + 1] = num(buf[i]) end
  return t
end

local function opt_dtype(v, arg, def)
  if v == nil then return def end
  check(C.ms_dtype_parse(check_string(v, arg), dtype_out))
  return tonumber(dtype_out[0])
end

local function opt_op(v, arg)
  if v == nil then return C.MS_OP_SUM end
  check(C.ms_op_parse(check_string(v, arg), op_out))
  return tonumber(op_out[0])
end

-- ---------------------------------------------------------------- boxes

-- A class of boxes: methods (plus release), __gc releasing the handle once, __tostring,
-- and check(v, arg) -> the live handle of a box in argument arg.
local function class(ctype, name, what, release_handle, methods, tostring_live)
  local function check_box(v, arg)
    if not istype(ctype, v) then type_error(arg, name, v) end
    local h = v.h
    if h == nil then raise("moonshard state error: attempt to use a released %s", what) end
    return h
  end
  local function release(self)
    if not istype(ctype, self) then type_error(1, name, self) end
    local h = self.h
    if h ~= nil then
      self.h = nil
      release_handle(h)
    end
  end
  methods.release = release
  ffi.metatype(ctype, {
    __index = function(_, k) return methods[k] end,
    __gc = release,
    __tostring = function(self)
      if self.h == nil then return what .. " (released)" end
      return tostring_live(self.h)
    end,
    __name = name,
  })
  CLASSES[#CLASSES + 1] = { ctype, name }
  return check_box
end

local tensor_methods, mesh_methods, group_methods, unit_methods = {}, {}, {}, {}
local check_tensor, check_mesh, check_group, check_unit -- set by class() below

-- ---------------------------------------------------------------- the module

local M = {}

-- ---------------------------------------------------------------- world

local world_lud, world_comm -- the registry's light userdata and its cast
local own_world, own_comm   -- the one-rank world of a state without a launcher

local function get_world()
  local lud = REGISTRY[WORLD_KEY]
  if lud ~= nil then
    if lud ~= world_lud then world_lud, world_comm = lud, ffi.cast("ms_comm *", lud) end
    return world_comm
  end
  if own_comm == nil then -- no launcher: this Lua state is rank 0 of 1
    check(C.ms_threads_world_new(world_out, 1, 0))
    own_world = ffi.gc(world_out[0], C.ms_world_release)
    check(C.ms_world_comm(own_world, 0, comm_out))
    own_comm = ffi.gc(comm_out[0], C.ms_comm_release)
  end
  return own_comm
end

function M.rank() return C.ms_comm_rank(get_world()) end

function M.world_size() return C.ms_comm_size(get_world()) end

function M.backend() return ffi.string(C.ms_comm_backend(get_world())) end

-- memory_cap(bytes | nil) -> false: LuaJIT (GC64) takes no allocator of the host's, so
-- there is no hard memory cap to set (the Lua 5.4 binding's sets one); memory_refused()
-- -> false likewise.
function M.memory_cap() return false end
function M.memory_refused() return false end

-- device() -> where this rank's tensors go: "cuda:N" (its GPU) on the nccl backend, else "cpu"
local device_type, device_index = ffi.new("ms_device_type[1]"), ffi.new("int[1]")
function M.device()
  check(C.ms_comm_device(get_world(), device_type, device_index))
  if device_type[0] == C.MS_DEVICE_CUDA then return "cuda:" .. device_index[0] end
  return "cpu"
end

-- ---------------------------------------------------------------- tensors

-- The tensor a core call made into tensor_out, boxed.
local function made_tensor(st)
  check(st)
  return Tensor(tensor_out[0])
end

function M.tensor(shape, dtype, device)
  local nd = check_int_list(shape, 1, "shape", shape_a)
  local dt = opt_dtype(dtype, 2, F32)
  local dev, idx = CPU, 0
  if device ~= nil then
    check(C.ms_device_parse(check_string(device, 3), device_out, int_out))
    dev, idx = device_out[0], int_out[0]
  end
  return made_tensor(C.ms_tensor_new(tensor_out, nd, shape_a, dt, dev, idx))
end

-- The integers an integer dtype holds: {lo, hi} as numbers (exact) and as int64 cdata.
local INT_RANGE = {}
do
  local lo64 = int64_t(-TWO63)
  INT_RANGE[tonumber(C.MS_I64)] = { -TWO63, TWO63, lo64, -(lo64 + 1) }
  for _, r in ipairs { { C.MS_I32, -2 ^ 31, 2 ^ 31 - 1 }, { C.MS_I8, -128, 127 }, { C.MS_U8, 0, 255 } } do
    INT_RANGE[tonumber(r[1])] = { r[2], r[3], int64_t(r[2]), int64_t(r[3]) }
  end
end
local BOOL = tonumber(C.MS_BOOL)
local INT64_MAX_U = ffi.cast(uint64_t, TWO63) - 1

-- v (a number, an int64 cdata or a boolean) as an element of the integer dtype dt, for
-- from_table and fill_, as int_element in ms_lua_tensor.c: integers exact, floats truncated toward
-- zero, booleans 0 / 1; bool takes any number (nonzero is true).  A value dt cannot hold is
-- an error, as in PyTorch, where a cast (t:to) would saturate.  `what` names the value.
local function int_element(v, dt, what)
  if type(v) == "boolean" then return v and 1 or 0 end
  local cd = type(v) == "cdata" and is_int64_cdata(v)
  local n = cd and v or tonumber(v)
  if dt == BOOL then return n ~= 0 and 1 or 0 end -- NaN is true, as bool(nan) is
  local r = INT_RANGE[dt]
  if cd then
    if not (istype(uint64_t, v) and v > INT64_MAX_U) then
      local iv = ffi.cast(int64_t, v)
      if iv >= r[3] and iv <= r[4] then return iv end
    end
  else
    local t = n >= 0 and floor(n) or -floor(-n) -- NaN fails every comparison below
    if t >= -TWO63 and t < TWO63 and t >= r[1] and t <= r[2] then return t end
  end
  local text = cd and format("%d", v) or n ~= n and "nan" or format("%.14g", n)
  raise("moonshard invalid_argument error: %s%s is out of range for %s (%d to %d)", what, text,
    ffi.string(C.ms_dtype_name(dt)), r[3], r[4])
end

-- The value of values[i] staged for from_table: int64 (exact) for integer dtypes, else f64.
local function stage_value(v, i, dt, as_int)
  local t = type(v)
  if t ~= "boolean" and not (t == "cdata" and is_int64_cdata(v)) and not tonumber(v) then
    raise("moonshard invalid_argument error: from_table: values[%d] is %s, expected a number", i, t)
  end
  if as_int then return int_element(v, dt, format("from_table: values[%d] = ", i)) end
  if t == "boolean" then return v and 1 or 0 end
  return tonumber(v)
end

-- from_table(values, dtype?, shape?): values is a flat sequence of numbers (or booleans).
function M.from_table(values, dtype, shape)
  check_table(values, 1)
  local dt = opt_dtype(dtype, 2, F32)
  local n = #values
  local nd = 1
  shape_a[0] = n
  if shape ~= nil then nd = check_int_list(shape, 3, "shape", shape_a) end
  local t = made_tensor(C.ms_tensor_new(tensor_out, nd, shape_a, dt, CPU, 0))
  local numel = C.ms_tensor_numel(t.h)
  if numel ~= n then
    raise("moonshard shape error: from_table: %d values do not fill a shape of %d elements", n, numel)
  end
  -- Integers travel as int64 so that values above 2^53 stay exact; floats as f64.
  local as_int = C.ms_dtype_is_float(dt) == 0
  local stage_type = as_int and I64 or F64
  local direct = dt == stage_type -- a fresh contiguous tensor: write into it
  local buffer = not direct and (as_int and Int64s(n) or ffi.new("double[?]", n)) or nil -- kept alive here
  local stage = ffi.cast(as_int and i64_ptr or f64_ptr, buffer or C.ms_tensor_data(t.h))
  for i = 1, n do stage[i - 1] = stage_value(values[i], i, dt, as_int) end
  if buffer then check(C.ms_cast(C.ms_tensor_data(t.h), dt, buffer, stage_type, n)) end
  return t
end

-- The sizes or strides of t as a list.
local function dims_list(t, get)
  local nd = C.ms_tensor_ndim(t)
  local out = new_table(nd, 0)
  for i = 0, nd - 1 do out[i + 1] = num(get(t, i)) end
  return out
end

function tensor_methods.shape(self) return dims_list(check_tensor(self, 1), C.ms_tensor_size) end

function tensor_methods.stride(self) return dims_list(check_tensor(self, 1), C.ms_tensor_stride) end

function tensor_methods.dtype(self) return DTYPE_NAME[dtype_of(check_tensor(self, 1))] end

function tensor_methods.numel(self) return num(C.ms_tensor_numel(check_tensor(self, 1))) end

function tensor_methods.nbytes(self) return num(C.ms_tensor_nbytes(check_tensor(self, 1))) end

function tensor_methods.ndim(self) return C.ms_tensor_ndim(check_tensor(self, 1)) end

function tensor_methods.is_contiguous(self) return C.ms_tensor_is_contiguous(check_tensor(self, 1)) ~= 0 end

local function device_name(t)
  local dev = device_of(t)
  if dev == CPU then return "cpu" end
  if dev == META then return "meta" end
  return format("cuda:%d", C.ms_tensor_device_index(t))
end

function tensor_methods.device(self) return device_name(check_tensor(self, 1)) end

-- t:to(dtype) casts; t:to("cpu" | "cuda:N") moves to another device.
function tensor_methods.to(self, dtype)
  local t = check_tensor(self, 1)
  if type(dtype) == "string" and C.ms_device_parse(dtype, device_out, int_out) == C.MS_OK then
    return made_tensor(C.ms_tensor_to_device(tensor_out, t, device_out[0], int_out[0]))
  end
  return made_tensor(C.ms_tensor_to(tensor_out, t, opt_dtype(dtype, 2, dtype_of(t))))
end

function tensor_methods.copy_(self, src)
  check(C.ms_tensor_copy(check_tensor(self, 1), check_tensor(src, 2)))
  return self
end

function tensor_methods.fill_(self, v)
  local t = check_tensor(self, 1)
  if type(v) ~= "boolean" and not (type(v) == "cdata" and is_int64_cdata(v)) then check_number(v, 2) end
  local dt = dtype_of(t)
  if C.ms_dtype_is_float(dt) ~= 0 then
    check(C.ms_tensor_fill(t, type(v) == "boolean" and (v and 1 or 0) or tonumber(v)))
  else
    check(C.ms_tensor_fill_int(t, int_element(v, dt, "fill_: ")))
  end
  return self
end

function tensor_methods.narrow(self, dim, start, len)
  local t = check_tensor(self, 1)
  dim, start, len = check_int(dim, 2, "narrow: dim"), check_integer(start, 3), check_integer(len, 4)
  return made_tensor(C.ms_tensor_narrow(tensor_out, t, dim, start, len))
end

function tensor_methods.view(self, shape)
  local t = check_tensor(self, 1)
  local nd = check_int_list(shape, 2, "shape", shape_a)
  return made_tensor(C.ms_tensor_view(tensor_out, t, nd, shape_a))
end

-- t:chunk(chunks, index, dim?) -- piece `index` (0-based) of torch.chunk
function tensor_methods.chunk(self, chunks, index, dim)
  local t = check_tensor(self, 1)
  chunks, index, dim = check_integer(chunks, 2), check_integer(index, 3), opt_int(dim, 4, "chunk: dim", 0)
  return made_tensor(C.ms_tensor_chunk(tensor_out, t, chunks, index, dim))
end

-- The elements of t as a contiguous buffer of dtype `as`: a pointer of type ptr to t's own
-- data when it already is one, else to a private copy, returned second to be released.
-- A pointer to t's elements in dtype `as` on the host, and the copy holding them if one
-- was made (a cuda tensor comes to the host first).
local function read_as(t, as, ptr)
  if device_of(t) == META then raise("moonshard device error: totable/bits: a meta tensor holds no data") end
  local host
  if device_of(t) ~= CPU then
    host = made_tensor(C.ms_tensor_to_device(tensor_out, t, CPU, 0))
    t = host.h
  end
  if dtype_of(t) == as and C.ms_tensor_is_contiguous(t) ~= 0 then
    return ffi.cast(ptr, C.ms_tensor_data(t)), host
  end
  local copy = made_tensor(C.ms_tensor_to(tensor_out, t, as))
  return ffi.cast(ptr, C.ms_tensor_data(copy.h)), copy
end

local function read_list(t, as, ptr)
  local p, copy = read_as(t, as, ptr)
  local n = tonumber(C.ms_tensor_numel(t))
  local out = new_table(n, 0)
  if ptr == i64_ptr then
    for i = 0, n - 1 do out[i + 1] = num(p[i]) end
  else
    for i = 0, n - 1 do out[i + 1] = p[i] end
  end
  if copy then copy:release() end
  return out
end

-- Flat list of numbers; only i64 tensors may hold integers a number cannot hold exactly.
function tensor_methods.totable(self)
  local t = check_tensor(self, 1)
  if dtype_of(t) == I64 then return read_list(t, I64, i64_ptr) end
  return read_list(t, F64, f64_ptr)
end

-- Flat list of the raw bit patterns (8-byte ones as signed integers, like Lua 5.4's).
function tensor_methods.bits(self)
  local t = check_tensor(self, 1)
  local dt = dtype_of(t)
  return read_list(t, dt, uint_ptr[C.ms_dtype_size(dt)])
end

local function tensor_string(t)
  local sizes = {}
  for i = 0, C.ms_tensor_ndim(t) - 1 do sizes[i + 1] = format("%d", C.ms_tensor_size(t, i)) end
  return format("tensor([%s], %s, %s)", table.concat(sizes, ", "), DTYPE_NAME[dtype_of(t)], device_name(t))
end

check_tensor = class(Tensor, "moonshard.Tensor", "tensor", C.ms_tensor_release, tensor_methods, tensor_string)

-- ---------------------------------------------------------------- meshes

-- ms.mesh({{"dp_replicate", 2}, {"dp_shard", 4}}, {shape_only = true}?)
function M.mesh(axes, opts)
  check_table(axes, 1)
  local n = #axes
  if n < 1 or n > MAX_DIMS then
    raise("moonshard invalid_argument error: mesh: expected 1 to %d axes like {{\"dp_shard\", 4}}, got %d", MAX_DIMS, n)
  end
  local names = {} -- keeps the strings names_a points to alive
  for i = 1, n do
    local axis = axes[i]
    if type(axis) ~= "table" then raise("moonshard invalid_argument error: mesh: axis %d is %s, expected {name, size}", i, type(axis)) end
    local name, size = axis[1], to_integer(axis[2])
    if type(name) ~= "string" or not size then
      raise("moonshard invalid_argument error: mesh: axis %d must be {name, size} with a string and an integer", i)
    end
    names[i], names_a[i - 1], shape_a[i - 1] = name, name, size
  end
  local shape_only = type(opts) == "table" and opts.shape_only
  local world = (shape_only == nil or shape_only == false) and get_world() or nil
  check(C.ms_mesh_new(mesh_out, n, names_a, shape_a, world))
  return Mesh(mesh_out[0])
end

local function axis_names(m)
  local out = {}
  for i = 0, C.ms_mesh_ndim(m) - 1 do out[i + 1] = ffi.string(C.ms_mesh_axis_name(m, i)) end
  return out
end

local function axis_index(m, name, arg)
  name = check_string(name, arg)
  local a = C.ms_mesh_axis_index(m, name)
  if a < 0 then raise("moonshard invalid_argument error: mesh has no axis '%s' (axes: %s)", name, table.concat(axis_names(m), ", ")) end
  return a
end

function mesh_methods.size(self, axis)
  local m = check_mesh(self, 1)
  if axis == nil then return num(C.ms_mesh_size(m)) end
  return num(C.ms_mesh_axis_size(m, axis_index(m, axis, 2)))
end

function mesh_methods.axes(self) return axis_names(check_mesh(self, 1)) end

local function opt_rank(m, rank, arg)
  if rank ~= nil then return check_integer(rank, arg) end
  local r = C.ms_mesh_rank(m)
  if r < 0 then raise("moonshard invalid_argument error: a shape-only mesh has no rank of its own; pass a rank") end
  return r
end

function mesh_methods.rank(self)
  local r = C.ms_mesh_rank(check_mesh(self, 1))
  if r < 0 then return nil end
  return num(r)
end

function mesh_methods.coords(self, rank)
  local m = check_mesh(self, 1)
  check(C.ms_mesh_coords(m, opt_rank(m, rank, 2), shape_a))
  local out = {}
  for i = 0, C.ms_mesh_ndim(m) - 1 do out[ffi.string(C.ms_mesh_axis_name(m, i))] = num(shape_a[i]) end
  return out
end

-- An axis name or a sequence of names -> axis indices in ints_a; returns their count.
-- (item_arg: the stack slot the 5.4 binding names for a bad entry.)
local function check_axes(m, axes, arg, item_arg)
  if type(axes) == "string" then
    ints_a[0] = axis_index(m, axes, arg)
    return 1
  end
  check_table(axes, arg)
  local n, ndim = #axes, C.ms_mesh_ndim(m)
  if n < 1 or n > ndim then raise("moonshard invalid_argument error: mesh group: expected 1 to %d axis names, got %d", ndim, n) end
  for i = 1, n do ints_a[i - 1] = axis_index(m, axes[i], item_arg) end
  return n
end

function mesh_methods.group(self, axes)
  local m = check_mesh(self, 1)
  local n = check_axes(m, axes, 2, 3)
  check(C.ms_mesh_group(m, n, ints_a, comm_out))
  return Group(comm_out[0])
end

-- mesh:group_ranks(axes, rank?) -> the mesh ranks of that group, without communicating
function mesh_methods.group_ranks(self, axes, rank)
  local m = check_mesh(self, 1)
  local n = check_axes(m, axes, 2, rank == nil and 3 or 4)
  local count = 1
  for i = 0, n - 1 do count = count * tonumber(C.ms_mesh_axis_size(m, ints_a[i])) end
  local ranks = Int64s(count)
  check(C.ms_mesh_group_ranks(m, n, ints_a, opt_rank(m, rank, 3), ranks, int64_out))
  return int_list(ranks, tonumber(int64_out[0]))
end

local function mesh_string(m)
  local axes = {}
  for i = 0, C.ms_mesh_ndim(m) - 1 do
    axes[i + 1] = format("%s=%d", ffi.string(C.ms_mesh_axis_name(m, i)), C.ms_mesh_axis_size(m, i))
  end
  return "mesh(" .. table.concat(axes, ", ") .. ")"
end

check_mesh = class(Mesh, "moonshard.Mesh", "mesh", C.ms_mesh_release, mesh_methods, mesh_string)

-- ---------------------------------------------------------------- groups

function group_methods.size(self) return C.ms_comm_size(check_group(self, 1)) end

function group_methods.rank(self) return C.ms_comm_rank(check_group(self, 1)) end

function group_methods.ranks(self)
  local c = check_group(self, 1)
  local out = {}
  for i = 0, C.ms_comm_size(c) - 1 do out[i + 1] = C.ms_comm_world_rank(c, i) end
  return out
end

function group_methods.all_gather(self, out, inp)
  check(C.ms_all_gather(check_group(self, 1), check_tensor(out, 2), check_tensor(inp, 3)))
  return out
end

function group_methods.reduce_scatter(self, out, inp, op)
  check(C.ms_reduce_scatter(check_group(self, 1), check_tensor(out, 2), check_tensor(inp, 3), opt_op(op, 4)))
  return out
end

function group_methods.all_reduce(self, t, op)
  check(C.ms_all_reduce(check_group(self, 1), check_tensor(t, 2), opt_op(op, 3)))
  return t
end

function group_methods.broadcast(self, t, root)
  check(C.ms_broadcast(check_group(self, 1), check_tensor(t, 2), check_int(root, 3, "broadcast: root")))
  return t
end

function group_methods.all_to_all(self, out, inp)
  check(C.ms_all_to_all(check_group(self, 1), check_tensor(out, 2), check_tensor(inp, 3)))
  return out
end

function group_methods.barrier(self)
  check(C.ms_barrier(check_group(self, 1)))
end

local function group_string(c)
  local ranks = {}
  for i = 0, C.ms_comm_size(c) - 1 do ranks[i + 1] = C.ms_comm_world_rank(c, i) end
  return format("group(%s, rank %d of %d, ranks [%s])", ffi.string(C.ms_comm_backend(c)), C.ms_comm_rank(c),
    C.ms_comm_size(c), table.concat(ranks, " "))
end

check_group = class(Group, "moonshard.Group", "group", C.ms_comm_release, group_methods, group_string)

-- ---------------------------------------------------------------- layouts

-- core.local_shape(shape, kinds, dims, mesh_sizes, coords) -- kinds: 0 replicate, 1 shard,
-- 2 partial (ms_placement_kind); the Lua library turns placements into these lists.
function M.local_shape(global_shape, kinds, dims, mesh_shape, coords)
  local nd = check_int_list(global_shape, 1, "global_shape", shape_a)
  local nk = check_int_list(kinds, 2, "placements", shape_b)
  local ndims = check_int_list(dims, 3, "placement dims", shape_c)
  local nm = check_int_list(mesh_shape, 4, "mesh_shape", shape_d)
  local nc = check_int_list(coords, 5, "coords", shape_e)
  if nk ~= nm or ndims ~= nm or nc ~= nm then
    raise("moonshard invalid_argument error: local_shape: %d placements and %d coordinates for a mesh of %d dims " ..
      "(one of each per mesh dim)", nk, nc, nm)
  end
  for i = 0, nm - 1 do
    local kind, dim = shape_b[i], shape_c[i]
    if dim < INT_MIN or dim > INT_MAX then
      raise("moonshard invalid_argument error: local_shape: placement dim %d is out of range", dim)
    end
    ints_a[i], ints_b[i] = (kind >= 0 and kind <= 2) and kind or -1, dim -- the core refuses -1
  end
  check(C.ms_local_shape(nd, shape_a, nm, ints_a, ints_b, shape_d, shape_e, shape_b, shape_c))
  return int_list(shape_b, nd), int_list(shape_c, nd)
end

function M.fsdp_shard(global_shape, world, rank, dim)
  local nd = check_int_list(global_shape, 1, "global_shape", shape_a)
  world, rank, dim = check_integer(world, 2), check_integer(rank, 3), opt_int(dim, 4, "fsdp_shard: dim", 0)
  check(C.ms_fsdp_shard(nd, shape_a, world, rank, dim, shape_b, int64_out, shape_c))
  return int_list(shape_b, nd), num(int64_out[0]), int_list(shape_c, nd)
end

function M.chunk_extent(n, k, r)
  check(C.ms_chunk_extent(check_integer(n, 1), check_integer(k, 2), check_integer(r, 3), int64_out, int64_out2))
  return num(int64_out[0]), num(int64_out2[0])
end

-- ---------------------------------------------------------------- shard units

local function opt_dtype_or_unset(v, arg)
  if v == nil then return -1 end
  return opt_dtype(v, arg, F32)
end

-- core.unit(name, shard_group, replicate_group|nil, param_dtype|nil, reduce_dtype|nil,
--           reshard_after_forward) -- reshard: true, false or an integer k
function M.unit(name, shard, replicate, param_dtype, reduce_dtype, reshard)
  name = check_string(name, 1)
  local shard_c = check_group(shard, 2)
  local replicate_c = replicate ~= nil and check_group(replicate, 3) or nil
  local pd, rd = opt_dtype_or_unset(param_dtype, 4), opt_dtype_or_unset(reduce_dtype, 5)
  -- PyTorch's: true (the default), false or the integer the C API takes
  local raf = C.MS_RESHARD_FULL
  if type(reshard) == "boolean" then
    raf = reshard and C.MS_RESHARD_FULL or C.MS_RESHARD_KEEP
  elseif reshard ~= nil then
    raf = check_int(reshard, 6, "unit: reshard_after_forward")
  end
  check(C.ms_unit_new(unit_out, name, shard_c, replicate_c, pd, rd, raf))
  return Unit(unit_out[0])
end

-- unit:add_param(fqn, shape, dtype, dim?, requires_grad?) -> index (0-based)
function unit_methods.add_param(self, fqn, shape, dtype, dim, requires_grad)
  local u = check_unit(self, 1)
  fqn = check_string(fqn, 2)
  local nd = check_int_list(shape, 3, "shape", shape_a)
  local dt = opt_dtype(dtype, 4, F32)
  dim = opt_int(dim, 5, "add_param: dim", 0)
  local rg = (requires_grad == nil or requires_grad ~= false) and 1 or 0
  check(C.ms_unit_add_param(u, fqn, nd, shape_a, dt, dim, rg))
  return C.ms_unit_param_count(u) - 1
end

local function param_index(u, i, arg)
  i = check_integer(i, arg)
  local count = C.ms_unit_param_count(u)
  if i < 0 or i >= count then
    raise("moonshard invalid_argument error: unit %s has no parameter %d (it has %d, numbered from 0)", ffi.string(C.ms_unit_name(u)),
      i, count)
  end
  return i
end

-- A tensor the unit lends (nil, or NULL with the error set): the Lua object holds its own
-- reference.
local function lent(t)
  if t == nil then
    local msg = C.ms_last_error()
    if msg[0] ~= 0 then raise("moonshard state error: %s", ffi.string(msg)) end
    return nil
  end
  C.ms_tensor_retain(t)
  return Tensor(t)
end

local function unit_tensor_getter(get)
  return function(self, i)
    local u = check_unit(self, 1)
    return lent(get(u, param_index(u, i, 2)))
  end
end
unit_methods.param_shard = unit_tensor_getter(C.ms_unit_param_shard)
unit_methods.grad_shard = unit_tensor_getter(C.ms_unit_grad_shard)
unit_methods.param_full = unit_tensor_getter(C.ms_unit_param_full)
unit_methods.grad_full = unit_tensor_getter(C.ms_unit_grad_full)

-- A method calling the core on the unit alone; returns the unit.
local function unit_action(call)
  return function(self)
    check(call(check_unit(self, 1)))
    return self
  end
end
unit_methods.finalize = unit_action(C.ms_unit_finalize)
unit_methods.unshard = unit_action(C.ms_unit_unshard)
unit_methods.wait = unit_action(C.ms_unit_wait)
unit_methods.reshard = unit_action(C.ms_unit_reshard)
unit_methods.reduce_grads = unit_action(C.ms_unit_reduce_grads)
unit_methods.release_unsharded = unit_action(C.ms_unit_release_unsharded)
unit_methods.zero_grad = unit_action(C.ms_unit_zero_grad)

function unit_methods.load_full(self, i, full)
  local u = check_unit(self, 1)
  check(C.ms_unit_load_full(u, param_index(u, i, 2), check_tensor(full, 3)))
  return self
end

-- unit:param_offset(i) -> offset, rows, dim: this rank's shard of parameter i is rows
-- [offset, offset + rows) of the full parameter's dim `dim` (0-based, like add_param's)
function unit_methods.param_offset(self, i)
  local u = check_unit(self, 1)
  check(C.ms_unit_param_offset(u, param_index(u, i, 2), int_out, int64_out, int64_out2))
  return num(int64_out[0]), num(int64_out2[0]), int_out[0]
end

function unit_methods.set_requires_gradient_sync(self, sync)
  check(C.ms_unit_set_requires_gradient_sync(check_unit(self, 1), (sync ~= nil and sync ~= false) and 1 or 0))
  return self
end

-- unit:set_cpu_offload(offload): FSDP2's CPUOffloadPolicy, before the first add_param
function unit_methods.set_cpu_offload(self, offload)
  check(C.ms_unit_set_cpu_offload(check_unit(self, 1), (offload ~= nil and offload ~= false) and 1 or 0))
  return self
end

function unit_methods.set_gradient_divide_factor(self, factor)
  check(C.ms_unit_set_gradient_divide_factor(check_unit(self, 1), check_number(factor, 2)))
  return self
end

function unit_methods.grad_sq_norm(self)
  check(C.ms_unit_grad_sq_norm(check_unit(self, 1), double_out))
  return double_out[0]
end

function unit_methods.scale_grads(self, scale)
  check(C.ms_unit_scale_grads(check_unit(self, 1), check_number(scale, 2)))
  return self
end

-- Field `name` of an options table: a number (required, or def when absent), as
-- opt_field_number in ms_lua_unit.c.
local function field_number(o, fn, name, required, def)
  local v = o[name]
  local n = tonumber(v)
  if n then return n end
  if v == nil and not required then return def end
  raise("moonshard invalid_argument error: %s: field '%s' is %s; expected a number", fn, name, typename(v))
end

-- unit:adamw_step{lr=, betas={b1, b2}, eps=, weight_decay=, step=}: lr and step required
local ADAMW_FIELDS = { lr = true, betas = true, eps = true, weight_decay = true, step = true }
-- torch's defaults, from the core
local ADAMW_DEFAULTS = (function()
  local d = ffi.new("double[4]")
  check(C.ms_adamw_defaults(d, d + 1, d + 2, d + 3))
  return { beta1 = d[0], beta2 = d[1], eps = d[2], weight_decay = d[3] }
end)()
function unit_methods.adamw_step(self, o)
  local u = check_unit(self, 1)
  check_table(o, 2)
  local fn = "adamw_step"
  -- a misspelt key would silently leave its default in place
  for k in pairs(o) do
    if not ADAMW_FIELDS[k] then
      raise("moonshard invalid_argument error: %s: unknown field '%s'; expected lr, betas, eps, weight_decay and step",
        fn, type(k) == "string" and k or type(k))
    end
  end
  local lr = field_number(o, fn, "lr", true)
  local eps = field_number(o, fn, "eps", false, ADAMW_DEFAULTS.eps)
  local wd = field_number(o, fn, "weight_decay", false, ADAMW_DEFAULTS.weight_decay)
  local step = to_integer(o.step)
  if not step then
    raise("moonshard invalid_argument error: %s: field 'step' is %s; expected an integer (the step count, from 1)", fn,
      tonumber(o.step) and "not an integer" or typename(o.step))
  end
  local b1, b2 = ADAMW_DEFAULTS.beta1, ADAMW_DEFAULTS.beta2
  if o.betas ~= nil then
    if type(o.betas) ~= "table" then
      raise("moonshard invalid_argument error: %s: field 'betas' is %s; expected {beta1, beta2}", fn, typename(o.betas))
    end
    b1, b2 = tonumber(o.betas[1]), tonumber(o.betas[2])
    if not (b1 and b2) then
      raise("moonshard invalid_argument error: %s: field 'betas' must be two numbers {beta1, beta2}", fn)
    end
  end
  check(C.ms_unit_adamw_step(u, lr, b1, b2, eps, wd, step))
  return self
end

-- unit:set_adamw("master" | "torch"): how adamw_step keeps its state (ms_unit_set_adamw)
local ADAMW_MODES = { master = C.MS_ADAMW_MASTER, torch = C.MS_ADAMW_TORCH }
function unit_methods.set_adamw(self, mode)
  local u = check_unit(self, 1)
  local m = ADAMW_MODES[mode]
  if not m then
    raise("moonshard invalid_argument error: set_adamw: mode '%s'; expected 'master' (f32 master weights and " ..
      "moments) or 'torch' (torch.optim.AdamW: state in the stored dtype)", tostring(mode))
  end
  check(C.ms_unit_set_adamw(u, m))
  return self
end

-- unit:adamw_state(i, "exp_avg" | "exp_avg_sq" | "master") -> tensor or nil (ms_unit_adamw_state)
local ADAMW_STATE = { exp_avg = C.MS_ADAMW_EXP_AVG, exp_avg_sq = C.MS_ADAMW_EXP_AVG_SQ,
  master = C.MS_ADAMW_MASTER_WEIGHTS }
function unit_methods.adamw_state(self, i, which)
  local u = check_unit(self, 1)
  local index = param_index(u, i, 2)
  local w = ADAMW_STATE[check_string(which, 3)]
  if not w then
    raise("moonshard invalid_argument error: adamw_state: '%s'; expected 'exp_avg', 'exp_avg_sq' or 'master'",
      which)
  end
  return lent(C.ms_unit_adamw_state(u, index, w))
end

-- unit:adamw_skipped(i) -> the adamw_step calls parameter i had no gradient in
function unit_methods.adamw_skipped(self, i)
  local u = check_unit(self, 1)
  return tonumber(C.ms_unit_adamw_skipped(u, param_index(u, i, 2)))
end

-- unit:set_adamw_skipped(i, k)
function unit_methods.set_adamw_skipped(self, i, k)
  local u = check_unit(self, 1)
  check(C.ms_unit_set_adamw_skipped(u, param_index(u, i, 2), check_integer(k, 3)))
  return self
end

local BYTE_CATEGORIES = { "params", "grads", "optimizer", "unsharded", "cached" }

-- unit:bytes() -> {params=, grads=, optimizer=, unsharded=, cached=}
function unit_methods.bytes(self)
  local u = check_unit(self, 1)
  local out = {}
  for c, name in ipairs(BYTE_CATEGORIES) do out[name] = num(C.ms_unit_bytes(u, c - 1)) end
  return out
end

-- unit:rank_allocated() -> {params=, grads=, optimizer=, unsharded=}: the memory allocated
-- for every unit of the rank, counted at the allocator (ms_unit_rank_allocated)
function unit_methods.rank_allocated(self)
  local u = check_unit(self, 1)
  local out = {}
  for c = 1, 4 do out[BYTE_CATEGORIES[c]] = num(C.ms_unit_rank_allocated(u, c - 1)) end
  return out
end

local RECORD_KINDS = { [0] = "all_gather", "reduce_scatter", "all_reduce" }

-- unit:records() -> list of {kind=, dtype=, group_size=, bytes=}
function unit_methods.records(self)
  local u = check_unit(self, 1)
  local n = C.ms_unit_record_count(u)
  local out = new_table(n, 0)
  for i = 0, n - 1 do
    check(C.ms_unit_record(u, i, int_out, dtype_out, int_out2, int64_out))
    out[i + 1] = { kind = RECORD_KINDS[int_out[0]] or "?", dtype = DTYPE_NAME[tonumber(dtype_out[0])],
      group_size = int_out2[0], bytes = num(int64_out[0]) }
  end
  return out
end

function unit_methods.clear_records(self) C.ms_unit_clear_records(check_unit(self, 1)) end

function unit_methods.count(self) return C.ms_unit_param_count(check_unit(self, 1)) end

function unit_methods.name(self) return ffi.string(C.ms_unit_name(check_unit(self, 1))) end

function unit_methods.fqn(self, i)
  local u = check_unit(self, 1)
  return ffi.string(C.ms_unit_param_fqn(u, param_index(u, i, 2)))
end

local function unit_string(u)
  return format("unit(%s, %d params)", ffi.string(C.ms_unit_name(u)), C.ms_unit_param_count(u))
end

check_unit = class(Unit, "moonshard.Unit", "unit", C.ms_unit_release, unit_methods, unit_string)

-- ---------------------------------------------------------------- misc

function M.dtype_size(dtype) return C.ms_dtype_size(opt_dtype(dtype, 1, F32)) end

-- cuda_device_count() -> n, and when n is 0 the reason (not built, no driver, no device)
function M.cuda_device_count()
  if C.ms_cuda_device_count(int_out) == C.MS_OK then return tonumber(int_out[0]) end
  return 0, ffi.string(C.ms_last_error())
end

local file_kind_out = ffi.new("ms_file_kind[1]")

-- file_stat(path) -> kind, size: what path names without opening it ("regular file",
-- "directory", "FIFO (named pipe)", "character device", ...) and a regular file's size; nil
-- and "<path>: <reason>" when it cannot be stat'ed, as io.open reports a failure.
function M.file_stat(path)
  path = check_string(path, 1)
  if path:find("\0", 1, true) then return nil, path:match("^[^%z]*") .. ": the path holds a NUL byte" end
  if C.ms_file_stat(path, file_kind_out, int64_out) ~= C.MS_OK then return nil, ffi.string(C.ms_last_error()) end
  return ffi.string(C.ms_file_kind_name(file_kind_out[0])), tonumber(int64_out[0])
end

local CAST_IMPLS = { auto = C.MS_CAST_AUTO, portable = C.MS_CAST_PORTABLE, avx2 = C.MS_CAST_AVX2 }

function M.cast_impl(name)
  if name ~= nil then
    name = check_string(name, 1)
    local impl = CAST_IMPLS[name]
    if not impl then raise("moonshard invalid_argument error: cast_impl: '%s' is not auto, portable or avx2", name) end
    check(C.ms_cast_set_impl(impl))
  end
  return C.ms_cast_get_impl() == C.MS_CAST_AVX2 and "avx2" or "portable"
end

M.version = ffi.string(C.ms_version())
M.dtypes = {}
for d = 0, C.MS_DTYPE_COUNT - 1 do M.dtypes[d + 1] = DTYPE_NAME[d] end

REGISTRY[CACHE_KEY] = M
return M
