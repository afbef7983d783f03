-- moonshard.core_ffi: the raw layer of libmoonshard under LuaJIT, through the FFI.
--
-- The raw functions moonshard/raw.lua lists (the C binding, lua/ms_lua*.c, gives the same
-- under Lua 5.4); the API's checks, defaults and messages are in moonshard.args, .tensor,
-- .mesh and .unit.  Values go across as they come; a failed core call returns nil and
-- "moonshard <status> error: <message>".  A value that is no live box of the class a
-- function takes is refused with a plain error (this module may be required directly).
-- Tensors, meshes, groups and units are FFI boxes {h} around the core's handles: define()
-- sets a class's metatype (methods, __tostring, a __gc releasing the handle once); a box
-- made before that carries its own finalizer (ffi.gc), since a metatype set later gives it
-- methods but no __gc.
--
-- The declarations come from moonshard/cdef.lua, generated at build time from moonshard.h.
-- The library: ffi.C when this process has the ms_* symbols already (moonshard-jit, hosts
-- linking libmoonshard), else $MOONSHARD_LIB, else a libmoonshard.so beside the cdef.lua
-- found on package.path (the build tree, or an install prefix's lib, lib64 or multiarch lib
-- dir), else ffi.load("moonshard").
--
-- The world: the rank's ms_comm * is a light userdata at registry["moonshard.world"], set by
-- the executable; without one this Lua state is rank 0 of a one-rank threads world, made on
-- first use and kept for the state's life.  Loaded once per Lua state (kept in the
-- registry): ffi.cdef and ffi.metatype cannot run twice, and busted reloads modules.

local REGISTRY = debug.getregistry()
local CACHE_KEY = "moonshard.core_ffi"
if REGISTRY[CACHE_KEY] then return REGISTRY[CACHE_KEY] end

local ffi = require "ffi"

local format, floor, istype, tonumber, type = string.format, math.floor, ffi.istype, tonumber, type
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
  local dirs
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
local F64, I64, CPU = C.MS_F64, C.MS_I64, C.MS_DEVICE_CPU

local Int64s, Ints, Doubles = ffi.typeof("int64_t[?]"), ffi.typeof("int[?]"), ffi.typeof("double[?]")
local int64_t, uint64_t = ffi.typeof("int64_t"), ffi.typeof("uint64_t")
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
local int64_out, int64_out2, double_out = Int64s(1), Int64s(1), Doubles(4)
local dtype_out, op_out, file_kind_out = ffi.new("ms_dtype[1]"), ffi.new("ms_op[1]"), ffi.new("ms_file_kind[1]")
local dtype_out2 = ffi.new("ms_dtype[1]")
local device_out, int_out, int_out2 = ffi.new("ms_device_type[1]"), Ints(1), Ints(1)

local new_table = (function()
  local ok, tnew = pcall(require, "table.new")
  return ok and tnew or function() return {} end
end)()

local R = {}

-- ---------------------------------------------------------------- results

-- A failed core call: nil, "moonshard <status> error: <message>".
local function failed(st)
  local msg = ffi.string(C.ms_last_error())
  return nil, format("moonshard %s error: %s", ffi.string(C.ms_status_name(st)), msg)
end

-- A core call's status: true, or the failure.
local function done(st)
  if st ~= 0 then return failed(st) end
  return true
end

-- An int64 result: a number when exact, else the int64_t cdata.
local function num(v)
  if v >= -EXACT and v <= EXACT then return tonumber(v) end
  return v
end

-- A Lua list (at most MAX_DIMS entries) into the scratch array buf; returns its length.
local function fill(buf, list)
  local n = #list
  if n > MAX_DIMS then error(format("moonshard.core_ffi: a list of %d entries, at most %d", n, MAX_DIMS), 3) end
  for i = 1, n do buf[i - 1] = list[i] end
  return n
end

-- The first n entries of an int64 array as a fresh Lua list.
local function list_of(buf, n)
  local out = new_table(n, 0)
  for i = 0, n - 1 do out[i + 1] = num(buf[i]) end
  return out
end

local function string_or_nil(p)
  if p == nil then return nil end
  return ffi.string(p)
end

-- ---------------------------------------------------------------- boxes

local CLASSES = { "tensor", "mesh", "group", "unit" }
local CTYPE = { tensor = ffi.typeof("ms_ffi_tensor"), mesh = ffi.typeof("ms_ffi_mesh"),
  group = ffi.typeof("ms_ffi_group"), unit = ffi.typeof("ms_ffi_unit") }
local NAME = { tensor = "moonshard.Tensor", mesh = "moonshard.Mesh", group = "moonshard.Group",
  unit = "moonshard.Unit" }
local RELEASE_HANDLE = { tensor = C.ms_tensor_release, mesh = C.ms_mesh_release, group = C.ms_comm_release,
  unit = C.ms_unit_release }
local defined = {} -- class -> true once define() set its metatype

-- The class's release of a box: its handle, once (release(), __gc and ffi.gc).
local RELEASE = {}
for _, class in ipairs(CLASSES) do
  local release_handle = RELEASE_HANDLE[class]
  RELEASE[class] = function(b)
    local h = b.h
    if h ~= nil then
      b.h = nil
      release_handle(h)
    end
  end
end

-- A box of the class around a handle the caller owns.
local function box(class, h)
  local b = CTYPE[class](h)
  if not defined[class] then ffi.gc(b, RELEASE[class]) end
  return b
