-- moonshard.tensor: tensors for both interpreters: ms.tensor, ms.from_table and the methods
-- of moonshard.Tensor (argument checks, defaults and messages), over the binding's raw
-- functions (moonshard.raw).  Sizes are int64 in the core: Lua integers under Lua 5.4; under
-- LuaJIT numbers when exact (|v| <= 2^53), else int64_t cdata.

local REGISTRY = debug.getregistry()
if REGISTRY["moonshard.tensor"] then return REGISTRY["moonshard.tensor"] end

local R = require "moonshard.raw"
local A = require "moonshard.args"
A.library_file()

local format = string.format
local ok, raise = A.ok, A.raise
local K = R.const

local M = {}
local methods = {}
M.methods = methods

local check_tensor = A.checker("tensor")
M.check = check_tensor

--- "cpu", "meta" or "cuda:N" for a device type code and index.
local function device_string(kind, index)
  if kind == K.DEVICE_CPU then return "cpu" end
  if kind == K.DEVICE_META then return "meta" end
  return format("cuda:%d", index)
end
M.device_string = device_string

--- ms.tensor(shape, dtype?, device?): zeros (cpu, cuda:N) or shape only (meta)
function M.tensor(shape, dtype, device)
  local s = A.int_list(shape, 1, "shape")
  local dt = A.opt_dtype(dtype, 2, K.F32)
  local dev, idx = K.DEVICE_CPU, 0
  if device ~= nil then dev, idx = ok(R.device_code(A.check_string(device, 3))) end
  return ok(R.tensor_new(s, dt, dev, idx))
end

-- v (a number, an int64 cdata or a boolean) as an element of the integer dtype dt, for
-- from_table and fill_ (ms_int_element: PyTorch's rules); `what` names the value (a format
-- of the index i, made only for the message).
local function int_element(v, dt, what, i)
  local e, err = R.int_element(v, dt)
  if e == nil then raise("moonshard invalid_argument error: %s%s", i and format(what, i) or what, err) end
  return e
end

--- ms.from_table(values, dtype?, shape?): values is a flat sequence of numbers (or booleans).
function M.from_table(values, dtype, shape)
  A.check_table(values, 1)
  local dt = A.opt_dtype(dtype, 2, K.F32)
  local n = #values
  local s = shape ~= nil and A.int_list(shape, 3, "shape") or { n }
  local t = ok(R.tensor_new(s, dt, K.DEVICE_CPU, 0))
  local numel = R.tensor_numel(t)
  if numel ~= n then
    raise("moonshard shape error: from_table: %d values do not fill a shape of %d elements", n, numel)
  end
  -- Integers travel as int64 so that values above 2^53 stay exact; floats as f64.
  local as_int = not R.dtype_is_float(dt)
  local staged = {}
  for i = 1, n do
    local v = values[i]
    local kind = type(v)
    if kind == "boolean" then
      staged[i] = v and 1 or 0
    elseif as_int then
      if not (R.is_number(v)) then
        raise("moonshard invalid_argument error: from_table: values[%d] is %s, expected a number", i, kind)
      end
      staged[i] = int_element(v, dt, "from_table: values[%d] = ", i)
    else
      local x = tonumber(v)
      if not x then raise("moonshard invalid_argument error: from_table: values[%d] is %s, expected a number", i, kind) end
      staged[i] = x
    end
  end
  ok(R.tensor_write(t, staged, as_int))
  return t
end

function methods.shape(self) return R.tensor_shape(check_tensor(self, 1)) end
function methods.stride(self) return R.tensor_stride(check_tensor(self, 1)) end
function methods.dtype(self) return R.dtype_name(R.tensor_dtype(check_tensor(self, 1))) end
function methods.numel(self) return R.tensor_numel(check_tensor(self, 1)) end
function methods.nbytes(self) return R.tensor_nbytes(check_tensor(self, 1)) end
function methods.ndim(self) return R.tensor_ndim(check_tensor(self, 1)) end
function methods.is_contiguous(self) return R.tensor_is_contiguous(check_tensor(self, 1)) end
function methods.device(self) return device_string(R.tensor_device(check_tensor(self, 1))) end

--- t:to(dtype) casts; t:to("cpu" | "cuda:N") moves to another device.
function methods.to(self, dtype)
  local t = check_tensor(self, 1)
  if type(dtype) == "string" then
    local dev, idx = R.device_code(dtype)
    if dev then return ok(R.tensor_to_device(t, dev, idx)) end
  end
  return ok(R.tensor_to(t, A.opt_dtype(dtype, 2, R.tensor_dtype(t))))
end

function methods.copy_(self, src)
  ok(R.tensor_copy(check_tensor(self, 1), check_tensor(src, 2)))
  return self
end

function methods.fill_(self, v)
  local t = check_tensor(self, 1)
  if type(v) ~= "boolean" and not R.is_number(v) then A.check_number(v, 2) end
  local dt = R.tensor_dtype(t)
  if R.dtype_is_float(dt) then
    ok(R.tensor_fill(t, type(v) == "boolean" and (v and 1 or 0) or tonumber(v)))
  else
    ok(R.tensor_fill_int(t, int_element(v, dt, "fill_: ")))
  end
  return self
end

function methods.narrow(self, dim, start, len)
  local t = check_tensor(self, 1)
  dim = A.check_int(dim, 2, "narrow: dim")
  start, len = A.check_integer(start, 3), A.check_integer(len, 4)
  return ok(R.tensor_narrow(t, dim, start, len))
end

function methods.view(self, shape)
  local t = check_tensor(self, 1)
  return ok(R.tensor_view(t, A.int_list(shape, 2, "shape")))
end

--- t:chunk(chunks, index, dim?) -- piece `index` (0-based) of torch.chunk
function methods.chunk(self, chunks, index, dim)
  local t = check_tensor(self, 1)
  chunks, index = A.check_integer(chunks, 2), A.check_integer(index, 3)
  return ok(R.tensor_chunk(t, chunks, index, A.opt_int(dim, 4, "chunk: dim", 0)))
end

local function readable(t)
  if R.tensor_device(t) == K.DEVICE_META then
    raise("moonshard device error: totable/bits: a meta tensor holds no data")
  end
  return t
end

--- Flat list of numbers; only i64 tensors may hold integers a number cannot hold exactly
-- (Lua integers under 5.4 for every integer dtype).
function methods.totable(self)
  return ok(R.tensor_read(readable(check_tensor(self, 1))))
end

--- Flat list of the raw bit patterns (8-byte ones as signed integers).
function methods.bits(self)
  return ok(R.tensor_bits(readable(check_tensor(self, 1))))
end

local function tostring_live(t)
  local sizes = R.tensor_shape(t)
  for i = 1, #sizes do sizes[i] = format("%d", sizes[i]) end
  return format("tensor([%s], %s, %s)", table.concat(sizes, ", "), R.dtype_name(R.tensor_dtype(t)),
    device_string(R.tensor_device(t)))
end

A.define("tensor", methods, tostring_live)

REGISTRY["moonshard.tensor"] = M
return M
