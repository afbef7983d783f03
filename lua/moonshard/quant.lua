-- moonshard.quant: the lower-precision kernels of the core (core/src/quant.c) for both
-- interpreters: bitsandbytes' NF4 (QLoRA), torchao's float8 training casts and torchao's QAT
-- fake quantisation (docs/lua-api.md "Lower precision"; the rules in docs/numerics.md).
-- Argument checks, defaults and messages are here; the binding's raw functions only run the
-- kernels on tensors made here.

local REGISTRY = debug.getregistry()
if REGISTRY["moonshard.quant"] then return REGISTRY["moonshard.quant"] end

local R = require "moonshard.raw"
local A = require "moonshard.args"
local T = require "moonshard.tensor"
A.library_file()

local ok, raise = A.ok, A.raise
local K = R.const
local check_tensor = T.check

local M = {}

local function opts_table(v, arg)
  if v == nil then return {} end
  return A.check_table(v, arg)
end

local function cpu_tensor(fn, t, arg)
  check_tensor(t, arg)
  local kind = R.tensor_device(t)
  if kind ~= K.DEVICE_CPU then
    raise("moonshard device error: %s: the tensor is on %s; a cpu tensor was expected", fn, T.device_string(R.tensor_device(t)))
  end
  if not R.tensor_is_contiguous(t) then
    t = ok(R.tensor_to(t, R.tensor_dtype(t))) -- a contiguous copy
  end
  return t
end

local function dtype_of(t) return R.dtype_name(R.tensor_dtype(t)) end

local function one_of(fn, what, v, allowed, list)
  if not allowed[v] then raise("moonshard invalid_argument error: %s: %s is %s; %s was expected", fn, what, tostring(v), list) end
  return v
end

local function opt_bool(fn, v, what, def)
  if v == nil then return def end
  if type(v) ~= "boolean" then raise("moonshard invalid_argument error: %s: %s is %s; a boolean was expected", fn, what, type(v)) end
  return v
end

local function new(shape, code) return ok(R.tensor_new(shape, code, K.DEVICE_CPU, 0)) end

-- ---------------------------------------------------------------- NF4

local NF4_FLOATS = { f32 = true, bf16 = true, f16 = true }
local BLOCKSIZES = { [32] = true, [64] = true, [128] = true, [256] = true, [512] = true, [1024] = true,
  [2048] = true, [4096] = true }
local BLOCKSIZE_LIST = "32, 64, 128, 256, 512, 1024, 2048 or 4096"

local function blocksize_of(fn, v)
  if v == nil then return 64 end
  local b = A.to_integer(v)
  if not b or not BLOCKSIZES[tonumber(b)] then
    raise("moonshard invalid_argument error: %s: blocksize %s is not one of bitsandbytes' %s", fn, tostring(v), BLOCKSIZE_LIST)
  end
  return tonumber(b)
end

local function ceil_div(a, b) return math.floor((a + b - 1) / b) end

--- ms.nf4_quantize(x, {blocksize = 64, double_quant = false}) -> q: bitsandbytes'
-- quantize_4bit(x, blocksize, quant_type="nf4", compress_statistics=double_quant) of an f32,
-- bf16 or f16 tensor.  q.codes (u8, two codes a byte), q.absmax (f32, one per block) or with
-- double_quant q.qabsmax (u8), q.absmax2 (f32, one per 256 blocks) and q.offset (a number);
-- q.shape, q.dtype, q.blocksize, q.double_quant.
function M.nf4_quantize(x, opts)
  local fn = "nf4_quantize"
  x = cpu_tensor(fn, x, 1)
  opts = opts_table(opts, 2)
  local dt = dtype_of(x)
  one_of(fn, "x's dtype", dt, NF4_FLOATS, "f32, bf16 or f16")
  local bs = blocksize_of(fn, opts.blocksize)
  local dq = opt_bool(fn, opts.double_quant, "double_quant", false)
  local n = R.tensor_numel(x)
  local nb = ceil_div(n, bs)
  local q = { shape = R.tensor_shape(x), dtype = dt, blocksize = bs, double_quant = dq }
  q.codes = new({ ceil_div(n, 2) }, R.dtype_code("u8"))
  local absmax = new({ nb }, K.F32)
  ok(R.nf4_quantize(x, bs, q.codes, absmax))
  if dq then
    if nb == 0 then raise("moonshard invalid_argument error: %s: x is empty; double_quant needs one block or more", fn) end
    q.qabsmax = new({ nb }, R.dtype_code("u8"))
    q.absmax2 = new({ ceil_div(nb, 256) }, K.F32)
    q.offset = ok(R.nf4_compress_absmax(absmax, q.qabsmax, q.absmax2))
  else
    q.absmax = absmax
  end
  return q