end

local function classof(v)
  if type(v) == "cdata" then
    for i = 1, #CLASSES do
      local class = CLASSES[i]
      if istype(CTYPE[class], v) then return class end
    end
  end
  return nil
end

-- handle(v) -> the live handle of a box of the class, else a plain error at the raw
-- function's caller.
local function handle_of(class)
  local ctype, name = CTYPE[class], NAME[class]
  return function(v)
    if istype(ctype, v) then
      local h = v.h
      if h ~= nil then return h end
      error("moonshard.core_ffi: a released " .. class, 3)
    end
    local c = classof(v)
    error(format("moonshard.core_ffi: %s expected, got %s", name, c and NAME[c] or type(v)), 3)
  end
end
local tensor_h, mesh_h, group_h, unit_h = handle_of("tensor"), handle_of("mesh"), handle_of("group"), handle_of("unit")

-- ---------------------------------------------------------------- primitives

local function is_int64_cdata(v) return istype(int64_t, v) or istype(uint64_t, v) end

--- to_integer(v) -> an integral number in int64 range, a numeric string's, or an int64
-- cdata (lua_tointegerx); nil for anything else
function R.to_integer(v)
  local t = type(v)
  if t == "cdata" then
    if is_int64_cdata(v) then return v end
    v = tonumber(v)
  elseif t == "string" then
    v = tonumber(v)
  elseif t ~= "number" then
    return nil
  end
  if v and v == floor(v) and v >= -TWO63 and v < TWO63 then return v end
  return nil
end

--- is_number(v): a number, a numeric string or a numeric cdata (int64 included)
function R.is_number(v) return tonumber(v) ~= nil end

R.classof = classof

--- state(v, class) -> true for a live box of the class, false for a released one, else nil
function R.state(v, class)
  if not istype(CTYPE[class], v) then return nil end
  return v.h ~= nil
end

function R.release(obj)
  local class = classof(obj)
  if not class then error("moonshard.core_ffi: release: a moonshard object expected, got " .. type(obj), 2) end
  RELEASE[class](obj)
end

--- define(class, methods, tostring_live): the metatype of the class's boxes, once per state
-- (LuaJIT refuses a second one; `methods` must be complete, as its __index is fixed too).
function R.define(class, methods, tostring_live)
  local ctype = CTYPE[class]
  if not ctype then error("moonshard.core_ffi: define: no class " .. tostring(class), 2) end
  if defined[class] then error("moonshard.core_ffi: define: the " .. class .. " class is defined already", 2) end
  if type(methods) ~= "table" or type(tostring_live) ~= "function" then
    error("moonshard.core_ffi: define: expected a table of methods and a function", 2)
  end
  local released = class .. " (released)"
  ffi.metatype(ctype, {
    -- a function, not the table: a key no method has reads nil, as from the C binding's
    -- userdata (LuaJIT raises for a struct member missing from an __index table)
    __index = function(_, k) return methods[k] end,
    __gc = RELEASE[class],
    __tostring = function(b)
      if b.h == nil then return released end
      return tostring_live(b)
    end,
    __name = NAME[class],
  })
  defined[class] = true
end

local INT64_MAX_U = ffi.cast(uint64_t, TWO63) - 1

--- int_element(v, dtype) -> v as an element of the integer dtype (ms_int_element), or nil
-- and the core's reason: booleans 0 / 1, int64 cdata exactly, numbers as floats
function R.int_element(v, dtype)
  local st
  if type(v) == "boolean" then
    st = C.ms_int_element(dtype, 0, v and 1 or 0, 0, int64_out)
  elseif istype(int64_t, v) or (istype(uint64_t, v) and v <= INT64_MAX_U) then
    st = C.ms_int_element(dtype, 0, v, 0, int64_out)
  else
    local f = tonumber(v)
    if f == nil then return nil, type(v) .. " is not a number" end
    st = C.ms_int_element(dtype, 1, 0, f, int64_out)
  end
  if st ~= 0 then return nil, ffi.string(C.ms_last_error()) end
  return num(int64_out[0])
end

-- ---------------------------------------------------------------- misc

local DTYPE_NAME = {}
for d = 0, C.MS_DTYPE_COUNT - 1 do DTYPE_NAME[d] = ffi.string(C.ms_dtype_name(d)) end

R.MAX_DIMS = MAX_DIMS
R.version = ffi.string(C.ms_version())

-- UNIT_*: this binding's own codes for unit_tensor, unit_action, unit_set_flag and
-- unit_set_number; the rest are the core's enums.
local UNIT_CODES = { "PARAM_SHARD", "GRAD_SHARD", "PARAM_FULL", "GRAD_FULL", "FINALIZE", "UNSHARD", "WAIT",
  "RESHARD", "REDUCE_GRADS", "RELEASE_UNSHARDED", "ZERO_GRAD", "SYNC", "CPU_OFFLOAD", "DIVIDE_FACTOR",
  "SCALE_GRADS", "PACKED" }
