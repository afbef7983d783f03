-- moonshard.zero: Megatron-FSDP buckets for both interpreters (moonshard.h, "Megatron-FSDP
-- buckets"): ms.zero_bucket and the methods of its buckets, over the binding's raw functions.
-- A bucket is one rank's part of one bucket of a Megatron-FSDP unit (moonshard.plan_megatron):
-- its parameters at the plan's offsets in one flat buffer, this rank owning the slice
-- [r*size/dp, (r+1)*size/dp) (all of it under no_shard), with the buffers, collectives and
-- AdamW of the strategy.  Parameter indices are 0-based.

local REGISTRY = debug.getregistry()
if REGISTRY["moonshard.zero"] then return REGISTRY["moonshard.zero"] end

local R = require "moonshard.raw"
local A = require "moonshard.args"
local mesh = require "moonshard.mesh"
require "moonshard.unit" -- the unit class the buckets' handles are
A.library_file()

local ok, raise = A.ok, A.raise

local M = {}
local Bucket = {}
Bucket.__index = Bucket

local STRATEGIES = { [0] = "no_shard", "optim", "optim_grads", "optim_grads_params" }
local CODE = { no_shard = 0, optim = 1, optim_grads = 2, optim_grads_params = 3 }
-- moonshard.h's ms_zero_view
local VIEW = { param = 0, grad = 1, piece_param = 2, piece_grad = 3, exp_avg = 4, exp_avg_sq = 5, main = 6 }
local ACTION = { unshard = 0, reshard = 1, reduce_grads = 2, clear_grads = 3, make_state = 4 }

--- ms.zero_bucket(name, dp_group, {strategy = 0..3 or its name, dtype = "bf16", requires_grad =
-- true, grad_dtype = nil (the dtype) | "f32", main_f32 = false}) -> a bucket to add parameters to
function M.zero_bucket(name, group, o)
  name = A.check_string(name, 1)
  mesh.check_group(group, 2)
  o = o or {}
  A.check_table(o, 3)
  local s = o.strategy
  if type(s) == "string" and s:match("^%d$") then s = tonumber(s) end
  local code = type(s) == "number" and STRATEGIES[s] and s or CODE[s]
  if not code then
    raise("moonshard invalid_argument error: zero_bucket: strategy %s; expected 0..3 or no_shard, optim, " ..
      "optim_grads, optim_grads_params", tostring(s))
  end
  local dt = A.opt_dtype(o.dtype, 3, R.const.F32)
  local gdt = o.grad_dtype == nil and -1 or A.opt_dtype(o.grad_dtype, 3, R.const.F32)
  local u = ok(R.zero_new(name, group, code, dt, o.requires_grad ~= false, gdt, o.main_f32 == true))
  return setmetatable({ unit = u, strategy = STRATEGIES[code] }, Bucket)
end

local function index(self, i)
  i = A.check_integer(i, 2)
  local n = R.unit_count(self.unit)
  if i < 0 or i >= n then
    raise("moonshard invalid_argument error: bucket %s has no parameter %d (it has %d, numbered from 0)",
      R.unit_name(self.unit), i, n)
  end
  return tonumber(i)
end

--- bucket:add_param(fqn, shape, offset) -> index
function Bucket:add_param(fqn, shape, offset)
  ok(R.zero_add_param(self.unit, A.check_string(fqn, 2), A.int_list(shape, 3, "shape"), A.check_integer(offset, 4)))
  return R.unit_count(self.unit) - 1
end

--- bucket:finalize(size): the padded size of the bucket (the plan's b.size)
function Bucket:finalize(size)
  ok(R.zero_finalize(self.unit, A.check_integer(size, 2)))
  return self
end

local function lent(t, err) return ok(t, err) or nil end

--- bucket:param(i), bucket:grad(i): parameter i and its gradient in the whole bucket (shaped)
function Bucket:param(i) return lent(R.zero_tensor(self.unit, index(self, i), VIEW.param)) end
function Bucket:grad(i) return lent(R.zero_tensor(self.unit, index(self, i), VIEW.grad)) end

--- bucket:piece(i) -> start, stop: the elements of parameter i this rank owns
function Bucket:piece(i) return ok(R.zero_piece(self.unit, index(self, i))) end

--- bucket:piece_tensor(i, "param" | "grad" | "exp_avg" | "exp_avg_sq" | "main") -> the piece's
-- values (flat), or nil where there are none (a frozen bucket's gradient, no state yet)
function Bucket:piece_tensor(i, which)
  local code = VIEW[which == "param" and "piece_param" or which == "grad" and "piece_grad" or which]
  if not code or code < 2 then
    raise("moonshard invalid_argument error: piece_tensor: '%s'; expected param, grad, exp_avg, exp_avg_sq or main",
      tostring(which))
  end
  return lent(R.zero_tensor(self.unit, index(self, i), code))
end

function Bucket:load_full(i, t)
  ok(R.zero_load_full(self.unit, index(self, i), t))
  return self
end

for name, code in pairs(ACTION) do
  Bucket[name] = function(self)
    ok(R.zero_action(self.unit, code))
    return self
  end
end

--- bucket:adamw_step{lr=, betas=, eps=, weight_decay=, step=}: AdamW on the rank's slice, then
-- (optim, optim_grads) the all-gather of the updated slices
function Bucket:adamw_step(o)
  ok(R.zero_adamw_step(self.unit, A.adamw_options(o, "adamw_step")))
  return self
end

-- The unit's own: set_adamw, bytes, rank_allocated, records, clear_records, count, name, fqn.
for _, m in ipairs { "set_adamw", "bytes", "rank_allocated", "records", "clear_records", "count", "name", "fqn" } do
  Bucket[m] = function(self, ...)
    local r = { self.unit[m](self.unit, ...) }
    if r[1] == self.unit then return self end
    return (table.unpack or unpack)(r)
  end
end

function Bucket:__tostring()
  return string.format("zero_bucket(%s, %s, %d params)", R.unit_name(self.unit), self.strategy, R.unit_count(self.unit))
end

--- is_zero_bucket(v): a bucket made by ms.zero_bucket
function M.is_zero_bucket(v) return getmetatable(v) == Bucket end

REGISTRY["moonshard.zero"] = M
return M
