-- moonshard.plan_layout: a shard unit's layout, as FSDP2 makes it (see moonshard.plan): per
-- parameter its shard dim and padded shard, per unit its dtypes, sizes and collectives.

local util = require "moonshard.util"
local replicate = require "moonshard.plan_replicate"
local megatron = require "moonshard.plan_megatron"

local L = {}

-- The planner's helpers (moonshard.plan gives them to bind): its errors and checked sums.
local plan, fail, add, mul, display, count_str, DTYPE_SIZE, FLOAT

--- Takes the planner's helpers h (plan: the planner module; fail, add, mul, display,
-- count_str, DTYPE_SIZE, FLOAT); returns L.
function L.bind(h)
  plan, fail, add, mul, display, count_str = h.plan, h.fail, h.add, h.mul, h.display, h.count_str
  DTYPE_SIZE, FLOAT = h.DTYPE_SIZE, h.FLOAT
  return L
end

-- Shape FSDP sees: an expert parameter sharded on ep_shard is already ep-local, a
-- tensor-parallel one tp-local (FSDP2 shards the DTensor's local tensor).
local function fsdp_shape(ctx, p)
  local t = ctx.tp[p]
  if t then return t.local_shapes[(ctx.tp_variant or 0) + 1] end
  local e = ctx.ep[p]
  return e and e.local_shape or p.shape
end

local function shard_dim(unit, fqn, p, W, shape)
  local d = unit.dims[p] or 0
  local nd = #p.shape
  if nd == 0 then
    fail(string.format("parameter %s of unit %s is a scalar (0-dim); FSDP cannot shard it", fqn, display(unit.name)))
  end
  if not util.is_int(d) or d < -nd or d >= nd then
    fail(string.format("shard dim %s of parameter %s is out of range for %d dims", tostring(d), fqn, nd))
  end
  if d < 0 then d = d + nd end
  if d ~= 0 and (shape or p.shape)[d + 1] % W ~= 0 then
    fail(string.format("parameter %s: Shard(%d) needs size %d divisible by the shard size %d", fqn, d,
      (shape or p.shape)[d + 1], W))
  end
  return d
end

-- The dim shard_placement_fn gave, checked as fully_shard takes it (so the error names the
-- policy line that called fully_shard).
local function check_shard_dim(ctx, unit, fqn, p, d)
  if d == nil then return end
  shard_dim(unit, fqn, p, ctx.mesh:size(unit.mesh_axes[#unit.mesh_axes]), fsdp_shape(ctx, p))
end

local function numel_of(shape)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  return n
end

-- FSDP2 roots: every unit no other unit's module contains (the first to run forward claims
-- the units inside it; a unit outside all others becomes a root of its own).  A root's
-- reshard_after_forward defaults to false.
local function mark_roots(ctx)
  local by_name = {}
  for _, u in ipairs(ctx.units) do by_name[ctx:name_of(u.module)] = true end
  for _, u in ipairs(ctx.units) do
    local name = ctx:name_of(u.module)
    local outer = name ~= "" and by_name[""]
    for i in name:gmatch("()%.") do outer = outer or by_name[name:sub(1, i - 1)] end
    u.fsdp_root = not outer
  end
end

local function reshard_value(unit, W)
  local raf = unit.reshard_after_forward
  if raf == nil then raf = not (unit.fsdp_root or unit.kind == "root") end
  if util.is_int(raf) then
    if raf < 1 or raf > W or W % raf ~= 0 then
      fail(string.format("unit %s: reshard_after_forward = %s must divide the shard size %d (1 <= k <= %d)",
        display(unit.name), count_str(raf), W, W))
    end
    if raf == 1 then raf = false elseif raf == W then raf = true end
  end
  return raf
end

local function finish_unit(ctx, unit, fqn_of)
  local axes = unit.mesh_axes
  -- a replicate unit (DDP) is laid out as a unit of one shard rank replicated over its axis
  -- (a megatron_fsdp unit too: moonshard.plan_megatron lays out its flat buffers)
  local replicated = unit.kind == "replicate" or unit.kind == "megatron_fsdp"
  local W = replicated and 1 or ctx.mesh:size(axes[#axes])
  local R = (#axes == 2 or replicated) and ctx.mesh:size(axes[1]) or 1
  unit.shard_size, unit.replicate_size = W, R
  unit.reshard = reshard_value(unit, W)
  local stored, reduce, gather_bytes, shard_numel, numel, padded_total = nil, nil, 0, 0, 0, 0
  local grad_shard_bytes, param_shard_bytes, trainable_shard = 0, 0, 0
  local dtypes, reduces, gathers = {}, {}, {}
  -- a packed unit (fully_shard's islands): the FSDP2 rules below hold for the module's own
  -- parameters and for each island's, as if each were its own unit; one reduce-scatter (and
  -- HSDP all-reduce) per distinct reduce dtype, in the order the parameters meet them
  local group_of = {}
  local groups = { { stored = {}, reduce = {}, what = "" } }
  for i, isl in ipairs(unit.islands or {}) do
    groups[i + 1] = { stored = {}, reduce = {}, what = string.format(" (island %s)", display(isl.name)) }
    for _, p in ipairs(isl.params) do group_of[p] = i + 1 end
  end
  local reduce_groups, reduce_order = {}, {}
  local uname = display(unit.name)
  unit.entries = {}
  -- A padded shard holds at most the parameter's elements, each at most 8 bytes in any
  -- dtype (checked in M.plan); what is gathered over W ranks can hold more: checked.
  for _, p in ipairs(unit.params) do
    local fqn = fqn_of[p]
    local shape = fsdp_shape(ctx, p)
    -- (DDP replicates a 0-dim parameter too; FSDP cannot shard one)
    local d = replicated and 0 or shard_dim(unit, fqn, p, W, shape)
    local padded = util.copy(shape)
    if #shape > 0 then padded[d + 1] = util.ceil_div(shape[d + 1], W) end
    local pn = numel_of(padded)
    local gather, red = plan.effective_dtypes(p.dtype, plan.param_mp(unit, p))
    -- torchao's float8 all-gather (a recipe's fp8 step): the weight is cast to e4m3 with its
    -- tensorwise scale before FSDP gathers it (torchao/float8/fsdp_utils.py fsdp_pre_all_gather)
    if p.fp8_gather and not replicated then gather = "f8e4m3" end
    -- a 4-bit weight's packed codes (a recipe's quantization) travel in their storage dtype:
    -- a cast would scramble them (plan.lua warns when the policy asks for one)
    if p.quant then gather = p.dtype end
    -- FSDP2 (_init_mp_dtypes) asks one stored dtype of the trainable parameters only
    local g = groups[group_of[p] or 1]
    if p.requires_grad and FLOAT[p.dtype] then
      g.stored[p.dtype] = g.stored[p.dtype] or {}
      table.insert(g.stored[p.dtype], fqn)
    end
    if p.requires_grad and FLOAT[p.dtype] then
      g.reduce[red] = g.reduce[red] or {}
      table.insert(g.reduce[red], fqn)
      local rb = mul(pn, DTYPE_SIZE[red], "the gradient shard bytes of parameter %s", fqn)
      grad_shard_bytes = add(grad_shard_bytes, rb, "the gradient shard bytes of unit %s", uname)
      if not reduce_groups[red] then
        reduce_groups[red] = { dtype = red, shard_bytes = 0 }
        reduce_order[#reduce_order + 1] = red
      end
      reduce_groups[red].shard_bytes = reduce_groups[red].shard_bytes + rb
      trainable_shard = trainable_shard + pn
    end
    if not group_of[p] then
      if (p.requires_grad and FLOAT[p.dtype]) or stored == nil then stored = p.dtype end
      reduce = (p.requires_grad and FLOAT[p.dtype]) and red or reduce
    end
    gathers[gather] = true
    gather_bytes = add(gather_bytes, pn * DTYPE_SIZE[gather], "the gathered shard bytes of unit %s", uname)
    param_shard_bytes = add(param_shard_bytes, pn * DTYPE_SIZE[p.dtype], "the shard bytes of unit %s", uname)
    shard_numel = add(shard_numel, pn, "the shard elements of unit %s", uname)
    numel = add(numel, numel_of(shape), "the elements of unit %s", uname)
    padded_total = add(padded_total, mul(pn, W, "the elements of parameter %s gathered over the %d ranks of unit %s", fqn, W, uname),
      "the padded elements of unit %s over %d ranks", uname, W)
    unit.entries[#unit.entries + 1] = { fqn = fqn, param = p, shape = shape, dim = d, padded = padded,
      gather = gather, reduce = red }
  end
  -- One stored dtype and one reduce dtype per unit: FSDP2 fails lazily, we fail now.
  local function uniform(groups, what, where)
    local keys = {}
    for k in pairs(groups) do keys[#keys + 1] = k end
    if #keys > 1 then
      table.sort(keys)
      local parts = {}
      for _, k in ipairs(keys) do
        local names = groups[k]
        parts[#parts + 1] = string.format("%s: %s%s", k, table.concat(names, ", ", 1, math.min(#names, 4)),
          #names > 4 and string.format(" (and %d more)", #names - 4) or "")
      end
      fail(string.format("unit %s%s mixes %s dtypes (%s); FSDP expects one per unit: shard those parameters " ..
        "in a unit of their own", display(unit.name), where, what, table.concat(parts, "; ")))
    end
  end
  -- (DDP takes any mix: its buckets split by dtype)
  if not replicated then
    for _, g in ipairs(groups) do
      uniform(g.stored, "stored", g.what)
      uniform(g.reduce, "reduce", g.what)
    end
  end
  -- (the module's own parameters give the unit's stored and reduce dtype; a packed unit
  -- whose module holds none takes its first island's)
  if unit.packed and stored == nil then
    for _, e in ipairs(unit.entries) do
      local p = e.param
      if (p.requires_grad and FLOAT[p.dtype]) or stored == nil then stored = p.dtype end
      if p.requires_grad and FLOAT[p.dtype] then reduce = reduce or e.reduce end
    end
  end
  unit.stored_dtype, unit.reduce_dtype_eff = stored, reduce
  -- parameters gathered in more than one dtype travel as bytes (FSDP2's uint8 all-gather)
  unit.gather_dtype = next(gathers)
  if next(gathers, unit.gather_dtype) then unit.gather_dtype = "bytes" end
  unit.numel, unit.shard_numel, unit.padded_numel = numel, shard_numel, padded_total
  unit.param_shard_bytes, unit.grad_shard_bytes = param_shard_bytes, grad_shard_bytes
  unit.trainable_shard_numel = trainable_shard
  -- the all-gather output: every rank's padded shard
  unit.unsharded_bytes = mul(gather_bytes, W, "the gathered bytes of unit %s over %d ranks", uname, W)
  unit.unsharded_grad_bytes = 0
  for _, e in ipairs(unit.entries) do
    if e.param.requires_grad and FLOAT[e.param.dtype] then
      unit.unsharded_grad_bytes = add(unit.unsharded_grad_bytes, numel_of(e.padded) * W * DTYPE_SIZE[e.gather],
        "the unsharded gradient bytes of unit %s", uname)
    end
  end
  -- Collectives per step, as nccl-tests bus bytes one rank moves.  S*(n-1)/n, floored, is
  -- S - ceil(S/n): no product that could pass 2^53.
  local function bus(S, n) return S - util.ceil_div(S, n) end
  local ag, rs, ar = {}, nil, nil
  if W > 1 and #unit.params > 0 then
    local S = unit.unsharded_bytes
    ag[#ag + 1] = { n = W, bytes = bus(S, W) }          -- forward
    if unit.reshard == true then
      ag[#ag + 1] = { n = W, bytes = bus(S, W) }        -- backward re-gather
    elseif util.is_int(unit.reshard) then
      local k = unit.reshard
      ag[#ag + 1] = { n = k, bytes = bus(S, k) }        -- k-way re-gather
    end
    if grad_shard_bytes > 0 then
      rs = { n = W, bytes = mul(grad_shard_bytes, W - 1, "the reduce-scatter bytes of unit %s", uname) }
    end
  end
  if R > 1 and grad_shard_bytes > 0 then
    ar = { n = R, bytes = bus(mul(2, grad_shard_bytes, "the all-reduce bytes of unit %s", uname), R) }
  end
  -- a packed unit reduces each reduce dtype's gradients in a collective of their own (one
  -- reduce-scatter, and under HSDP one all-reduce, per dtype): count and bytes by dtype
  if unit.packed and not replicated then
    local by = {}
    for i, d in ipairs(reduce_order) do
      local g = reduce_groups[d]
      by[i] = { dtype = d, shard_bytes = g.shard_bytes,
        reduce_scatter_bytes = W > 1 and #unit.params > 0 and g.shard_bytes * (W - 1) or 0,
        all_reduce_bytes = R > 1 and bus(2 * g.shard_bytes, R) or 0 }
    end
    if rs then rs.count, rs.by_dtype = #by, by end
    if ar then
      ar.count, ar.by_dtype, ar.bytes = #by, by, 0
      for _, g in ipairs(by) do ar.bytes = add(ar.bytes, g.all_reduce_bytes, "the all-reduce bytes of unit %s", uname) end
    end
    unit.reduce_dtypes = reduce_order
  end
  unit.comm = { all_gather = ag, reduce_scatter = rs, all_reduce = ar }
  if unit.packed then unit.packing = L.packing_saved(unit, groups, group_of, W, R, #ag) end
  unit.all_gather_bytes, unit.reduce_scatter_bytes, unit.all_reduce_bytes = 0, rs and rs.bytes or 0, ar and ar.bytes or 0
  for _, c in ipairs(ag) do
    unit.all_gather_bytes = add(unit.all_gather_bytes, c.bytes, "the all-gather bytes of unit %s", uname)
  end
  if unit.kind == "replicate" then replicate.finish(unit, R) end
  unit.padding_fraction = padded_total > 0 and (padded_total - numel) / padded_total or 0
  unit.gather_bytes_per_rank = ag[1] and ag[1].bytes or 0
  if unit.kind == "megatron_fsdp" then megatron.finish(unit, R) end
end

--- What packing saved a packed unit against sharding each island as a unit of its own with
-- the unit's options (a unit for the module's own parameters when it has any, and one per
-- island): per gather of the units (each all-gather the unit makes: forward, and the
-- backward re-gather when it reshards; an island's own unit, nested in the module's and so
-- never an FSDP root, re-gathers by default, even where the packed unit is a root that
-- does not), all_gather; per step, reduce_scatter and all_reduce
-- (one each for every separate unit with gradients, against the packed unit's one per
-- reduce dtype).  {all_gather, reduce_scatter, all_reduce}; all 0 when the unit has no
-- collectives (a shard of one rank).
function L.packing_saved(unit, groups, group_of, W, R, gathers)
  local params, grads = {}, {}
  for _, p in ipairs(unit.params) do
    local g = group_of[p] or 1
    params[g] = true
    if p.requires_grad and FLOAT[p.dtype] then grads[g] = true end
  end
  local units, with_grads = 0, 0
  for i = 1, #groups do
    if params[i] then units = units + 1 end
    if grads[i] then with_grads = with_grads + 1 end
  end
  local rs = unit.comm.reduce_scatter
  local ar = unit.comm.all_reduce
  local saved = { all_gather = 0, reduce_scatter = 0, all_reduce = 0 }
  if W > 1 and units > 0 then
    local raf = unit.reshard_after_forward
    if raf == nil then raf = true end -- a nested unit's default
    if util.is_int(raf) then raf = raf ~= 1 end
    local island_units = units - (params[1] and 1 or 0)
    saved.all_gather = (params[1] and gathers or 0) + island_units * (raf and 2 or 1) - gathers
  end
  if rs then saved.reduce_scatter = with_grads - (rs.count or 1) end
  if ar and R > 1 then saved.all_reduce = with_grads - (ar.count or 1) end
  return saved
end

--- Lays out every unit of ctx: marks the FSDP2 roots, then each unit's shards, dtypes,
-- sizes and collectives (fqn_of: param -> its name).
function L.lay_out(ctx, fqn_of)
  mark_roots(ctx)
  for _, u in ipairs(ctx.units) do finish_unit(ctx, u, fqn_of) end
end

L.check_shard_dim, L.numel_of = check_shard_dim, numel_of

return L