local K = {
  F32 = C.MS_F32, F64 = F64, I64 = I64, BOOL = C.MS_BOOL, DTYPE_COUNT = C.MS_DTYPE_COUNT,
  DEVICE_CPU = CPU, DEVICE_META = C.MS_DEVICE_META, DEVICE_CUDA = C.MS_DEVICE_CUDA,
  OP_SUM = C.MS_OP_SUM,
  PLACEMENT_REPLICATE = C.MS_PLACE_REPLICATE, PLACEMENT_SHARD = C.MS_PLACE_SHARD,
  PLACEMENT_PARTIAL = C.MS_PLACE_PARTIAL,
  RESHARD_FULL = C.MS_RESHARD_FULL, RESHARD_KEEP = C.MS_RESHARD_KEEP,
  ADAMW_MASTER = C.MS_ADAMW_MASTER, ADAMW_TORCH = C.MS_ADAMW_TORCH, ADAMW_EXP_AVG = C.MS_ADAMW_EXP_AVG,
  ADAMW_EXP_AVG_SQ = C.MS_ADAMW_EXP_AVG_SQ, ADAMW_MASTER_WEIGHTS = C.MS_ADAMW_MASTER_WEIGHTS,
  CAST_AUTO = C.MS_CAST_AUTO, CAST_PORTABLE = C.MS_CAST_PORTABLE, CAST_AVX2 = C.MS_CAST_AVX2,
  P2P_SEND = C.MS_P2P_SEND, P2P_RECV = C.MS_P2P_RECV,
}
for code, name in ipairs(UNIT_CODES) do K["UNIT_" .. name] = code end
for _, class in ipairs(CLASSES) do K["CLASS_" .. class:upper()] = class end -- state()'s codes
R.const = K

function R.dtype_code(name)
  local st = C.ms_dtype_parse(name, dtype_out)
  if st ~= 0 then return failed(st) end
  return tonumber(dtype_out[0])
end

function R.dtype_name(code) return DTYPE_NAME[code] or string_or_nil(C.ms_dtype_name(code)) end

function R.dtype_size(code) return C.ms_dtype_size(code) end

function R.dtype_is_float(code) return C.ms_dtype_is_float(code) ~= 0 end

function R.device_code(name)
  local st = C.ms_device_parse(name, device_out, int_out)
  if st ~= 0 then return failed(st) end
  return tonumber(device_out[0]), int_out[0]
end

function R.op_code(name)
  local st = C.ms_op_parse(name, op_out)
  if st ~= 0 then return failed(st) end
  return tonumber(op_out[0])
end

--- cuda_device_count() -> n, and when n is 0 the reason (not built, no driver, no device)
function R.cuda_device_count()
  if C.ms_cuda_device_count(int_out) == 0 then return int_out[0] end
  return 0, ffi.string(C.ms_last_error())
end

--- file_stat(path) -> kind, size | nil, "<path>: <reason>"
function R.file_stat(path)
  if C.ms_file_stat(path, file_kind_out, int64_out) ~= 0 then return nil, ffi.string(C.ms_last_error()) end
  return ffi.string(C.ms_file_kind_name(file_kind_out[0])), num(int64_out[0])
end

--- file_read_region(path, offset, dtype, src_shape, start, perm|nil, dst) -> bytes read | nil, err
function R.file_read_region(path, offset, dtype, src_shape, start, perm, dst)
  local nd = fill(shape_a, src_shape)
  fill(shape_b, start)
  if perm then fill(shape_c, perm) end
  local st = C.ms_file_read_region(path, offset, dtype, nd, shape_a, shape_b, perm and shape_c or nil, tensor_h(dst),
    int64_out)
  if st ~= 0 then return failed(st) end
  return num(int64_out[0])
end

function R.cast_set_impl(code) return done(C.ms_cast_set_impl(code)) end

function R.cast_get_impl() return tonumber(C.ms_cast_get_impl()) end

function R.adamw_defaults()
  local d = double_out
  local st = C.ms_adamw_defaults(d, d + 1, d + 2, d + 3)
  if st ~= 0 then return failed(st) end
  return d[0], d[1], d[2], d[3]
end

-- LuaJIT here takes no allocator of the host's: no hard memory cap to set.
function R.memory_cap() return false end
function R.memory_refused() return false end

-- ---------------------------------------------------------------- world

local world_lud, world_comm -- the registry's light userdata and its cast
local own_world, own_comm   -- the one-rank world of a state without a launcher

-- This rank's world comm, or nil and the failure to make the one-rank world.
local function world()
  local lud = REGISTRY[WORLD_KEY]
  if lud ~= nil then
    if lud ~= world_lud then world_lud, world_comm = lud, ffi.cast("ms_comm *", lud) end
    return world_comm
  end
  if own_comm == nil then -- no launcher: this Lua state is rank 0 of 1
    local st = C.ms_threads_world_new(world_out, 1, 0)
    if st ~= 0 then return failed(st) end
    local w = ffi.gc(world_out[0], C.ms_world_release)
    st = C.ms_world_comm(w, 0, comm_out)
    if st ~= 0 then return failed(st) end
    own_world, own_comm = w, ffi.gc(comm_out[0], C.ms_comm_release)
  end
  return own_comm
end

-- The world comm for the accessors, which have no failure to return: raised.
local function world_comm_of()
  local c, err = world()
  if c == nil then error(err, 0) end
  return c
end

function R.world_rank() return C.ms_comm_rank(world_comm_of()) end
function R.world_size() return C.ms_comm_size(world_comm_of()) end
function R.world_backend() return ffi.string(C.ms_comm_backend(world_comm_of())) end

function R.world_device()
  local c, err = world()
  if c == nil then return nil, err end
  local st = C.ms_comm_device(c, device_out, int_out)
  if st ~= 0 then return failed(st) end
  return tonumber(device_out[0]), int_out[0]
