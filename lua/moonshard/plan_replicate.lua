-- moonshard.plan_replicate: replicate units (ctx:replicate, see moonshard.plan), PyTorch's
-- DistributedDataParallel as NeMo Automodel's DDP manager applies it
-- (nemo_automodel/components/distributed/ddp.py, DDPManager.parallelize: DDP over the whole
-- data-parallel world, DDPConfig's options).  Every rank holds the unit's parameters,
-- gradients and optimizer state whole; the gradients are averaged over the unit's ranks by
-- one all_reduce per bucket, the buckets made as PyTorch 2.15 makes them (R.buckets).

local util = require "moonshard.util"

local R = {}

-- The planner's helpers (moonshard.plan gives them to bind): its errors and checked sums.
local fail, add, mul, display, shown, call_site, DTYPE_SIZE, FLOAT

--- Takes the planner's helpers h; returns R.
function R.bind(h)
  fail, add, mul, display, shown, call_site = h.fail, h.add, h.mul, h.display, h.shown, h.call_site
  DTYPE_SIZE, FLOAT = h.DTYPE_SIZE, h.FLOAT
  return R
end

-- torch/nn/parallel/distributed.py: _DEFAULT_BUCKET_CAP_MB (25), _MB_TO_BYTES, and
-- dist._DEFAULT_FIRST_BUCKET_BYTES (1 MiB), the first bucket's cap when bucket_cap_mb is unset.
R.MIB = 1048576
R.DEFAULT_CAP_MB = 25
R.FIRST_BUCKET_BYTES = 1048576

--- DDP's bucket limits in bytes (_BucketCapacityConfig.create and compute_bucket_size_limits):
-- the cap is int(bucket_cap_mb * MiB) (25 MiB unset); the first bucket's is 1 MiB when
-- bucket_cap_mb is unset, else the cap.  With find_unused_parameters the constructor's
-- assignment stays: [first, cap], or [cap] when first is not smaller.  Without it that first
-- assignment is one bucket per dtype, which Reducer::rebuild_buckets replaces after the first
-- iteration with the limits [first, cap].
function R.limits(cap_mb, find_unused)
  local cap = math.floor((cap_mb or R.DEFAULT_CAP_MB) * R.MIB)
  local first = cap_mb == nil and R.FIRST_BUCKET_BYTES or cap
  if find_unused and first >= cap then return { cap } end
  return { first, cap }
end

--- compute_bucket_assignment_by_size (torch/csrc/distributed/c10d/reducer.cpp), for items
-- {index, bytes, dtype} in the order given: one open bucket per dtype, which takes items until
-- its bytes reach its limit (>=), closes, and moves that dtype to the next limit (the last
-- one stays); then the buckets still open, in the reverse order of their dtypes' first item
-- (the iteration order of the reducer's unordered_map, measured: tests/reference/ddp_buckets.py).
-- Unless `ordered` (the reducer's tensor_indices given, the rebuild), the buckets are sorted
-- by the smallest index they hold.  Returns {indices, bytes, dtype, limit} per bucket.
function R.assign(items, limits, ordered)
  local open, step, dtypes, out = {}, {}, {}, {}
  for _, x in ipairs(items) do
    local d = x.dtype
    if not step[d] then
      step[d] = 1
      dtypes[#dtypes + 1] = d
    end
    local b = open[d]
    if not b then
      b = { indices = {}, bytes = 0, dtype = d }
      open[d] = b
    end
    b.indices[#b.indices + 1] = x.index
    b.bytes = add(b.bytes, x.bytes, "the bytes of a gradient bucket")
    b.limit = limits[step[d]]
    if b.bytes >= b.limit then
      out[#out + 1] = b
      open[d] = nil
      if step[d] < #limits then step[d] = step[d] + 1 end
    end
  end
  for i = #dtypes, 1, -1 do
    if open[dtypes[i]] then out[#out + 1] = open[dtypes[i]] end
  end
  if not ordered then table.sort(out, function(a, b) return a.indices[1] < b.indices[1] end) end
  return out
end

--- The buckets DDP reduces a list of parameters in, in the order it reduces them.  params:
-- the trainable parameters in registration order (DDP's _build_params_for_reducer: each
-- module's own, in named_modules() order, shared ones once), each {bytes, dtype}.  Returns
-- buckets {indices (1-based positions in params), bytes, dtype, limit}.  opts: bucket_cap_mb,
-- find_unused_parameters.  Without find_unused_parameters the buckets are the rebuilt ones, in
-- the order the gradients become ready, which a plan takes to be the reverse of the
-- registration order (a model that computes its layers in the order it registers them).
function R.buckets(params, opts)
  local find_unused = opts.find_unused_parameters == true
  local limits = R.limits(opts.bucket_cap_mb, find_unused)
  local items = {}
  for i, p in ipairs(params) do items[i] = { index = i, bytes = p.bytes, dtype = p.dtype } end
  if find_unused then
    -- the constructor's assignment, sorted, handed to the Reducer reversed
    local sorted = R.assign(items, limits, false)
    local out = {}
    for i = #sorted, 1, -1 do out[#out + 1] = sorted[i] end
    return out, limits
  end
  local ready = {}
  for i = #items, 1, -1 do ready[#ready + 1] = items[i] end
  return R.assign(ready, limits, true), limits
end

-- The options ctx:replicate takes: DDPConfig's (Automodel), and the axis of the ranks.
local OPTIONS = { "mesh", "bucket_cap_mb", "find_unused_parameters", "gradient_as_bucket_view", "static_graph",
  "broadcast_buffers" }
local FLAGS = { "find_unused_parameters", "gradient_as_bucket_view", "static_graph", "broadcast_buffers" }

-- The axis a replicate unit all-reduces over by default: the whole data-parallel group, the
-- FSDP mesh's ranks flattened (DDP's process group is the world in Automodel, where DDP takes
-- neither tp, pp nor ep).
local FLAT = { dp_shard = "dp_shard", ["dp_replicate,dp_shard"] = "dp", dp_shard_cp = "dp_shard_cp",
  ["dp_replicate,dp_shard_cp"] = "dp_cp" }

--- Fails unless opts is a table whose keys are all in the list `known` (where: the call,
-- for the message); shared with moonshard.plan_megatron.
function R.check_options(where, opts, known_list)
  if type(opts) ~= "table" then fail(string.format("%s: the options are a %s; expected a table", where, type(opts))) end
  for k in pairs(opts) do
    local known = false
    for _, o in ipairs(known_list) do known = known or k == o end
    if not known then
      fail(string.format("%s: unknown option %s (options: %s)", where,
        type(k) == "string" and "'" .. k .. "'" or shown(k), table.concat(known_list, ", ")))
    end
  end
end

--- The flattened data-parallel axis of ctx's FSDP mesh (dp_shard, dp, dp_shard_cp or dp_cp).
function R.flat_axis(ctx) return FLAT[table.concat(ctx.mesh.fsdp_axes, ",")] end

--- ctx:replicate(module, opts): DDP over `module`; see moonshard.plan's Ctx:replicate.
function R.replicate(ctx, module, opts)
  opts = opts or {}
  module = ctx:module(module)
  local name = ctx:name_of(module)
  local where = "replicate(" .. display(name) .. ")"
  R.check_options(where, opts, OPTIONS)
  local site = call_site()
  if ctx.pp then
    fail(string.format("%s: the model is split into pipeline stages; DDP takes no pipeline (Automodel's DDPConfig: " ..
      "no tensor, pipeline or expert parallelism)", where))
  end
  local prev = ctx.unit_of[module]
  if prev then
    -- torch.distributed._composable.replicate: "Cannot apply `replicate()` on a Module
    -- already managed by `fully_shard`"; a second replicate is refused alike
    fail(string.format("%s: the module is already a %s unit (at %s; now at %s): a module is one unit at most, and " ..
      "PyTorch cannot apply replicate() on a module already managed by fully_shard", where,
      prev.kind == "replicate" and "replicate" or "fully_shard", prev.site or "?", site or "?"), true)
  end
  local cap = opts.bucket_cap_mb
  if cap ~= nil and (type(cap) ~= "number" or cap ~= cap or cap <= 0 or cap == math.huge or
      math.floor(cap * R.MIB) < 1) then
    fail(string.format("%s: bucket_cap_mb is %s; expected a number of MiB > 0 (at least one byte; nil: PyTorch's " ..
      "default, 25 with a first bucket of 1 MiB)", where, shown(cap)))
  end
  for _, k in ipairs(FLAGS) do
    if opts[k] ~= nil and type(opts[k]) ~= "boolean" then
      fail(string.format("%s: %s is %s; expected true or false", where, k, shown(opts[k])))
    end
  end
  local axis = opts.mesh
  if type(axis) == "table" then
    if #axis ~= 1 then
      fail(string.format("%s: mesh has %d axes; a replicate unit takes one axis, the ranks holding the replicas " ..
        "(a flattened one such as dp or dp_cp for several)", where, #axis))
    end
    axis = axis[1]
  end
  if axis == nil then axis = R.flat_axis(ctx) end
  if type(axis) ~= "string" then
    fail(string.format("%s: mesh is %s; expected an axis name or a list of one", where, shown(axis)))
  end
  ctx.mesh:size(axis)
  -- DDP's parameters: every parameter under the module once, in named_parameters() order
  local params, trainable = {}, {}
  for _, np in ipairs(ctx:params_of(module)) do
    local fqn, p = np[1], np[2]
    local owner = ctx.owner[p]
    if owner then
      fail(string.format("%s: parameter %s is already in the %s unit %s; DDP would all-reduce it again: replicate " ..
        "a module with no unit under it", where, fqn, owner.kind == "replicate" and "replicate" or "fully_shard",
        display(owner.name)))
    end
    if ctx.ep[p] then
      fail(string.format("%s: parameter %s is placed by expert parallelism; DDP takes none (Automodel's DDPConfig: " ..
        "no expert parallelism)", where, fqn))
    end
    if ctx.tp[p] then
      fail(string.format("%s: parameter %s is placed by tensor parallelism (%s); DDP takes none (Automodel's " ..
        "DDPConfig: no tensor parallelism)", where, fqn, ctx.tp[p].style))
    end
    params[#params + 1] = p
    if p.requires_grad and FLOAT[p.dtype] then
      trainable[#trainable + 1] = { param = p, fqn = fqn,
        bytes = mul(p.numel, DTYPE_SIZE[p.dtype], "the gradient bytes of %s", fqn), dtype = p.dtype }
    end
  end
  local buckets, limits = R.buckets(trainable, opts)
  for i, b in ipairs(buckets) do
    b.index = i - 1
    b.params, b.fqns = {}, {}
    for j, k in ipairs(b.indices) do b.params[j], b.fqns[j] = trainable[k].param, trainable[k].fqn end
  end
  local unit = {
    name = name, module = module, mesh_axes = { axis }, kind = "replicate",
    -- DDP computes and reduces in the stored dtypes (no mixed precision policy)
    mp = { cast_forward_inputs = false },
    reshard_after_forward = false, raf_explicit = true,
    params = params, ignored = {}, dims = {}, index = #ctx.units + 1, site = site,
    buckets = buckets,
    ddp = { bucket_cap_mb = cap, limits = limits, find_unused_parameters = opts.find_unused_parameters == true,
      gradient_as_bucket_view = opts.gradient_as_bucket_view == true, static_graph = opts.static_graph == true,
      broadcast_buffers = opts.broadcast_buffers == true },
  }
  if unit.ddp.broadcast_buffers then
    ctx:warn(string.format("%s: broadcast_buffers: DDP broadcasts the module's buffers from rank 0 before every " ..
      "forward; the plan does not count that broadcast", where))
  end
  for _, p in ipairs(params) do ctx.owner[p] = unit end
  ctx.units[#ctx.units + 1] = unit
  ctx.unit_of[module] = unit
  return unit
end

--- A replicate unit's figures, after plan_layout laid it out as a unit of one shard rank:
-- nothing is gathered; the gradients are all-reduced over the unit's R ranks, one
-- all_reduce per bucket (nccl-tests bus bytes 2*S*(R-1)/R each, S its bytes; none when R = 1,
-- where Automodel does not wrap the model); DDP's bucket buffers (the flat gradient of every
-- bucket) come on top of the parameters' gradients unless gradient_as_bucket_view.
function R.finish(unit, R_size)
  unit.unsharded_bytes, unit.unsharded_grad_bytes = 0, 0
  local bytes, buffers = 0, 0
  for _, b in ipairs(unit.buckets) do
    local S = mul(2, b.bytes, "the all-reduce bytes of unit %s", display(unit.name))
    bytes = add(bytes, S - util.ceil_div(S, R_size), "the all-reduce bytes of unit %s", display(unit.name))
    buffers = add(buffers, b.bytes, "the bucket bytes of unit %s", display(unit.name))
  end
  unit.bucket_buffer_bytes = unit.ddp.gradient_as_bucket_view and 0 or buffers
  local ar = R_size > 1 and #unit.buckets > 0 and { n = R_size, bytes = bytes, count = #unit.buckets } or nil
  unit.comm.all_reduce = ar
  unit.all_reduce_bytes = ar and ar.bytes or 0
end

return R