end

--- ms.nf4_dequantize(q, dtype?) -> a tensor of q.shape in dtype (default q.dtype): bitsandbytes'
-- dequantize_4bit.
function M.nf4_dequantize(q, dtype)
  local fn = "nf4_dequantize"
  A.check_table(q, 1)
  local dt = A.opt_dtype(dtype or q.dtype, 2, K.F32)
  one_of(fn, "dtype", R.dtype_name(dt), NF4_FLOATS, "f32, bf16 or f16")
  local bs = blocksize_of(fn, q.blocksize)
  if type(q.shape) ~= "table" then raise("moonshard invalid_argument error: %s: q.shape is %s; a shape was expected", fn, type(q.shape)) end
  local shape = A.int_list(q.shape, 1, "q.shape")
  local out = new(shape, dt)
  local codes = cpu_tensor(fn, q.codes, 1)
  local absmax = q.absmax
  if q.double_quant then
    local qa, a2 = cpu_tensor(fn, q.qabsmax, 1), cpu_tensor(fn, q.absmax2, 1)
    absmax = new({ R.tensor_numel(qa) }, K.F32)
    ok(R.nf4_decompress_absmax(absmax, qa, a2, A.check_number(q.offset, 1)))
  else
    absmax = cpu_tensor(fn, absmax, 1)
  end
  ok(R.nf4_dequantize(out, codes, absmax, bs))
  return out
end

--- ms.nf4_bytes(numel, {blocksize = 64, double_quant = false}) -> the bytes of a quantized
-- tensor of numel elements: codes, absmax, and with double_quant the nested statistics.
function M.nf4_bytes(numel, opts)
  local fn = "nf4_bytes"
  local n = A.check_integer(numel, 1)
  if n < 0 then raise("moonshard invalid_argument error: %s: numel %s is negative", fn, tostring(n)) end
  opts = opts_table(opts, 2)
  return ok(R.nf4_bytes(n, blocksize_of(fn, opts.blocksize), opt_bool(fn, opts.double_quant, "double_quant", false)))
end

-- ---------------------------------------------------------------- float8

local FP8 = { f8e4m3 = true, f8e5m2 = true }
local FP8_INPUTS = { f32 = true, bf16 = true }
local SCALINGS = { tensorwise = K.FP8_TENSORWISE, rowwise = K.FP8_ROWWISE, axiswise = K.FP8_ROWWISE }

local function scaling_of(fn, v)
  if v == nil then return "tensorwise" end
  if type(v) ~= "string" or not SCALINGS[v] then
    raise("moonshard invalid_argument error: %s: scaling is %s; tensorwise or rowwise was expected", fn, tostring(v))
  end
  return v
end