end

-- ---------------------------------------------------------------- tensors

-- The tensor a core call made into tensor_out, boxed; or the failure.
local function made_tensor(st)
  if st ~= 0 then return failed(st) end
  return box("tensor", tensor_out[0])
end

function R.tensor_new(shape, dtype, device, index)
  local nd = fill(shape_a, shape)
  return made_tensor(C.ms_tensor_new(tensor_out, nd, shape_a, dtype, device, index))
end

--- tensor_write(t, values, as_int): a fresh contiguous cpu tensor of #values elements from
-- values staged as int64 (as_int) or f64, cast into its dtype (written directly when equal)
function R.tensor_write(t, values, as_int)
  local h = tensor_h(t)
  local n = #values
  if C.ms_tensor_numel(h) ~= n or C.ms_tensor_device(h) ~= CPU or C.ms_tensor_is_contiguous(h) == 0 then
    error("moonshard.core_ffi: tensor_write: expected a contiguous cpu tensor of " .. n .. " elements", 2)
  end
  if n == 0 then return true end
  local dt = tonumber(C.ms_tensor_dtype(h))
  local stage_type = as_int and I64 or F64
  local buffer = dt ~= stage_type and (as_int and Int64s(n) or Doubles(n)) or nil -- kept alive here
  local stage = ffi.cast(as_int and i64_ptr or f64_ptr, buffer or C.ms_tensor_data(h))
  for i = 1, n do stage[i - 1] = values[i] end
  if buffer then return done(C.ms_cast(C.ms_tensor_data(h), dt, buffer, stage_type, n)) end
  return true
end

local function dims_list(h, get)
  local nd = C.ms_tensor_ndim(h)
  local out = new_table(nd, 0)
  for i = 0, nd - 1 do out[i + 1] = num(get(h, i)) end
  return out
end

function R.tensor_shape(t) return dims_list(tensor_h(t), C.ms_tensor_size) end
function R.tensor_stride(t) return dims_list(tensor_h(t), C.ms_tensor_stride) end
function R.tensor_dtype(t) return tonumber(C.ms_tensor_dtype(tensor_h(t))) end
function R.tensor_numel(t) return num(C.ms_tensor_numel(tensor_h(t))) end
function R.tensor_nbytes(t) return num(C.ms_tensor_nbytes(tensor_h(t))) end
function R.tensor_ndim(t) return C.ms_tensor_ndim(tensor_h(t)) end
function R.tensor_is_contiguous(t) return C.ms_tensor_is_contiguous(tensor_h(t)) ~= 0 end

function R.tensor_device(t)
  local h = tensor_h(t)
  return tonumber(C.ms_tensor_device(h)), C.ms_tensor_device_index(h)
end

function R.tensor_to(t, dtype) return made_tensor(C.ms_tensor_to(tensor_out, tensor_h(t), dtype)) end

function R.tensor_to_device(t, device, index)
  return made_tensor(C.ms_tensor_to_device(tensor_out, tensor_h(t), device, index))
end

function R.tensor_copy(dst, src) return done(C.ms_tensor_copy(tensor_h(dst), tensor_h(src))) end
function R.tensor_fill(t, x) return done(C.ms_tensor_fill(tensor_h(t), x)) end
function R.tensor_fill_int(t, i) return done(C.ms_tensor_fill_int(tensor_h(t), i)) end

function R.tensor_narrow(t, dim, start, len)
  return made_tensor(C.ms_tensor_narrow(tensor_out, tensor_h(t), dim, start, len))
end

function R.tensor_view(t, shape)
  local h = tensor_h(t)
  local nd = fill(shape_a, shape)
  return made_tensor(C.ms_tensor_view(tensor_out, h, nd, shape_a))
end

function R.tensor_chunk(t, chunks, index, dim)
  return made_tensor(C.ms_tensor_chunk(tensor_out, tensor_h(t), chunks, index, dim))
end

-- The elements of tensor h as a list of dtype `as` read through ptr (int64 ones by num):
-- through a host copy of a device tensor and a contiguous copy in `as`, made and released
-- here when needed.
local function read_list(h, as, ptr)
  local host, copy, st
  if C.ms_tensor_device(h) ~= CPU then
    st = C.ms_tensor_to_device(tensor_out, h, CPU, 0)
    if st ~= 0 then return failed(st) end
    host = tensor_out[0]
    h = host
  end
  if C.ms_tensor_dtype(h) ~= as or C.ms_tensor_is_contiguous(h) == 0 then
    st = C.ms_tensor_to(tensor_out, h, as)
    if st ~= 0 then
      local v, err = failed(st)
      if host then C.ms_tensor_release(host) end
      return v, err
    end
    copy = tensor_out[0]
    h = copy
  end
  local n = tonumber(C.ms_tensor_numel(h))
  local p = ffi.cast(ptr, C.ms_tensor_data(h))
  local out = new_table(n, 0)
  if ptr == i64_ptr then
    for i = 0, n - 1 do out[i + 1] = num(p[i]) end
  else
    for i = 0, n - 1 do out[i + 1] = p[i] end
  end
  if copy then C.ms_tensor_release(copy) end
  if host then C.ms_tensor_release(host) end
  return out
end

