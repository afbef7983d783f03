-- moonshard: the Lua face of libmoonshard.
--
-- `local ms = require "moonshard"` gives the Lua API (docs/lua-api.md): ranks, tensors,
-- meshes, groups, collectives, placements, layouts and shard units.  It is written once, in
-- moonshard.tensor, moonshard.mesh and moonshard.unit, over the raw functions of the binding
-- this interpreter loads (moonshard.raw: the C binding under Lua 5.4, the FFI binding under
-- LuaJIT), so both interpreters give the same results and messages.  Dims, ranks,
-- coordinates and offsets are 0-based.

local R = require "moonshard.raw"
local A = require "moonshard.args"
A.library_file()

local M = {}
local INTERNAL = { check = true, check_group = true, device_string = true } -- the class modules' helpers
for _, class in ipairs { "tensor", "mesh", "unit", "zero", "quant" } do
  for k, v in pairs(require("moonshard." .. class)) do
    if type(v) == "function" and not INTERNAL[k] then M[k] = v end
  end
end

M.version = R.version
M.dtypes = {}
for d = 0, R.const.DTYPE_COUNT - 1 do M.dtypes[d + 1] = R.dtype_name(d) end

--- dtype_size(dtype?) -> bytes per element (f32 when nil)
function M.dtype_size(dtype) return R.dtype_size(A.opt_dtype(dtype, 1, R.const.F32)) end

--- cuda_device_count() -> n, and when n is 0 the reason (not built, no driver, no device)
function M.cuda_device_count() return R.cuda_device_count() end

--- file_stat(path) -> kind, size: what path names without opening it ("regular file",
-- "directory", "FIFO (named pipe)", "character device", ...) and a regular file's size; nil
-- and "<path>: <reason>" when it cannot be stat'ed, as io.open reports a failure.
function M.file_stat(path)
  path = A.check_string(path, 1)
  if path:find("\0", 1, true) then return nil, path:match("^[^%z]*") .. ": the path holds a NUL byte" end
  return R.file_stat(path)
end

local CAST_IMPLS = { auto = R.const.CAST_AUTO, portable = R.const.CAST_PORTABLE, avx2 = R.const.CAST_AVX2 }

--- cast_impl(name?) -> the cast kernels in use ("avx2" or "portable"), after choosing
-- "auto", "portable" or "avx2" when name is given
function M.cast_impl(name)
  if name ~= nil then
    name = A.check_string(name, 1)
    local impl = CAST_IMPLS[name]
    if not impl then A.raise("moonshard invalid_argument error: cast_impl: '%s' is not auto, portable or avx2", name) end
    A.ok(R.cast_set_impl(impl))
  end
  return R.cast_get_impl() == R.const.CAST_AVX2 and "avx2" or "portable"
end

--- memory_cap(bytes | nil) -> whether this Lua state counts its memory (Lua 5.4 on moonshard's
-- allocator; LuaJIT takes no allocator of the host's: false); memory_refused() -> whether
-- the cap refused an allocation since it was set
M.memory_cap, M.memory_refused = R.memory_cap, R.memory_refused

return M