-- the shape of x's amax and scale: {} (tensorwise), x's shape with the last dim 1 (rowwise)
local function stat_shape(x, scaling)
  if scaling == "tensorwise" then return {} end
  local s = R.tensor_shape(x)
  if #s == 0 then return {} end
  s[#s] = 1
  return s
end

local function fp8_dtype_of(fn, v)
  local code = A.opt_dtype(v, 2, R.dtype_code("f8e4m3"))
  one_of(fn, "dtype", R.dtype_name(code), FP8, "f8e4m3 or f8e5m2")
  return code
end

--- ms.fp8_amax(x, scaling?) -> f32 tensor: max |x| over the tensor (shape {}) or per row
-- (rowwise: x's shape with the last dim 1), as torchao's tensor_to_amax; NaN propagates.
local function amax_of(x, scaling)
  local amax = new(stat_shape(x, scaling), K.F32)
  ok(R.fp8_amax(amax, x, SCALINGS[scaling]))
  return amax
end

local function scale_of(amax, code, pow2)
  local scale = new(R.tensor_shape(amax), K.F32)
  ok(R.fp8_scale(scale, amax, code, pow2))
  return scale
end

function M.fp8_amax(x, scaling)
  local fn = "fp8_amax"
  x = cpu_tensor(fn, x, 1)
  one_of(fn, "x's dtype", dtype_of(x), FP8_INPUTS, "f32 or bf16")
  return amax_of(x, scaling_of(fn, scaling))
end

--- ms.fp8_scale(amax, {dtype = "f8e4m3", pow2 = false}) -> f32 tensor of amax's shape:
-- torchao's amax_to_scale (round_scales_to_power_of_2 = pow2).
function M.fp8_scale(amax, opts)
  local fn = "fp8_scale"
  amax = cpu_tensor(fn, amax, 1)
  opts = opts_table(opts, 2)
  if dtype_of(amax) ~= "f32" then amax = ok(R.tensor_to(amax, K.F32)) end
  return scale_of(amax, fp8_dtype_of(fn, opts.dtype), opt_bool(fn, opts.pow2, "pow2", false))
end

--- ms.fp8_cast(x, {dtype = "f8e4m3", scaling = "tensorwise", pow2 = false, amax = t?,
-- scale = t?}) -> data, scale: torchao's hp_tensor_and_scale_to_float8 with the scale of
-- tensor_to_scale.  amax (e.g. all-reduced MAX over a shard group) replaces x's own; scale
-- replaces both.  data has x's shape in the fp8 dtype; scale is f32.
function M.fp8_cast(x, opts)
  local fn = "fp8_cast"
  x = cpu_tensor(fn, x, 1)
  one_of(fn, "x's dtype", dtype_of(x), FP8_INPUTS, "f32 or bf16")
  opts = opts_table(opts, 2)
  local code = fp8_dtype_of(fn, opts.dtype)
  local scaling = scaling_of(fn, opts.scaling)
  local scale = opts.scale
  local want = stat_shape(x, scaling)
  local rows = 1
  for _, d in ipairs(want) do rows = rows * d end
  local function check_stat(t, what)
    t = cpu_tensor(fn, t, 2)
    if dtype_of(t) ~= "f32" then t = ok(R.tensor_to(t, K.F32)) end
    if R.tensor_numel(t) ~= rows then
      raise("moonshard shape error: %s: %s has %s elements; %d were expected (%s)", fn, what,
        tostring(R.tensor_numel(t)), rows, scaling == "tensorwise" and "tensorwise" or "one per row")
    end
    return t
  end
  if scale ~= nil then
    scale = check_stat(scale, "scale")
  else
    local amax = opts.amax
    amax = amax ~= nil and check_stat(amax, "amax") or amax_of(x, scaling)
    scale = scale_of(ok(R.tensor_view(amax, want)), code, opt_bool(fn, opts.pow2, "pow2", false))
  end
  local data = new(R.tensor_shape(x), code)
  ok(R.fp8_cast(data, x, scale))
  return data, scale
end

--- ms.fp8_dequantize(data, scale, dtype?) -> data.to(dtype) / scale (dtype f32 (default) or
-- bf16), as torchao's to_original_precision.
function M.fp8_dequantize(data, scale, dtype)
  local fn = "fp8_dequantize"
  data = cpu_tensor(fn, data, 1)
  one_of(fn, "data's dtype", dtype_of(data), FP8, "f8e4m3 or f8e5m2")
  scale = cpu_tensor(fn, scale, 2)
  local dt = A.opt_dtype(dtype, 3, K.F32)
  one_of(fn, "dtype", R.dtype_name(dt), FP8_INPUTS, "f32 or bf16")
  local out = new(R.tensor_shape(data), dt)
  ok(R.fp8_dequantize(out, data, scale))
  return out
end

-- ---------------------------------------------------------------- QAT

local SCHEMES = {
  int4_weight_only = { K.QAT_INT4_WEIGHT_ONLY, 256, "bf16" },
  ["8da4w_weight"] = { K.QAT_8DA4W_WEIGHT, 256, "f32" },
  ["8da4w_activation"] = { K.QAT_8DA4W_ACTIVATION, 0, "f32" },
}
local SCHEME_LIST = "int4_weight_only, 8da4w_weight or 8da4w_activation"

--- ms.qat_fake_quantize(x, scheme, {group_size = 256, scales_precision = ...}) -> x fake
-- quantized (a new tensor, x's dtype and shape): torchao's QAT fake quantizers.  scheme
-- "int4_weight_only" (Int4WeightOnlyQATQuantizer, scales bf16), "8da4w_weight" and
-- "8da4w_activation" (Int8DynActInt4WeightQATQuantizer, scales f32, per token).
function M.qat_fake_quantize(x, scheme, opts)
  local fn = "qat_fake_quantize"
  x = cpu_tensor(fn, x, 1)
  one_of(fn, "x's dtype", dtype_of(x), FP8_INPUTS, "f32 or bf16")
  local s = SCHEMES[scheme]
  if not s then raise("moonshard invalid_argument error: %s: scheme is %s; %s was expected", fn, tostring(scheme), SCHEME_LIST) end
  opts = opts_table(opts, 3)
  local group = opts.group_size == nil and s[2] or A.check_integer(opts.group_size, 3)
  local prec = A.opt_dtype(opts.scales_precision or s[3], 3, K.F32)
  one_of(fn, "scales_precision", R.dtype_name(prec), FP8_INPUTS, "f32 or bf16")
  local out = new(R.tensor_shape(x), R.tensor_dtype(x))
  ok(R.qat_fake_quantize(out, x, s[1], group, prec))
  return out
end

REGISTRY["moonshard.quant"] = M
return M