--- tensor_read(t) -> f64 values of a float dtype, int64 ones of the others
function R.tensor_read(t)
  local h = tensor_h(t)
  if C.ms_dtype_is_float(C.ms_tensor_dtype(h)) ~= 0 then return read_list(h, F64, f64_ptr) end
  return read_list(h, I64, i64_ptr)
end

--- tensor_bits(t) -> the raw bit patterns (8-byte ones as signed int64)
function R.tensor_bits(t)
  local h = tensor_h(t)
  local dt = tonumber(C.ms_tensor_dtype(h))
  local ptr = uint_ptr[C.ms_dtype_size(dt)]
  if not ptr then error("moonshard.core_ffi: tensor_bits: a tensor of no valid dtype", 2) end
  return read_list(h, dt, ptr)
end

-- ---------------------------------------------------------------- meshes

function R.mesh_new(names, sizes, with_world)
  local n = fill(shape_a, sizes)
  if #names ~= n then error("moonshard.core_ffi: mesh_new: as many names as sizes expected", 2) end
  for i = 1, n do names_a[i - 1] = names[i] end -- the strings stay alive in names
  local w, err = nil, nil
  if with_world then
    w, err = world()
    if w == nil then return nil, err end
  end
  local st = C.ms_mesh_new(mesh_out, n, names_a, shape_a, w)
  if st ~= 0 then return failed(st) end
  return box("mesh", mesh_out[0])
end

function R.mesh_ndim(m) return C.ms_mesh_ndim(mesh_h(m)) end
function R.mesh_axis_name(m, a) return string_or_nil(C.ms_mesh_axis_name(mesh_h(m), a)) end
function R.mesh_axis_size(m, a) return num(C.ms_mesh_axis_size(mesh_h(m), a)) end
function R.mesh_size(m) return num(C.ms_mesh_size(mesh_h(m))) end
function R.mesh_axis_index(m, name) return C.ms_mesh_axis_index(mesh_h(m), name) end
function R.mesh_rank(m) return num(C.ms_mesh_rank(mesh_h(m))) end

function R.mesh_coords(m, rank)
  local h = mesh_h(m)
  local st = C.ms_mesh_coords(h, rank, shape_a)
  if st ~= 0 then return failed(st) end
  return list_of(shape_a, C.ms_mesh_ndim(h))
end

function R.mesh_group(m, axes)
  local h = mesh_h(m)
  local st = C.ms_mesh_group(h, fill(ints_a, axes), ints_a, comm_out)
  if st ~= 0 then return failed(st) end
  return box("group", comm_out[0])
end

function R.mesh_group_ranks(m, axes, rank)
  local h = mesh_h(m)
  local n = fill(ints_a, axes)
  local count = 1
  for i = 0, n - 1 do count = count * tonumber(C.ms_mesh_axis_size(h, ints_a[i])) end
  local ranks = Int64s(count > 0 and count or 1) -- a bad axis: the core refuses it
  local st = C.ms_mesh_group_ranks(h, n, ints_a, rank, ranks, int64_out)
  if st ~= 0 then return failed(st) end
  return list_of(ranks, tonumber(int64_out[0]))
end

-- ---------------------------------------------------------------- groups

function R.group_size(g) return C.ms_comm_size(group_h(g)) end
function R.group_rank(g) return C.ms_comm_rank(group_h(g)) end
function R.group_world_rank(g, i) return C.ms_comm_world_rank(group_h(g), i) end
function R.group_backend(g) return string_or_nil(C.ms_comm_backend(group_h(g))) end

function R.all_gather(g, out, inp) return done(C.ms_all_gather(group_h(g), tensor_h(out), tensor_h(inp))) end

function R.reduce_scatter(g, out, inp, op)
  return done(C.ms_reduce_scatter(group_h(g), tensor_h(out), tensor_h(inp), op))
end

function R.all_reduce(g, t, op) return done(C.ms_all_reduce(group_h(g), tensor_h(t), op)) end
function R.broadcast(g, t, root) return done(C.ms_broadcast(group_h(g), tensor_h(t), root)) end
function R.all_to_all(g, out, inp) return done(C.ms_all_to_all(group_h(g), tensor_h(out), tensor_h(inp))) end
function R.barrier(g) return done(C.ms_barrier(group_h(g))) end
function R.send(g, t, peer, tag) return done(C.ms_send(group_h(g), tensor_h(t), peer, tag)) end
function R.recv(g, t, peer, tag) return done(C.ms_recv(group_h(g), tensor_h(t), peer, tag)) end

local P2POps = ffi.typeof("ms_p2p_op[?]")

--- batch_p2p(g, kinds, tensors, peers, tags): the ops as parallel lists (the tensors stay
-- alive in theirs for the call)
function R.batch_p2p(g, kinds, tensors, peers, tags)
  local h, n = group_h(g), #kinds
  local ops = P2POps(n > 0 and n or 1)
  for i = 1, n do
    local op = ops[i - 1]
    op.op, op.t, op.peer, op.tag = kinds[i], tensor_h(tensors[i]), peers[i], tags[i]
  end
  return done(C.ms_batch_p2p(h, ops, n))
end

-- ---------------------------------------------------------------- layouts

