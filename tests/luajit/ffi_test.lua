-- ffi_test.lua CDEF LIBMOONSHARD: the generated FFI declarations load in LuaJIT and the C
-- core answers through them as it does in C (issue: the LuaJIT binding; this is its base).
local ffi = require "ffi"
ffi.cdef(dofile(arg[1]))
local C = ffi.load(arg[2])
local checks, failed = 0, 0
local function check(cond, what)
  checks = checks + 1
  if not cond then
    failed = failed + 1
    io.stderr:write("FAIL - " .. what .. "\n")
  end
end

check(ffi.string(C.ms_version()):match("^%d+%.%d+%.%d+$") ~= nil, "ms_version")
check(C.ms_dtype_size(C.MS_BF16) == 2 and ffi.string(C.ms_dtype_name(C.MS_F8E4M3)) == "f8e4m3", "dtypes")

-- a bf16 tensor filled with 1/3 holds 0x3EAB (round to nearest even)
local t = ffi.new("ms_tensor *[1]")
check(C.ms_tensor_new(t, 2, ffi.new("int64_t[2]", { 2, 3 }), C.MS_BF16, C.MS_DEVICE_CPU, 0) == C.MS_OK, "tensor_new")
check(C.ms_tensor_fill(t[0], 1 / 3) == C.MS_OK, "fill")
local bits = ffi.cast("uint16_t *", C.ms_tensor_data(t[0]))
check(bits[0] == 0x3EAB and bits[5] == 0x3EAB, "bf16 bits of 1/3")
C.ms_tensor_release(t[0])

-- errors: a status and a message
local st = C.ms_tensor_new(t, 1, ffi.new("int64_t[1]", { -2 }), C.MS_F32, C.MS_DEVICE_CPU, 0)
check(st == C.MS_ERR_SHAPE and ffi.string(C.ms_last_error()):match("size of dim 0 is %-2") ~= nil, "shape error")

-- int64 sizes above 2^53 stay exact: a meta tensor of 2^40 x 2^20 + 1 elements
check(C.ms_tensor_new(t, 2, ffi.new("int64_t[2]", { 2 ^ 40, 2 ^ 20 + 1 }), C.MS_BF16, C.MS_DEVICE_META, 0) == C.MS_OK,
  "meta tensor")
check(C.ms_tensor_numel(t[0]) == 1152922604118474752LL, "numel 2^60 + 2^40 exact")
C.ms_tensor_release(t[0])

-- a one-rank threads world: all_reduce leaves the values alone
local w, c = ffi.new("ms_world *[1]"), ffi.new("ms_comm *[1]")
check(C.ms_threads_world_new(w, 1, 5) == C.MS_OK and C.ms_world_comm(w[0], 0, c) == C.MS_OK, "world")
check(C.ms_tensor_new(t, 1, ffi.new("int64_t[1]", { 4 }), C.MS_F32, C.MS_DEVICE_CPU, 0) == C.MS_OK, "tensor")
C.ms_tensor_fill(t[0], 2.5)
check(C.ms_all_reduce(c[0], t[0], C.MS_OP_SUM) == C.MS_OK, "all_reduce")
check(ffi.cast("float *", C.ms_tensor_data(t[0]))[3] == 2.5, "all_reduce result")
C.ms_tensor_release(t[0])
C.ms_comm_release(c[0])
C.ms_world_release(w[0])

print(string.format("ffi: %d passed, %d failed", checks - failed, failed))
os.exit(failed == 0 and 0 or 1)
