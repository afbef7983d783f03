-- moonshard.unit: FSDP shard units for both interpreters: ms.unit and the methods of
-- moonshard.Unit (argument checks, defaults and messages), over the binding's raw functions
-- (moonshard.raw).  Parameter indices are 0-based.

local REGISTRY = debug.getregistry()
if REGISTRY["moonshard.unit"] then return REGISTRY["moonshard.unit"] end

local R = require "moonshard.raw"
local A = require "moonshard.args"
local tensor = require "moonshard.tensor"
local mesh = require "moonshard.mesh"
A.library_file()

local format = string.format
local ok, raise = A.ok, A.raise
local K = R.const

local M = {}
local methods = {}

local check_unit = A.checker("unit")

local function opt_dtype_or_unset(v, arg)
  if v == nil then return -1 end
  return A.opt_dtype(v, arg, K.F32)
end

local function truthy(v) return v ~= nil and v ~= false end

--- ms.unit(name, shard_group, replicate_group|nil, param_dtype|nil, reduce_dtype|nil,
-- reshard_after_forward): reshard as PyTorch's fully_shard takes it: true (the default)
-- frees the unsharded parameters after forward, false keeps them, an integer k reshards to
-- groups of k ranks
function M.unit(name, shard, replicate, param_dtype, reduce_dtype, reshard)
  name = A.check_string(name, 1)
  mesh.check_group(shard, 2)
  if replicate ~= nil then mesh.check_group(replicate, 3) end
  local pd, rd = opt_dtype_or_unset(param_dtype, 4), opt_dtype_or_unset(reduce_dtype, 5)
  local raf = K.RESHARD_FULL
  if type(reshard) == "boolean" then
    raf = reshard and K.RESHARD_FULL or K.RESHARD_KEEP
  elseif reshard ~= nil then
    raf = A.check_int(reshard, 6, "unit: reshard_after_forward")
  end
  return ok(R.unit_new(name, shard, replicate, pd, rd, raf))
end

--- unit:add_param(fqn, shape, dtype, dim?, requires_grad?) -> index (0-based)
function methods.add_param(self, fqn, shape, dtype, dim, requires_grad)
  local u = check_unit(self, 1)
  fqn = A.check_string(fqn, 2)
  local s = A.int_list(shape, 3, "shape")
  local dt = A.opt_dtype(dtype, 4, K.F32)
  dim = A.opt_int(dim, 5, "add_param: dim", 0)
  ok(R.unit_add_param(u, fqn, s, dt, dim, requires_grad == nil or requires_grad ~= false))
  return R.unit_count(u) - 1
end

local function param_index(u, i, arg)
  i = A.check_integer(i, arg)
  local count = R.unit_count(u)
  if i < 0 or i >= count then
    raise("moonshard invalid_argument error: unit %s has no parameter %d (it has %d, numbered from 0)", R.unit_name(u),
      i, count)
  end
  return tonumber(i)
end

-- A tensor the unit lends (its own reference): the binding gives false when there is none.
local function lent(t, err) return ok(t, err) or nil end

for _, which in ipairs { "param_shard", "grad_shard", "param_full", "grad_full" } do
  local code = K["UNIT_" .. which:upper()]
  methods[which] = function(self, i)
    local u = check_unit(self, 1)
    return lent(R.unit_tensor(u, code, param_index(u, i, 2)))
  end
end

-- The methods calling the core on the unit alone; they return the unit.
for _, action in ipairs { "finalize", "unshard", "wait", "reshard", "reduce_grads", "release_unsharded", "zero_grad" } do
  local code = K["UNIT_" .. action:upper()]
  methods[action] = function(self)
    ok(R.unit_action(check_unit(self, 1), code))
    return self
  end
end

function methods.load_full(self, i, full)
  local u = check_unit(self, 1)
  ok(R.unit_load_full(u, param_index(u, i, 2), tensor.check(full, 3)))
  return self
end

--- unit:param_offset(i) -> offset, rows, dim: this rank's shard of parameter i is rows
-- [offset, offset + rows) of the full parameter's dim `dim` (0-based, like add_param's)
function methods.param_offset(self, i)
  local u = check_unit(self, 1)
  return ok(R.unit_param_offset(u, param_index(u, i, 2)))
end

function methods.set_requires_gradient_sync(self, sync)
  ok(R.unit_set_flag(check_unit(self, 1), K.UNIT_SYNC, truthy(sync)))
  return self
end

--- unit:set_cpu_offload(offload): FSDP2's CPUOffloadPolicy, before the first add_param
function methods.set_cpu_offload(self, offload)
  ok(R.unit_set_flag(check_unit(self, 1), K.UNIT_CPU_OFFLOAD, truthy(offload)))
  return self
end

--- unit:set_packed(packed): before the first add_param, a unit whose trainable parameters
-- may have several stored dtypes, each parameter with its own policy (set_param_policy):
-- one all-gather, one reduce-scatter per reduce dtype (ms_unit_set_packed)
function methods.set_packed(self, packed)
  ok(R.unit_set_flag(check_unit(self, 1), K.UNIT_PACKED, truthy(packed)))
  return self
end

--- unit:set_param_policy(i, param_dtype|nil, reduce_dtype|nil): parameter i's own
-- mixed-precision dtypes in a packed unit (nil: unset), before finalize
function methods.set_param_policy(self, i, param_dtype, reduce_dtype)
  local u = check_unit(self, 1)
  local index = param_index(u, i, 2)
  ok(R.unit_set_param_policy(u, index, opt_dtype_or_unset(param_dtype, 3), opt_dtype_or_unset(reduce_dtype, 4)))
  return self
end