--- local_shape(shape, kinds, dims, mesh_sizes, coords) -> local shape, global offset
-- (kinds: const.PLACEMENT_*, one kind, dim and coordinate per mesh dim)
function R.local_shape(shape, kinds, dims, mesh_sizes, coords)
  local nd, nm = fill(shape_a, shape), fill(shape_d, mesh_sizes)
  if fill(ints_a, kinds) ~= nm or fill(ints_b, dims) ~= nm or fill(shape_e, coords) ~= nm then
    error("moonshard.core_ffi: local_shape: one kind, dim and coordinate per mesh dim expected", 2)
  end
  local st = C.ms_local_shape(nd, shape_a, nm, ints_a, ints_b, shape_d, shape_e, shape_b, shape_c)
  if st ~= 0 then return failed(st) end
  return list_of(shape_b, nd), list_of(shape_c, nd)
end

function R.fsdp_shard(shape, world_size, rank, dim)
  local nd = fill(shape_a, shape)
  local st = C.ms_fsdp_shard(nd, shape_a, world_size, rank, dim, shape_b, int64_out, shape_c)
  if st ~= 0 then return failed(st) end
  return list_of(shape_b, nd), num(int64_out[0]), list_of(shape_c, nd)
end

function R.chunk_extent(n, k, r)
  local st = C.ms_chunk_extent(n, k, r, int64_out, int64_out2)
  if st ~= 0 then return failed(st) end
  return num(int64_out[0]), num(int64_out2[0])
end

-- ---------------------------------------------------------------- units

-- The core functions behind the UNIT_* codes, by kind of call.
local UNIT_TENSOR = { [K.UNIT_PARAM_SHARD] = C.ms_unit_param_shard, [K.UNIT_GRAD_SHARD] = C.ms_unit_grad_shard,
  [K.UNIT_PARAM_FULL] = C.ms_unit_param_full, [K.UNIT_GRAD_FULL] = C.ms_unit_grad_full }
local UNIT_ACTION = { [K.UNIT_FINALIZE] = C.ms_unit_finalize, [K.UNIT_UNSHARD] = C.ms_unit_unshard,
  [K.UNIT_WAIT] = C.ms_unit_wait, [K.UNIT_RESHARD] = C.ms_unit_reshard, [K.UNIT_REDUCE_GRADS] = C.ms_unit_reduce_grads,
  [K.UNIT_RELEASE_UNSHARDED] = C.ms_unit_release_unsharded, [K.UNIT_ZERO_GRAD] = C.ms_unit_zero_grad }
local UNIT_FLAG = { [K.UNIT_SYNC] = C.ms_unit_set_requires_gradient_sync,
  [K.UNIT_CPU_OFFLOAD] = C.ms_unit_set_cpu_offload, [K.UNIT_PACKED] = C.ms_unit_set_packed }
local UNIT_NUMBER = { [K.UNIT_DIVIDE_FACTOR] = C.ms_unit_set_gradient_divide_factor,
  [K.UNIT_SCALE_GRADS] = C.ms_unit_scale_grads }

local function unit_call(calls, code, what)
  local f = calls[code]
  if not f then error(format("moonshard.core_ffi: %s: no such code %s", what, tostring(code)), 3) end
  return f
end

function R.unit_new(name, shard, replicate, param_dtype, reduce_dtype, reshard)
  local s = group_h(shard)
  local r = replicate ~= nil and group_h(replicate) or nil
  local st = C.ms_unit_new(unit_out, name, s, r, param_dtype, reduce_dtype, reshard)
  if st ~= 0 then return failed(st) end
  return box("unit", unit_out[0])
end

function R.unit_add_param(u, fqn, shape, dtype, dim, requires_grad)
  local h = unit_h(u)
  local nd = fill(shape_a, shape)
  return done(C.ms_unit_add_param(h, fqn, nd, shape_a, dtype, dim, requires_grad and 1 or 0))
end

function R.unit_count(u) return C.ms_unit_param_count(unit_h(u)) end
function R.unit_name(u) return string_or_nil(C.ms_unit_name(unit_h(u))) end
function R.unit_fqn(u, i) return string_or_nil(C.ms_unit_param_fqn(unit_h(u), i)) end

-- A tensor the unit lends, boxed with its own reference; false when there is none (NULL,
-- no message), nil and the failure when the call failed (NULL with the message set).
local function lent(t)
  if t == nil then
    local msg = ffi.string(C.ms_last_error())
    if msg == "" then return false end
    return nil, format("moonshard %s error: %s", ffi.string(C.ms_status_name(C.MS_ERR_STATE)), msg)
  end
  C.ms_tensor_retain(t)
  return box("tensor", t)
end

function R.unit_tensor(u, code, i)
  local h = unit_h(u)
  return lent(unit_call(UNIT_TENSOR, code, "unit_tensor")(h, i))
end

function R.unit_adamw_state(u, i, which) return lent(C.ms_unit_adamw_state(unit_h(u), i, which)) end

function R.unit_action(u, code)
  local h = unit_h(u)
  return done(unit_call(UNIT_ACTION, code, "unit_action")(h))
end

function R.unit_load_full(u, i, t) return done(C.ms_unit_load_full(unit_h(u), i, tensor_h(t))) end

--- unit_param_offset(u, i) -> offset, rows, dim
function R.unit_param_offset(u, i)
  local st = C.ms_unit_param_offset(unit_h(u), i, int_out, int64_out, int64_out2)
  if st ~= 0 then return failed(st) end
  return num(int64_out[0]), num(int64_out2[0]), int_out[0]
end

function R.unit_set_param_policy(u, i, param_dtype, reduce_dtype)
  return done(C.ms_unit_set_param_policy(unit_h(u), i, param_dtype, reduce_dtype))
end

--- unit_param_dtypes(u, i) -> stored, gather, reduce (dtype codes), requires_grad
function R.unit_param_dtypes(u, i)
  local h = unit_h(u)
  local st = C.ms_unit_param_info(h, i, int_out, shape_a, dtype_out, dtype_out2, int_out2)
  if st ~= 0 then return failed(st) end
  local stored, gather, rg = tonumber(dtype_out[0]), tonumber(dtype_out2[0]), int_out2[0] ~= 0
  st = C.ms_unit_param_reduce_dtype(h, i, dtype_out)
  if st ~= 0 then return failed(st) end
  return stored, gather, tonumber(dtype_out[0]), rg
end

function R.unit_set_flag(u, code, flag)
  local h = unit_h(u)
  return done(unit_call(UNIT_FLAG, code, "unit_set_flag")(h, flag and 1 or 0))
end

function R.unit_set_number(u, code, x)
  local h = unit_h(u)
  return done(unit_call(UNIT_NUMBER, code, "unit_set_number")(h, x))
end

function R.unit_grad_sq_norm(u)
  local st = C.ms_unit_grad_sq_norm(unit_h(u), double_out)
  if st ~= 0 then return failed(st) end
  return double_out[0]
end

function R.unit_adamw_step(u, lr, b1, b2, eps, wd, step)
  return done(C.ms_unit_adamw_step(unit_h(u), lr, b1, b2, eps, wd, step))
end

function R.unit_set_adamw(u, mode) return done(C.ms_unit_set_adamw(unit_h(u), mode)) end
function R.unit_adamw_skipped(u, i) return num(C.ms_unit_adamw_skipped(unit_h(u), i)) end
function R.unit_set_adamw_skipped(u, i, k) return done(C.ms_unit_set_adamw_skipped(unit_h(u), i, k)) end
function R.unit_bytes(u, category) return num(C.ms_unit_bytes(unit_h(u), category)) end
function R.unit_rank_allocated(u, category) return num(C.ms_unit_rank_allocated(unit_h(u), category)) end
function R.unit_record_count(u) return C.ms_unit_record_count(unit_h(u)) end

--- unit_record(u, i) -> kind, dtype, group_size, bytes
function R.unit_record(u, i)
  local st = C.ms_unit_record(unit_h(u), i, int_out, dtype_out, int_out2, int64_out)
  if st ~= 0 then return failed(st) end
  return int_out[0], tonumber(dtype_out[0]), int_out2[0], num(int64_out[0])
end

function R.unit_clear_records(u) C.ms_unit_clear_records(unit_h(u)) end

-- ---------------------------------------------------------------- Megatron-FSDP buckets

function R.zero_new(name, dp, strategy, dtype, requires_grad, grad_dtype, main_f32)
  local st = C.ms_unit_zero_new(unit_out, name, group_h(dp), strategy, dtype, requires_grad and 1 or 0, grad_dtype,
    main_f32 and 1 or 0)
  if st ~= 0 then return failed(st) end
  return box("unit", unit_out[0])
end

function R.zero_add_param(u, fqn, shape, offset)
  local h = unit_h(u)
  local nd = fill(shape_a, shape)
  return done(C.ms_unit_zero_add_param(h, fqn, nd, shape_a, offset))
end

function R.zero_finalize(u, size) return done(C.ms_unit_zero_finalize(unit_h(u), size)) end
function R.zero_tensor(u, i, which) return lent(C.ms_unit_zero_tensor(unit_h(u), i, which)) end

--- zero_piece(u, i) -> start, stop
function R.zero_piece(u, i)
  local st = C.ms_unit_zero_piece(unit_h(u), i, int64_out, int64_out2)
  if st ~= 0 then return failed(st) end
  return num(int64_out[0]), num(int64_out2[0])
end

function R.zero_load_full(u, i, t) return done(C.ms_unit_zero_load_full(unit_h(u), i, tensor_h(t))) end

-- zero_action's codes: 0 unshard, 1 reshard, 2 reduce_grads, 3 clear_grads, 4 make_state
local ZERO_ACTION = { [0] = C.ms_unit_zero_unshard, C.ms_unit_zero_reshard, C.ms_unit_zero_reduce_grads,
  C.ms_unit_zero_clear_grads, C.ms_unit_zero_make_state }
function R.zero_action(u, code)
  local h = unit_h(u)
  local f = ZERO_ACTION[code]
  if not f then error("moonshard.core_ffi: zero_action: not a zero action code", 2) end
  return done(f(h))
end

function R.zero_adamw_step(u, lr, b1, b2, eps, wd, step)
  return done(C.ms_unit_zero_adamw_step(unit_h(u), lr, b1, b2, eps, wd, step))
end

function R.unit_is_zero(u) return C.ms_unit_is_zero(unit_h(u)) ~= 0 end
-- ---------------------------------------------------------------- lower precision (quant.c)

K.FP8_TENSORWISE, K.FP8_ROWWISE = C.MS_FP8_TENSORWISE, C.MS_FP8_ROWWISE
K.QAT_INT4_WEIGHT_ONLY, K.QAT_8DA4W_WEIGHT = C.MS_QAT_INT4_WEIGHT_ONLY, C.MS_QAT_8DA4W_WEIGHT
K.QAT_8DA4W_ACTIVATION = C.MS_QAT_8DA4W_ACTIVATION