--- unit:param_dtypes(i) -> {stored=, gather=, reduce=, requires_grad=}: parameter i's
-- effective dtypes (after finalize; reduce nil for a frozen parameter)
function methods.param_dtypes(self, i)
  local u = check_unit(self, 1)
  local stored, gather, reduce, rg = ok(R.unit_param_dtypes(u, param_index(u, i, 2)))
  return { stored = R.dtype_name(stored), gather = R.dtype_name(gather), reduce = rg and R.dtype_name(reduce) or nil,
    requires_grad = rg }
end

function methods.set_gradient_divide_factor(self, factor)
  ok(R.unit_set_number(check_unit(self, 1), K.UNIT_DIVIDE_FACTOR, A.check_number(factor, 2)))
  return self
end

function methods.grad_sq_norm(self) return ok(R.unit_grad_sq_norm(check_unit(self, 1))) end

function methods.scale_grads(self, scale)
  ok(R.unit_set_number(check_unit(self, 1), K.UNIT_SCALE_GRADS, A.check_number(scale, 2)))
  return self
end

-- ---------------------------------------------------------------- AdamW

--- unit:adamw_step{lr=, betas={b1, b2}, eps=, weight_decay=, step=}: lr and step required
function methods.adamw_step(self, o)
  local u = check_unit(self, 1)
  ok(R.unit_adamw_step(u, A.adamw_options(o, "adamw_step")))
  return self
end

--- unit:set_adamw("master" | "torch"): how adamw_step keeps its state
local ADAMW_MODES = { master = K.ADAMW_MASTER, torch = K.ADAMW_TORCH }
function methods.set_adamw(self, mode)
  local u = check_unit(self, 1)
  local m = ADAMW_MODES[A.check_string(mode, 2)]
  if not m then
    raise("moonshard invalid_argument error: set_adamw: mode '%s'; expected 'master' (f32 master weights and " ..
      "moments) or 'torch' (torch.optim.AdamW: state in the stored dtype)", mode)
  end
  ok(R.unit_set_adamw(u, m))
  return self
end

--- unit:adamw_state(i, "exp_avg" | "exp_avg_sq" | "master") -> tensor, or nil for a frozen parameter
local ADAMW_STATE = { exp_avg = K.ADAMW_EXP_AVG, exp_avg_sq = K.ADAMW_EXP_AVG_SQ, master = K.ADAMW_MASTER_WEIGHTS }
function methods.adamw_state(self, i, which)
  local u = check_unit(self, 1)
  local index = param_index(u, i, 2)
  local w = ADAMW_STATE[A.check_string(which, 3)]
  if not w then
    raise("moonshard invalid_argument error: adamw_state: '%s'; expected 'exp_avg', 'exp_avg_sq' or 'master'", which)
  end
  return lent(R.unit_adamw_state(u, index, w))
end

--- unit:adamw_skipped(i) -> the adamw_step calls parameter i had no gradient in
function methods.adamw_skipped(self, i)
  local u = check_unit(self, 1)
  return R.unit_adamw_skipped(u, param_index(u, i, 2))
end

function methods.set_adamw_skipped(self, i, k)
  local u = check_unit(self, 1)
  ok(R.unit_set_adamw_skipped(u, param_index(u, i, 2), A.check_integer(k, 3)))
  return self
end

-- ---------------------------------------------------------------- accounting

local BYTE_CATEGORIES = { "params", "grads", "optimizer", "unsharded", "cached" }

--- unit:bytes() -> {params=, grads=, optimizer=, unsharded=, cached=}
function methods.bytes(self)
  local u = check_unit(self, 1)
  local out = {}
  for c, name in ipairs(BYTE_CATEGORIES) do out[name] = R.unit_bytes(u, c - 1) end
  return out
end

--- unit:rank_allocated() -> {params=, grads=, optimizer=, unsharded=}: the memory allocated
-- for every unit of the rank, counted at the allocator
function methods.rank_allocated(self)
  local u = check_unit(self, 1)
  local out = {}
  for c = 1, 4 do out[BYTE_CATEGORIES[c]] = R.unit_rank_allocated(u, c - 1) end
  return out
end

local RECORD_KINDS = { [0] = "all_gather", "reduce_scatter", "all_reduce" }

--- unit:records() -> list of {kind=, dtype=, group_size=, bytes=}
function methods.records(self)
  local u = check_unit(self, 1)
  local out = {}
  for i = 0, R.unit_record_count(u) - 1 do
    local kind, dt, size, bytes = ok(R.unit_record(u, i))
    out[i + 1] = { kind = RECORD_KINDS[kind] or "?", dtype = R.dtype_name(dt), group_size = size, bytes = bytes }
  end
  return out
end

function methods.clear_records(self) R.unit_clear_records(check_unit(self, 1)) end
function methods.count(self) return R.unit_count(check_unit(self, 1)) end
function methods.name(self) return R.unit_name(check_unit(self, 1)) end

function methods.fqn(self, i)
  local u = check_unit(self, 1)
  return R.unit_fqn(u, param_index(u, i, 2))
end

--- unit:set_fp8_all_gather(i, on?) -> the unit: parameter i gathers as e4m3 with an
-- all-reduced dynamic scale, as torchao's float8 weights under FSDP2 (core/src/unit_fp8.c);
-- before finalize
function methods.set_fp8_all_gather(self, i, on)
  local u = check_unit(self, 1)
  ok(R.unit_set_fp8_all_gather(u, param_index(u, i, 2), on == nil or on ~= false))
  return self
end

A.define("unit", methods, function(u) return format("unit(%s, %d params)", R.unit_name(u), R.unit_count(u)) end)

REGISTRY["moonshard.unit"] = M
return M