function R.nf4_quantize(x, blocksize, codes, absmax)
  return done(C.ms_nf4_quantize(tensor_h(x), blocksize, tensor_h(codes), tensor_h(absmax)))
end

function R.nf4_dequantize(out, codes, absmax, blocksize)
  return done(C.ms_nf4_dequantize(tensor_h(out), tensor_h(codes), tensor_h(absmax), blocksize))
end

--- nf4_compress_absmax(absmax, qabsmax, absmax2) -> offset
function R.nf4_compress_absmax(absmax, qabsmax, absmax2)
  local st = C.ms_nf4_compress_absmax(tensor_h(absmax), tensor_h(qabsmax), tensor_h(absmax2), double_out)
  if st ~= 0 then return failed(st) end
  return double_out[0]
end

function R.nf4_decompress_absmax(absmax, qabsmax, absmax2, offset)
  return done(C.ms_nf4_decompress_absmax(tensor_h(absmax), tensor_h(qabsmax), tensor_h(absmax2), offset))
end

--- nf4_bytes(numel, blocksize, double_quant) -> bytes
function R.nf4_bytes(numel, blocksize, double_quant)
  local st = C.ms_nf4_bytes(numel, blocksize, double_quant and 1 or 0, int64_out)
  if st ~= 0 then return failed(st) end
  return num(int64_out[0])
end

function R.fp8_amax(amax, x, scaling) return done(C.ms_fp8_amax(tensor_h(amax), tensor_h(x), scaling)) end

function R.fp8_scale(scale, amax, fp8, pow2)
  return done(C.ms_fp8_scale(tensor_h(scale), tensor_h(amax), fp8, pow2 and 1 or 0))
end

function R.fp8_cast(out, x, scale) return done(C.ms_fp8_cast(tensor_h(out), tensor_h(x), tensor_h(scale))) end

function R.fp8_dequantize(out, fp8, scale)
  return done(C.ms_fp8_dequantize(tensor_h(out), tensor_h(fp8), tensor_h(scale)))
end

function R.qat_fake_quantize(out, x, scheme, group_size, precision)
  return done(C.ms_qat_fake_quantize(tensor_h(out), tensor_h(x), scheme, group_size, precision))
end

function R.unit_set_fp8_all_gather(u, i, on) return done(C.ms_unit_set_fp8_all_gather(unit_h(u), i, on and 1 or 0)) end

-- ---------------------------------------------------------------- checkpoint files (ckpt.c)

ffi.cdef "int isatty(int fd);"
local u32_out, int_out, ckpt_a, ckpt_b = ffi.new("uint32_t[1]"), Ints(1), Int64s(MAX_DIMS), Int64s(MAX_DIMS)

--- crc32c(string, crc?) -> integer
function R.crc32c(s, crc)
  local st = C.ms_crc32c(crc or 0, s, #s, u32_out)
  if st ~= 0 then return failed(st) end
  return tonumber(u32_out[0])
end

function R.crc32c_impl() return ffi.string(C.ms_crc32c_impl()) end

function R.tensor_crc32c(t, crc)
  local st = C.ms_tensor_crc32c(tensor_h(t), crc or 0, u32_out)
  if st ~= 0 then return failed(st) end
  return tonumber(u32_out[0])
end

--- ckpt_open(path, write) -> fd
function R.ckpt_open(path, write)
  local st = C.ms_ckpt_open(path, write and 1 or 0, int_out)
  if st ~= 0 then return failed(st) end
  return int_out[0]
end

function R.ckpt_write(fd, s) return done(C.ms_ckpt_write(fd, s, #s)) end

--- ckpt_write_tensor(fd, t) -> crc
function R.ckpt_write_tensor(fd, t)
  local st = C.ms_ckpt_write_tensor(fd, tensor_h(t), u32_out)
  if st ~= 0 then return failed(st) end
  return tonumber(u32_out[0])
end

function R.ckpt_read_box(fd, offset, shape, start, out)
  local n = fill(ckpt_a, shape)
  if fill(ckpt_b, start) ~= n then error("ckpt_read_box: shape and start differ in length", 2) end
  return done(C.ms_ckpt_read_box(fd, offset, n, ckpt_a, ckpt_b, tensor_h(out)))
end

function R.ckpt_close(fd, sync) return done(C.ms_ckpt_close(fd, sync and 1 or 0)) end
function R.ckpt_fsync_path(path) return done(C.ms_ckpt_fsync_path(path)) end
function R.ckpt_rename(from, to) return done(C.ms_ckpt_rename(from, to)) end
function R.ckpt_mkdir(path, exist_ok) return done(C.ms_ckpt_mkdir(path, exist_ok and 1 or 0)) end

--- ckpt_list_dir(path) -> {names} (unsorted)
function R.ckpt_list_dir(path)
  local st = C.ms_ckpt_list_dir(path, nil, 0, int64_out)
  while st == 0 do
    local len = tonumber(int64_out[0])
    local buf = ffi.new("char[?]", len + 1)
    st = C.ms_ckpt_list_dir(path, buf, len, int64_out)
    if st == 0 and tonumber(int64_out[0]) <= len then
      local names, i = {}, 0
      while i < len do
        local name = ffi.string(buf + i)
        names[#names + 1] = name
        i = i + #name + 1
      end
      return names
    end
  end
  return failed(st)
end

function R.stderr_isatty() return ffi.C.isatty(2) == 1 end

REGISTRY[CACHE_KEY] = R
return R
